"""Split-K decode attention over the engine's TieredKVPool: fp16 slot rows + int8 / int4 page-head blocks.

    tiered_pool_decode(q, layer, tables, sm_scale=None, out=None, plan=None, config=None,
                       tiers=(0, 1, 2), check=True) -> o
    plan_tiered_pool_decode(batch_size, num_kv_heads, max_tokens, device, config=None) -> TieredDecodePlan
    served_config(head_dim, kv_group, override=None) -> TieredDecodeConfig   (SERVED_CONFIGS per head shape)
    served_int_page(head_dim, kv_group) -> int | None   (the int page that config was timed at)
    tiered_pool_decode_reference(q, layer, tables, sm_scale=None, q_int=None) -> o   (torch, fp32)
    qk_int8_rounded_q(q) -> q~   (the q that qk_int8 attends with)

q, o   [B, Hq, D] model dtype (fp16 / bf16), one new token per request
layer  TieredKVLayer (paged_layout.py): fp16 tier at any power-of-two page size (the engine's store
       is rows, PAGE 1), int8 / int4 tiers as page-head blocks of PAGE >= 16 tokens
tables TieredBlockTables, FILLED or dense form; no host sync anywhere (CUDA-graph capturable)

One launch per tier in `tiers` (the backend leaves out a store that holds no page), each grid
(B * Hkv, S). Program (b, kv head, s) holds the q heads of that kv head as the M rows of every
tl.dot (GQA: each K/V byte is read once per kv head) and split s of the tier's listed pages:

    virtual slots l = j * PAGE + slot (listed page j), walked TILE a step: a page of PAGE >= TILE
    in TILE-slot chunks (one page id per step, one contiguous run per stream), smaller pages
    TILE / PAGE at a time (their ids loaded as a vector; PAGE 1: the fp16 store's row gather)
    steps = cdiv(num_pages * PAGE, TILE);  split s takes steps [s * steps // S, (s + 1) * steps // S)
    (row_splits, PAGE < TILE: the slots [s * n // S, (s + 1) * n // S) of the n = num_pages * PAGE,
    cut at any slot, so a request's splits read equal rows +-1; the fp16 store's row gather)

so S is a host number (plan_tiered_pool_decode: at most `split_waves` programs per SM, no split
under `min_split_tokens` of the context bound). Every split writes its normalized partial and its
log2-sum-exp into [B, Hq, S_total, D] (tier t owns splits [t_base, t_base + S)); an empty split
writes only lse = NEG_BIG. The merge weighs them (empty: weight 0), MERGE_S partials per L2 round
trip (merge_prefetch: the next chunk in flight while one is reduced): with `fused_merge` the last
program of each (b, kv head) to finish, over all launched tiers, merges in place (a counter per
(b, kv head), reset by that program); otherwise one small merge launch follows. One launched tier
and S == 1: the program writes o itself.

Per step (log2-domain online softmax, fp32 accumulate):
  fp16   TILE rows (PAGE < TILE: page ids gathered per slot; PAGE 1 is a row gather), dots in the
         model dtype
  int8   G = D (FOLD): codes go to tl.dot as exact fp16 integers, scale and zero stay outside the
         inner products:  score = ks * (q . c) + kz * sum(q);  o += (p * vs) @ c + sum(p * vz)
  int4   FOLD on split halves (tier_codec): q . k = q[:D/2] . lo + q[D/2:] . hi, P @ V into a low
         and a high accumulator, stored as the two halves of the partial (never interleaved)
  G < D  codes dequantized per element (scale of its group), plain dots
Int-tier dots run on fp16 operands whatever the model dtype (q is rounded to fp16 once; a bf16
q in fp16's normal range converts exactly). qk_int8: q quantized per head to int8 (one scale per
row) and q . codes on int8 tensor cores (codes - 128 for int8, the nibbles as they are for int4);
the zero-point term uses the same rounded q, so the result is attention of q~ = round(q / s) * s
(qk_int8_rounded_q; s = max|q| / 127 per head) over the tiers;
fast_cvt: codes -> fp16 with byte-permute / LOP3 instructions (GPU only; bit-identical to the
portable conversion).
No load of a step waits on a loaded fill (Triton's pipeliner could not prefetch it): page ids and
fills load side by side, int codes and scales and the fp16 rows of listed pages load unmasked,
and the fills cut masked slots at the scores (int V scales / zeros there are set to 0).
Hazard: every slot of a listed fp16 page must hold finite values (a NaN there meets P @ V with
p = 0); the engine's fp16 store is zero-initialized and written with finite K / V only.
Attention over a set is order-free (K is post-RoPE), so tiers, pages and splits combine exactly.
The jitted kernels live in _tiered_decode_kernels.py.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

import torch

from ._split_k import LOG2E
from ._tiered_decode_kernels import _fp16_tier_kernel, _int_tier_kernel, _merge_kernel
from ._tiles import is_interpret, next_pow2, num_sms
from .paged_layout import TieredBlockTables, TieredKVLayer, gather_request_kv
from .tier_codec import TIER_FP16, TIER_INT4, TIER_INT8, TIERS


@dataclass(frozen=True)
class TieredDecodeConfig:
    """Launch knobs, per tier (16 / 8 / 4): tile = tokens per loop step (power of two >= 16; several
    pages a step when PAGE < tile), warps and software-pipeline stages. Stages: every tier's codes
    or rows load behind a loaded page id, and Triton's pipeliner splits its stages between the two
    levels: 3 stages prefetch one step ahead, 5 two (2 keeps the page ids out of the pipeline).
    The defaults hold one 256-token int step (4 warps, ~200 registers: two programs per SM) or
    one 128-row fp16 step (8 warps) in flight per program. qk_int8: q . K on int8 tensor
    cores (int tiers, G = D). fast_cvt: PRMT / LOP3 code conversion (GPU). dot_cvt (int tiers,
    G = D): codes converted after they reach the dot operand layout (K read transposed, one-result
    conversions), so the shared-memory round trip carries codes, not fp16 values. sub_cvt (with
    dot_cvt): codes become exact fp16 subnormals c * 2^-24 (one PRMT per two int8 codes, no bias
    subtraction), the factor taken out by exact power-of-two multiplies. split_waves: stage-1
    programs per SM the planner aims for; min_split_tokens: no split gets fewer context tokens.
    fused_merge: the last split program merges (no merge launch). min_steps (int tiers): a split
    whose tokens fill fewer steps than this runs half the tile with half the warps (at least 4),
    down to a 64-token tile (short splits, e.g. batch 1, keep more steps in the pipeline; 0: off).
    The fp16 tier keeps its tile: on an H200 at Llama-3-8B heads, batch 1, 32k its halved launch
    (64 rows, 4 warps, 3 stages) took 50.4 us and the whole 128-row tile at 4 warps 44.2-44.8 us.
    row_splits: a tier walked several pages a step (PAGE < tile: the fp16 store's rows) splits each
    request at slot granularity, not at step granularity (equal bytes per split program).
    merge_prefetch: the merge issues the next chunk's partial loads before it reduces this chunk
    (two chunks live: compiled for sm_90 by Triton 3.9 the kernels take more registers, e.g. the
    fp16 kernel at 8 warps 109 -> 166, one program per SM instead of two; off by default, a sweep
    knob).
    one_launch: every launched tier in one grid, each program a byte-equal share of its request's
    steps over all tiers (_tiered_one_launch.py; int tiers with G = D and no qk_int8, else the
    per-tier launches): no launch, ramp and tail per small tier, S partials to merge instead of
    S per tier. Tiles and stages stay per tier (min_steps does not apply), the warps are one
    number: the int8 tier's (else int4's, else fp16's)."""

    tile16: int = 128
    tile8: int = 256
    tile4: int = 256
    warps16: int = 8
    warps8: int = 4
    warps4: int = 4
    stages16: int = 3
    stages8: int = 3
    stages4: int = 3
    qk_int8: bool = False
    fast_cvt: bool = True
    dot_cvt: bool = False
    sub_cvt: bool = False
    split_waves: float = 2.0
    min_split_tokens: int = 512
    fused_merge: bool = True
    min_steps: int = 0
    row_splits: bool = True
    merge_prefetch: bool = False
    one_launch: bool = False

    def __post_init__(self):
        for name in ("tile16", "tile8", "tile4"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"TieredDecodeConfig.{name} must be a power of two >= 16, got {v}")
        for name in ("warps16", "warps8", "warps4"):
            if getattr(self, name) not in (1, 2, 4, 8, 16):
                raise ValueError(f"TieredDecodeConfig.{name} must be 1, 2, 4, 8 or 16")
        for name in ("stages16", "stages8", "stages4"):
            if not 1 <= getattr(self, name) <= 6:
                raise ValueError(f"TieredDecodeConfig.{name} must be in [1, 6]")
        if not 0 <= self.min_steps <= 1024:
            raise ValueError(f"TieredDecodeConfig.min_steps must be in [0, 1024], got {self.min_steps}")
        if not self.split_waves > 0 or self.min_split_tokens < 1:
            raise ValueError(f"bad split_waves / min_split_tokens: {self.split_waves} / {self.min_split_tokens}")

    def launch(self, tier: int, split_tokens: Optional[int] = None) -> tuple[int, int, int]:
        """(tile, num_warps, num_stages) of a tier; split_tokens (a host number: the widest
        request's tokens of this tier over the split count) applies min_steps to an int tier."""
        sfx = {TIER_FP16: "16", TIER_INT8: "8", TIER_INT4: "4"}[tier]
        tile, warps, stages = getattr(self, "tile" + sfx), getattr(self, "warps" + sfx), getattr(self, "stages" + sfx)
        if self.min_steps and split_tokens is not None and tier != TIER_FP16:
            while tile > 64 and split_tokens < self.min_steps * tile:
                tile, warps = tile // 2, max(min(4, warps), warps // 2)
        return tile, warps, stages


DEFAULT_CONFIG = TieredDecodeConfig()
# The interpreter: small tiles keep CPU tests fast.
INTERPRET_CONFIG = TieredDecodeConfig(tile16=16, tile8=16, tile4=16, stages16=1, stages8=1, stages4=1)
# The served defaults per (head_dim, q heads per kv head). Chosen by the same-run sweep of
# benchmarks/kernels/attention.py (its JSON "sweep.best" lists the winner per shape, ready to paste
# here); a shape not listed takes DEFAULT_CONFIG. The sweep timed these at 256-token int pages
# (--kv-tier-page-size 256); the knobs are page-size independent (the kernels walk PAGE < tile
# several pages a step), the timings are not.
SERVED_CONFIGS: dict[tuple[int, int], TieredDecodeConfig] = {
    # SmolLM2; the fp16 tier at 64-row steps, 2 warps, 5 stages from two same-call sweeps on an
    # H200 (attention_smollm2_fp16_sweep_{a,b}_NVIDIA_H200.json): 59.3 / 57.8 us against 63.9 /
    # 66.0 for 128-row steps at 4 warps; split_waves (the int tiers' plan) unchanged
    (64, 3): TieredDecodeConfig(dot_cvt=True, sub_cvt=True, tile16=64, warps16=2, stages16=5, split_waves=3),
    # Llama-3-8B; warps16=4 from the H200 fp16 sweep (attention_fp16_sweep2_NVIDIA_H200.json):
    # batch 1 44.2 us against 50.4 served before, batch 8 253.5 against 256.0. one_launch from the
    # same-run A/B on the H200 (attention_one_launch_ab_NVIDIA_H200.json; the H100 sweep at e014cdc
    # picked it too): the b = 0.5 mix at 32k 42.1 / 150.0 / 525.2 us against 52.8 / 158.6 / 531.9
    # per tier at batch 1 / 8 / 32; a single tier runs its own launch either way
    (128, 4): TieredDecodeConfig(dot_cvt=True, sub_cvt=True, min_steps=8, stages4=5, row_splits=False, warps16=4,
                                 one_launch=True),
}
# The int page (--kv-tier-page-size) each SERVED_CONFIGS entry was timed at. The H100 sweep at
# c7b4604 (benchmarks/results/attention_*.json, sweep.rows) timed its served Llama-3-8B config at
# the engine's default 64-token pages too: batch 8, 32k, b = 0.5 mix 239.6 us, against 211.1 us
# for the same knobs with row_splits off at page 256 (int8 223.6 / 195.7 us, int4 147.3 / 111.1
# us; row_splits only touches the fp16 tier, 366.6-368.7 us either way). The engine's page is an
# EngineConfig field (it sizes the pool), so the kernel cannot pick it: e2e_decode.py passes this
# page unless told another, and records what it served.
SERVED_INT_PAGE: dict[tuple[int, int], int] = {(64, 3): 256, (128, 4): 256}


def served_config(head_dim: int, kv_group: int, override: Optional[str] = None) -> TieredDecodeConfig:
    """The config the engine decodes with: INTERPRET_CONFIG under the interpreter, else
    `override` (a JSON object of fields, the backend passes SGL_KVXFER_TIERED_DECODE_CONFIG),
    else SERVED_CONFIGS for this shape, else DEFAULT_CONFIG."""
    if is_interpret():
        return INTERPRET_CONFIG
    if override:
        import json

        fields = json.loads(override)
        if not isinstance(fields, dict):
            raise ValueError(f"tiered decode config override must be a JSON object, got {override!r}")
        return TieredDecodeConfig(**fields)
    return SERVED_CONFIGS.get((head_dim, kv_group), DEFAULT_CONFIG)


def served_int_page(head_dim: int, kv_group: int) -> Optional[int]:
    """The int page the served config of this shape was timed at (None: no tuned entry)."""
    return SERVED_INT_PAGE.get((head_dim, kv_group))


def describe_served(head_dim: int, kv_group: int, override: Optional[str] = None) -> dict:
    """What served_config picks and why, for benchmark records: {"source": "interpreter" |
    "override" | "table" | "default", "config": its fields, "tuned_int_page": the page the
    table's entry was timed at (None off the table)}."""
    from dataclasses import asdict

    cfg = served_config(head_dim, kv_group, override)
    if is_interpret():
        source = "interpreter"
    elif override:
        source = "override"
    else:
        source = "table" if (head_dim, kv_group) in SERVED_CONFIGS else "default"
    page = served_int_page(head_dim, kv_group) if source == "table" else None
    return {"source": source, "config": asdict(cfg), "tuned_int_page": page}


@dataclass(frozen=True)
class TieredDecodePlan:
    """num_splits per tier launch; counters: int32 [B * Hkv] zeros for the fused merge (each
    merging program resets its entry), None without it."""
    num_splits: int
    counters: Optional[torch.Tensor] = None


def plan_tiered_pool_decode(batch_size: int, num_kv_heads: int, max_tokens: int, device,
                            config: Optional[TieredDecodeConfig] = None) -> TieredDecodePlan:
    """Splits per request from host numbers only (CUDA-graph safe): at most `split_waves` programs
    per SM (rounded down: a partial last wave would run alone), no split below `min_split_tokens`
    of a max_tokens-long request."""
    config = config or DEFAULT_CONFIG
    dev = torch.device(device)
    want = max(1, int(config.split_waves * num_sms(dev)) // max(1, batch_size * num_kv_heads))
    cap = max(1, int(max_tokens) // config.min_split_tokens)
    counters = (torch.zeros(max(1, batch_size * num_kv_heads), dtype=torch.int32, device=dev)
                if config.fused_merge else None)
    return TieredDecodePlan(int(min(want, cap)), counters)


# ---------------------------------------------------------------------------------------------
# launcher

MERGE_S = 16  # partials per merge step (one L2 round trip each; [KV_GROUP, 16, D] fp32 in registers)


def merge_step(warps: int) -> int:
    """Partials per merge step of a tier kernel launched with `warps`: MERGE_S up to 4 warps, half
    beyond (8 warps compile to 128 registers a thread, and 16 partials a step spill there)."""
    return MERGE_S if warps <= 4 else MERGE_S // 2


# (tier, constexprs, tile, warps, stages) asked for -> (tile, stages) that fit the GPU's shared memory
LAUNCHED: dict = {}


def _launch(kernel, grid, args, kw, tier, tile, warps, stages) -> None:
    """Launch with (tile, warps, stages); if that config does not fit the GPU (Triton raises
    OutOfResources at its first launch), fewer stages, then half the tile, and remember what ran
    (LAUNCHED: benchmarks report it next to the config they asked for)."""
    from triton.runtime.errors import OutOfResources

    key = (tier, tuple(sorted(kw.items())), tile, warps, stages)
    tile_now, stages_now = LAUNCHED.get(key, (tile, stages))
    while True:
        try:
            kernel[grid](*args, TILE=tile_now, num_warps=warps, num_stages=stages_now, **kw)
            LAUNCHED[key] = (tile_now, stages_now)
            return
        except OutOfResources:
            if stages_now > 1:
                stages_now -= 1
            elif tile_now > 16:
                tile_now, stages_now = tile_now // 2, stages
            else:
                raise


# (tiers, head_dim, kv_group, config) whose one_launch kernel did not fit the GPU: per-tier launches
ONE_LAUNCH_TOO_BIG: set = set()


def fallbacks() -> list[dict]:
    """The launches that ran another (tile, stages) than asked for, as LAUNCHED recorded them, and
    the one_launch configs that ran per tier (ONE_LAUNCH_TOO_BIG)."""
    return [{"tier": k[0], "asked": {"tile": k[2], "warps": k[3], "stages": k[4]},
             "ran": {"tile": v[0], "stages": v[1]}, "head_dim": dict(k[1]).get("HEAD_DIM")}
            for k, v in LAUNCHED.items() if v != (k[2], k[4])] + \
        [{"one_launch": "out of resources: per-tier launches", "tiers": list(k[0]), "head_dim": k[1]}
         for k in ONE_LAUNCH_TOO_BIG]


def _one_launch(q, layer: TieredKVLayer, tables: TieredBlockTables, out, plan: TieredDecodePlan,
                config: TieredDecodeConfig, tiers: tuple, sm_scale: float) -> bool:
    """config.one_launch: every tier of `tiers` in one grid (B * Hkv, S) (_tiered_one_launch.py).
    False (nothing launched) where that kernel does not fit the GPU: the caller launches per tier."""
    from triton.runtime.errors import OutOfResources

    from ._tiered_one_launch import _one_launch_kernel

    B, Hq, D = q.shape
    Hkv = layer.num_kv_heads
    kv_group = Hq // Hkv
    S = plan.num_splits
    key = (tuple(tiers), D, kv_group, config)
    if key in ONE_LAUNCH_TOO_BIG:
        return False
    direct = S == 1
    fused = plan.counters is not None and not direct
    if direct:
        o_part = lse_part = out  # unused
        so, sl = (0, 0, 0), (0, 0)
    else:
        o_part = torch.empty((B, Hq, S, D), dtype=torch.float32, device=q.device)
        lse_part = torch.empty((B, Hq, S), dtype=torch.float32, device=q.device)
        so, sl = (o_part.stride(0), o_part.stride(1), o_part.stride(2)), (lse_part.stride(0), lse_part.stride(1))
    interp = is_interpret()
    bt, ln = tables.tables, tables.lens
    fills = tables.fills if tables.filled else bt
    npg = tables.num_pages if tables.filled else ln
    per_tier, kw = [], {}
    for t, sfx, halves in ((TIER_FP16, "16", 0), (TIER_INT8, "8", 1), (TIER_INT4, "4", 2)):
        tile, _, stages = config.launch(t)
        kw.update({f"HAS{sfx}": t in tiers, f"TILE{sfx}": tile, f"STAGES{sfx}": stages})
        if t not in tiers:  # placeholders, never read (HAS = False)
            per_tier += [q] * (2 if t == TIER_FP16 else 4) + [ln[0]] * 4 + [0] * 4
            kw.update({f"PAGE{sfx}": 16, f"W{sfx}": 1})
            if halves:
                kw[f"FAST{sfx}"] = False
            continue
        tp, page = layer[t], layer.page_size_of(t)
        stores = [tp.k, tp.v] if t == TIER_FP16 else [tp.k, tp.v, tp.k.view(torch.float16), tp.v.view(torch.float16)]
        per_tier += stores + [bt[t], fills[t], ln[t], npg[t], bt[t].stride(0), fills[t].stride(0), tp.k.stride(0),
                              tp.k.stride(1)]
        # the weight of a step: the K + V bytes it reads per kv head (codes, scales and zeros)
        kw.update({f"PAGE{sfx}": page,
                   f"W{sfx}": tile * 2 * (2 * D if t == TIER_FP16 else D // halves + 4)})
        if halves:
            kw[f"FAST{sfx}"] = config.fast_cvt and not interp and tile * (D // halves) >= 8 * 32 * _one_launch_warps(
                config, tiers)
    warps = _one_launch_warps(config, tiers)
    try:
        _one_launch_kernel[(B * Hkv, S)](
            q, o_part, lse_part, out, plan.counters if fused else ln[0], *per_tier,
            q.stride(0), q.stride(1), *so, *sl, out.stride(0), out.stride(1), S, sm_scale * LOG2E,
            NUM_KV_HEADS=Hkv, KV_GROUP=kv_group, BLOCK_G=max(16, next_pow2(kv_group)), HEAD_DIM=D,
            FILLED=tables.filled, DOT_F32=interp and q.dtype == torch.bfloat16, DOT_CVT=config.dot_cvt,
            SUB_CVT=config.sub_cvt and config.dot_cvt, DIRECT=direct, FUSED_MERGE=fused, FENCE=not interp,
            MERGE_H=next_pow2(kv_group), MERGE_S=merge_step(warps), MERGE_PF=config.merge_prefetch,
            num_warps=warps, num_stages=max(kw[f"STAGES{x}"] for x in ("16", "8", "4")), **kw)
    except OutOfResources:
        ONE_LAUNCH_TOO_BIG.add(key)
        return False
    if not direct and not fused:
        _merge_kernel[(B * Hkv,)](
            o_part, lse_part, out, S, *so, *sl, out.stride(0), out.stride(1),
            NUM_KV_HEADS=Hkv, KV_GROUP=kv_group, MERGE_H=next_pow2(kv_group), HEAD_DIM=D, MERGE_S=MERGE_S,
            MERGE_PF=config.merge_prefetch, num_warps=4)
    return True


def _one_launch_warps(config: TieredDecodeConfig, tiers) -> int:
    return config.warps8 if TIER_INT8 in tiers else config.warps4 if TIER_INT4 in tiers else config.warps16


def _check(q, layer: TieredKVLayer, tables: TieredBlockTables, tiers) -> None:
    B, Hq, D = q.shape
    layer.check(uniform=False)
    assert q.dtype == layer.dtype and D == layer.head_dim, (q.dtype, layer.dtype, D, layer.head_dim)
    assert q.dtype in (torch.float16, torch.bfloat16), q.dtype
    assert q.stride(-1) == 1, "q: last dim must be contiguous"
    assert Hq % layer.num_kv_heads == 0, (Hq, layer.num_kv_heads)
    assert D >= 16 and D & (D - 1) == 0, "head_dim must be a power of two >= 16"
    assert all(t in TIERS for t in tiers) and len(set(tiers)) == len(tiers), tiers
    for t in tiers:
        p = layer.page_size_of(t)
        assert p >= 1 and p & (p - 1) == 0, f"tier {t}: page size {p} must be a power of two"
        # every tier's kernel reads K / V unmasked, page 0 for slots past a request's pages
        assert layer[t].k.shape[0] >= 1, f"tier {t}: a launched store needs >= 1 page"
        if t != TIER_FP16:
            assert p >= 16 and D >= 32, f"tier {t}: int pages need PAGE >= 16 and head_dim >= 32 ({p}, {D})"
    tables.check(layer.page_size)
    assert tables.batch_size == B, (tables.batch_size, B)


def tiered_pool_decode(
    q: torch.Tensor, layer: TieredKVLayer, tables: TieredBlockTables, sm_scale: Optional[float] = None,
    out: Optional[torch.Tensor] = None, plan: Optional[TieredDecodePlan] = None,
    config: Optional[TieredDecodeConfig] = None, tiers: tuple = TIERS, check: bool = True,
) -> torch.Tensor:
    """Decode attention of q [B, Hq, D] over each request's tiered cache -> [B, Hq, D] (module doc).

    tiers: the tiers to read (a tier left out must hold no token of the batch: the backend passes
    the stores that have pages). plan: plan_tiered_pool_decode (default: from the widest table,
    a host number); config: served_config(D, Hq / Hkv) by default; check=False skips the layout
    checks (callers that run many layers over one batch check once)."""
    B, Hq, D = q.shape
    Hkv = layer.num_kv_heads
    kv_group = Hq // Hkv
    config = config or served_config(D, kv_group)
    tiers = tuple(tiers)
    if check:
        _check(q, layer, tables, tiers)
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(-1) == 1
    if B == 0:
        return out
    if not tiers:
        return out.zero_()
    if plan is None:
        width = max(int(tables.tables[t].shape[1]) * layer.page_size_of(t) for t in tiers)
        plan = plan_tiered_pool_decode(B, Hkv, width, q.device, config)
    sm_scale = 1.0 / math.sqrt(D) if sm_scale is None else sm_scale
    if config.one_launch and len(tiers) > 1 and layer.group_size == D and not config.qk_int8:
        if _one_launch(q, layer, tables, out, plan, config, tiers, sm_scale):
            return out
    S = plan.num_splits
    n_total = S * len(tiers)
    direct = n_total == 1
    fused = plan.counters is not None and not direct
    if fused:
        assert plan.counters.numel() >= B * Hkv and plan.counters.dtype == torch.int32
    if direct:
        o_part = lse_part = out  # unused
        so = (0, 0, 0)
        sl = (0, 0)
    else:
        o_part = torch.empty((B, Hq, n_total, D), dtype=torch.float32, device=q.device)
        lse_part = torch.empty((B, Hq, n_total), dtype=torch.float32, device=q.device)
        so = (o_part.stride(0), o_part.stride(1), o_part.stride(2))
        sl = (lse_part.stride(0), lse_part.stride(1))
    cnt = plan.counters if fused else tables.lens[0]
    sm_scale = 1.0 / math.sqrt(D) if sm_scale is None else sm_scale
    interp = is_interpret()
    common = dict(NUM_KV_HEADS=Hkv, KV_GROUP=kv_group, BLOCK_G=max(16, next_pow2(kv_group)), HEAD_DIM=D,
                  FILLED=tables.filled, DIRECT=direct, FUSED_MERGE=fused, FENCE=not interp,
                  MERGE_H=next_pow2(kv_group), MERGE_PF=config.merge_prefetch)
    bt, ln = tables.tables, tables.lens
    fills = tables.fills if tables.filled else bt  # dense: unused (FILLED=False)
    npg = tables.num_pages if tables.filled else ln
    for i, t in enumerate(tiers):
        tp, PAGE = layer[t], layer.page_size_of(t)
        tile, warps, stages = config.launch(t, int(bt[t].shape[1]) * PAGE // S)
        args = (q, o_part, lse_part, out, cnt)
        tail = (bt[t], fills[t], ln[t], npg[t],
                q.stride(0), q.stride(1), bt[t].stride(0), fills[t].stride(0), tp.k.stride(0), tp.k.stride(1),
                *so, *sl, out.stride(0), out.stride(1), i * S, n_total, sm_scale * LOG2E)
        if t == TIER_FP16:
            kernel, args = _fp16_tier_kernel, (*args, tp.k, tp.v, *tail)
            kw = dict(PAGE=PAGE, DOT_F32=interp and q.dtype == torch.bfloat16, ROW_SPLITS=config.row_splits,
                      **common)
        else:
            halves = 1 if t == TIER_INT8 else 2
            kernel, args = _int_tier_kernel, (*args, tp.k, tp.v, tp.k.view(torch.float16), tp.v.view(torch.float16),
                                              *tail)
            # NOTE: the PRMT / LOP3 conversion packs 4 codes per register: tiles with fewer than 4
            # elements per thread (tiny test shapes) take the portable conversion
            packable = tile * (D // halves) >= 8 * 32 * warps
            kw = dict(TIER=t, GROUP_SIZE=layer.group_size, PAGE=PAGE,
                      QK_INT8=config.qk_int8 and layer.group_size == D and D // halves >= 32,
                      FAST_CVT=config.fast_cvt and not interp and packable, DOT_CVT=config.dot_cvt,
                      SUB_CVT=config.sub_cvt and config.dot_cvt, **common)
        kw["MERGE_S"] = merge_step(warps)
        _launch(kernel, (B * Hkv, S), args, kw, t, tile, warps, stages)
    if not direct and not fused:
        _merge_kernel[(B * Hkv,)](
            o_part, lse_part, out, n_total, *so, *sl, out.stride(0), out.stride(1),
            NUM_KV_HEADS=Hkv, KV_GROUP=kv_group, MERGE_H=next_pow2(kv_group), HEAD_DIM=D, MERGE_S=MERGE_S,
            MERGE_PF=config.merge_prefetch, num_warps=4)
    return out


def tiered_pool_decode_reference(q, layer: TieredKVLayer, tables: TieredBlockTables,
                                 sm_scale: Optional[float] = None,
                                 q_int: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Torch reference (any table form, any page sizes): each request's cache dequantized through
    tier_codec (gather_request_kv), fp32 attention; a request with no token gets 0. q_int: the q
    the int tiers' scores use (qk_int8: qk_int8_rounded_q(q)); q itself by default."""
    B, Hq, D = q.shape
    sm_scale = 1.0 / math.sqrt(D) if sm_scale is None else sm_scale
    group = Hq // layer.num_kv_heads
    out = torch.zeros_like(q, dtype=torch.float32)
    for b in range(B):
        k, v = gather_request_kv(layer, tables, b)  # [n, Hkv, D] fp32, the fp16 tier's rows first
        if k.shape[0] == 0:
            continue
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        s = torch.einsum("hd,nhd->hn", q[b].float(), k) * sm_scale
        if q_int is not None:
            n16 = int(tables.lens[TIER_FP16][b])
            s[:, n16:] = torch.einsum("hd,nhd->hn", q_int[b].float(), k[n16:]) * sm_scale
        out[b] = torch.einsum("hn,nhd->hd", s.softmax(-1), v)
    return out.to(q.dtype)


def qk_int8_rounded_q(q: torch.Tensor) -> torch.Tensor:
    """fp32 q~ = round(q / s) * s, s = max|q| / 127 per (request, head) (1 where q is 0), half
    away from zero: the q that qk_int8 attends with (int tiers with G = D; fp16 tier and G < D
    attend with q itself)."""
    qf = q.float()
    qmax = qf.abs().amax(-1, keepdim=True)
    sc = torch.where(qmax > 0, qmax / 127.0, torch.ones_like(qmax))
    y = qf / sc
    return torch.trunc(y + torch.where(y >= 0, 0.5, -0.5)) * sc


def with_config(config: Optional[TieredDecodeConfig] = None, **knobs) -> TieredDecodeConfig:
    """A copy of `config` (DEFAULT_CONFIG) with some knobs changed (benchmark sweeps)."""
    return replace(config or DEFAULT_CONFIG, **knobs)
