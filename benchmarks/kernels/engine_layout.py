"""Decode-attention inputs in the engine's tiered pool layout, built by the engine's own code.

    engine_tier_counts(ctx, mix, Hkv, D)            -> (n16, n8, n4) tokens of one request
    build_engine_layout(B, counts, Hkv, D, ...)     -> EngineLayout: one layer + FILLED tables of
                                                       `copies` batches, as the tiered backend sees them
    build_paged_fp16(B, ctx, Hkv, D, ...)           -> PagedFp16Layout: page-64 K/V pages + one block
                                                       table per copy (the paged fp16 pool's decode)

Copies (common/bandwidth.py's rotation) are batches of B requests on disjoint pages of one
pool, each with its own row views of the tables. The engine layout is not imitated: a
TieredKVPool and a TieredSlotAllocator hand out the ids, `tiered_rows.tier_block_tables` builds
the tables from the request rows and `tiered_rows.tier_layer_view` the layer's views
(mem_cache/README.md sections 7-8):

    fp16 store   [n16 + 2, Hkv, 1, D]     pages of ONE token (slot rows), model dtype
    int8 / int4  [pages, Hkv, BLOCK]      page-head blocks of PAGE (default: the engine's
                                          kv_tier_page_size) tokens: codes (V dim-major), then one
                                          fp16 scale and one zero per token and kv head (G = D)
    tables       filled form, width L = ctx for every tier (eager decode's L = the longest request)

Each request's tokens of a tier are one run on fresh pages, as the prefill re-tiering leaves them
(every int page full but the tier's last), in the page order of a freshly started pool. Pool
contents are random codes and scales (values do not change a kernel's time).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# the engine's defaults (EngineConfig): decode window kept fp16, int page size, sinks, policy
DECODE_RECENT = 64
FP16_PAGE = 64  # the paged fp16 pool's page (triton backend)
MIXES = ("fp16", "int8", "int4", "mix_b0.5")


def engine_int_page() -> int:
    from sgl_kvxfer.config import EngineConfig

    return EngineConfig().kv_tier_page_size


def planned_mix(budget: float, Hkv: int, D: int) -> tuple[float, ...]:
    """(f16, f8, f4, f_drop) SpectrumKV plans at `budget` for this head shape: the engine's default
    policy, budget unit, sinks and group size G = D (spectrum/byte_budget.planned_fractions)."""
    from sgl_kvxfer.config import EngineConfig
    from sgl_kvxfer.spectrum.budget import KVLayout
    from sgl_kvxfer.spectrum.byte_budget import planned_fractions
    from sgl_kvxfer.spectrum.policies import create_tier_policy

    c = EngineConfig()
    return planned_fractions(create_tier_policy(c.kv_tier_policy), budget, KVLayout(1, Hkv, D, D),
                             c.kv_budget_unit, c.kv_sink_tokens, True)


def engine_tier_counts(ctx: int, mix: str, Hkv: int, D: int) -> tuple[int, int, int]:
    """(n16, n8, n4) of one request of `ctx` cached tokens. "fp16" / "int8" / "int4": all tokens
    in that tier; "mix_b<b>": the newest DECODE_RECENT tokens fp16 (the decode window), the rest
    at the planned mix of budget b (dropped tokens are left out, so the counts may sum below ctx)."""
    if mix in ("fp16", "int8", "int4"):
        return tuple(ctx if m == mix else 0 for m in ("fp16", "int8", "int4"))
    if not mix.startswith("mix_b"):
        raise ValueError(f"unknown tier mix {mix!r}; choose from {MIXES} or mix_b<budget>")
    f16, f8, f4, _ = planned_mix(float(mix[len("mix_b"):]), Hkv, D)
    window = min(DECODE_RECENT, ctx)
    rest = ctx - window
    n8, n4 = int(round(rest * f8)), int(round(rest * f4))
    n16 = window + min(int(round(rest * f16)), rest - n8 - n4)
    return n16, n8, n4


def batch_slice(tables, start: int, stop: int):
    """Rows [start, stop) of block tables: views (the engine's tables are per-batch rows too)."""
    from sgl_kvxfer.kernels.paged_layout import TieredBlockTables

    cut = lambda xs: tuple(x[start:stop] for x in xs) if xs is not None else None  # noqa: E731
    return TieredBlockTables(cut(tables.tables), cut(tables.lens), cut(tables.fills), cut(tables.num_pages))


@dataclass
class EngineLayout:
    layer: object  # TieredKVLayer: the views tier_layer_view gives the backend
    tables: list  # per copy: filled TieredBlockTables of B requests (row views of one table)
    counts: tuple  # (n16, n8, n4) per request
    max_tokens: int  # table width L
    pool: object  # the TieredKVPool that owns the storage
    slots: torch.Tensor  # int64 [copies * B, L] request rows of global slot ids (req_to_token's)

    @property
    def tiers(self) -> tuple:
        """The tiers that hold tokens (the others are not launched)."""
        return tuple(t for t, n in enumerate(self.counts) if n > 0)

    def kv_bytes(self, D: int, elem_bytes: int) -> int:
        """K + V bytes one copy's requests hold (scales included): what one call must read."""
        from sgl_kvxfer.kernels.tier_codec import payload_bytes

        B, Hkv = self.tables[0].batch_size, self.layer.num_kv_heads
        per_tok = [payload_bytes(t, D, D, elem_bytes) for t in range(3)]
        return 2 * B * Hkv * sum(c * p for c, p in zip(self.counts, per_tok))


def build_engine_layout(B: int, counts: tuple, Hkv: int, D: int, dtype=torch.float16, device="cpu",
                        copies: int = 1, page_size: int | None = None, seed: int = 0) -> EngineLayout:
    """`copies` x B requests holding counts = (n16, n8, n4) tokens each in one TieredKVPool layer;
    copy i is the batch of requests [i B, (i + 1) B) (disjoint pages: rotation without copies of
    the pool's tensors). page_size: the int stores' (default: the engine's)."""
    from sgl_kvxfer.kernels.testing import fill_random_pools
    from sgl_kvxfer.mem_cache.tier_plan import TierStorePlan
    from sgl_kvxfer.mem_cache.tiered_allocator import TieredSlotAllocator
    from sgl_kvxfer.mem_cache.tiered_pool import TieredKVPool
    from sgl_kvxfer.mem_cache.tiered_rows import tier_block_tables, tier_layer_view

    page_size = page_size or engine_int_page()
    n16, n8, n4 = counts
    R = copies * B
    plan = TierStorePlan(max(16, R * n16), *(R * math.ceil(n / page_size) * page_size for n in (n8, n4)))
    device = str(device)
    pool = TieredKVPool(plan.total, 1, Hkv, D, dtype, device, plan, group_size=D, page_size=page_size)
    alloc = TieredSlotAllocator(pool, device)
    L = max(1, n16 + n8 + n4)
    slots = torch.zeros(R, L, dtype=torch.int64, device=device)
    for r in range(R):
        row = torch.cat([alloc.alloc(n16), alloc.alloc_tier(1, n8), alloc.alloc_tier(2, n4)])
        slots[r, :row.numel()] = row
    seq_lens = torch.full((R,), n16 + n8 + n4, dtype=torch.int64, device=device)
    all_tables = tier_block_tables(pool, slots, seq_lens)
    layer = tier_layer_view(pool, 0)
    fill_random_pools(layer, seed=seed)
    tables = [batch_slice(all_tables, i * B, (i + 1) * B) for i in range(copies)]
    return EngineLayout(layer, tables, tuple(counts), L, pool, slots)


@dataclass
class PagedFp16Layout:
    k_pages: torch.Tensor  # [pages, Hkv, PAGE, D] (page 0 unused, as the pool's padding page)
    v_pages: torch.Tensor
    tables: list  # per copy: int32 [B, cdiv(ctx, PAGE)] block table rows
    seq_lens: torch.Tensor  # int32 [B]


def build_paged_fp16(B: int, ctx: int, Hkv: int, D: int, dtype=torch.float16, device="cpu", copies: int = 1,
                     page_size: int = FP16_PAGE, seed: int = 0) -> PagedFp16Layout:
    """K/V pages of a PagedFp16KVPool layer holding `copies` x B requests of ctx tokens, each
    request on random distinct pages; one block table per copy."""
    npg, R = math.ceil(ctx / page_size), copies * B
    g = torch.Generator(device=device).manual_seed(seed)
    shape = (R * npg + 1, Hkv, page_size, D)
    k = torch.randn(shape, dtype=dtype, device=device, generator=g)
    v = torch.randn(shape, dtype=dtype, device=device, generator=g)
    table = (torch.randperm(R * npg, generator=torch.Generator().manual_seed(seed)) + 1).to(torch.int32)
    table = table.view(R, npg).to(device)
    return PagedFp16Layout(k, v, [table[i * B:(i + 1) * B] for i in range(copies)],
                           torch.full((B,), ctx, dtype=torch.int32, device=device))
