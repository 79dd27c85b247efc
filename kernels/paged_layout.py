"""Tensor bundles of the paged tiered KV layout (one layer), shared by every kernel here.

See kernels/README.md for the why. Per layer and per tier t in (fp16, int8, int4):

    data  k, v        [num_pages_t, Hkv, PAGE, W_t]      W: fp16 D (model dtype) | int8 D | int4 D//2 (uint8)
    scales k/v scale,  [num_pages_t, Hkv, PAGE, D // G]  float16 (int8 / int4 tiers only)
           k/v zero

    page p, kv-head h  ->  one contiguous block of PAGE * W_t elements (head-major inside a page)

Per request and tier: a block table row (page ids into that tier's pool, in fill order) and a
token count n_t. Two forms:
  dense  (fills None)  the tier's tokens occupy pages[0 .. cdiv(n_t, PAGE)) and inside them slots
                       0 .. n_t-1 in order; only the last page of a tier may be partial.
  filled (fills set)   num_pages[t][b] pages are listed; page j holds fills[t][b, j] tokens in its
                       slots 0 .. fill-1 (a prefix of the page); any listed page may be partial.
                       n_t == sum of the fills. This is what the engine's paged tiered pool gives:
                       each re-tiered run fills fresh pages in position order, so a request sees
                       a prefix of every page it shares (mem_cache/README.md section 8).
Tiers may have different page sizes (the engine's fp16 store is slot-granular: PAGE 1).
Because K is stored post-RoPE, attention is a set function of the cached (k, v) pairs: the
order of tokens inside and across tiers does not matter.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .tier_codec import DEFAULT_GROUP_SIZE, TIER_FP16, TIER_INT4, TIER_INT8, TIERS

DEFAULT_PAGE_SIZE = 64


@dataclass
class TierPages:
    """One layer's pool of one tier. Scale/zero tensors are None for the fp16 tier."""

    tier: int
    k: torch.Tensor
    v: torch.Tensor
    k_scale: Optional[torch.Tensor] = None
    k_zero: Optional[torch.Tensor] = None
    v_scale: Optional[torch.Tensor] = None
    v_zero: Optional[torch.Tensor] = None

    @property
    def num_pages(self) -> int:
        return self.k.shape[0]

    @property
    def page_size(self) -> int:
        return self.k.shape[2]

    @property
    def num_kv_heads(self) -> int:
        return self.k.shape[1]

    def scales(self):
        return (self.k_scale, self.k_zero, self.v_scale, self.v_zero)

    def tensors(self):
        return (self.k, self.v) + (() if self.tier == TIER_FP16 else self.scales())

    def check(self, head_dim: int, group_size: int) -> None:
        """Assert the layout every kernel relies on (dtype, shape, contiguity)."""
        P, H, PAGE, W = self.k.shape
        want_w = {TIER_FP16: head_dim, TIER_INT8: head_dim, TIER_INT4: head_dim // 2}[self.tier]
        assert W == want_w, f"tier {self.tier}: last dim {W} != {want_w}"
        assert self.v.shape == self.k.shape and self.v.dtype == self.k.dtype
        if self.tier == TIER_FP16:
            assert self.k.dtype in (torch.float16, torch.bfloat16), self.k.dtype
        else:
            assert self.k.dtype == torch.uint8, self.k.dtype
            for s in self.scales():
                assert s is not None and s.dtype == torch.float16
                assert s.shape == (P, H, PAGE, head_dim // group_size), s.shape
                assert s.is_contiguous()
        assert self.k.is_contiguous() and self.v.is_contiguous()


@dataclass
class TieredKVLayer:
    """The three tier pools of one layer. `group_size` is the quantization group (channels)."""

    pages: tuple  # (fp16 TierPages, int8 TierPages, int4 TierPages)
    head_dim: int
    group_size: int = DEFAULT_GROUP_SIZE

    def __getitem__(self, tier: int) -> TierPages:
        return self.pages[tier]

    @property
    def page_size(self) -> int:
        """The fp16 tier's page size (== every tier's when `uniform_pages`)."""
        return self.pages[0].page_size

    def page_size_of(self, tier: int) -> int:
        return self.pages[tier].page_size

    @property
    def uniform_pages(self) -> bool:
        return len({p.page_size for p in self.pages}) == 1

    @property
    def num_kv_heads(self) -> int:
        return self.pages[0].num_kv_heads

    @property
    def dtype(self) -> torch.dtype:
        return self.pages[0].k.dtype

    def check(self, uniform: bool = True) -> None:
        """uniform: every tier has the same page size (the kernels that take one PAGE)."""
        assert self.head_dim % self.group_size == 0 and self.group_size % 2 == 0
        for t in TIERS:
            assert self.pages[t].tier == t
            self.pages[t].check(self.head_dim, self.group_size)
            assert not uniform or self.pages[t].page_size == self.page_size
            assert self.pages[t].num_kv_heads == self.num_kv_heads


def allocate_tiered_layer(
    num_pages: tuple,
    page_size: int,
    num_kv_heads: int,
    head_dim: int,
    group_size: int = DEFAULT_GROUP_SIZE,
    dtype: torch.dtype = torch.float16,
    device="cpu",
    fill: Optional[float] = None,
) -> TieredKVLayer:
    """Allocate one layer's pools; num_pages = (n_fp16, n_int8, n_int4) pages.
    `fill=None` leaves memory uninitialised (torch.empty)."""
    n16, n8, n4 = num_pages
    ng = head_dim // group_size

    def new(shape, dt):
        t = torch.empty(shape, dtype=dt, device=device)
        if fill is not None:
            t.fill_(fill if dt.is_floating_point else 0)
        return t

    def quant_tier(tier, n, w):
        shape, sshape = (n, num_kv_heads, page_size, w), (n, num_kv_heads, page_size, ng)
        return TierPages(
            tier, new(shape, torch.uint8), new(shape, torch.uint8),
            new(sshape, torch.float16), new(sshape, torch.float16),
            new(sshape, torch.float16), new(sshape, torch.float16),
        )

    fp = TierPages(TIER_FP16, new((n16, num_kv_heads, page_size, head_dim), dtype),
                   new((n16, num_kv_heads, page_size, head_dim), dtype))
    layer = TieredKVLayer(
        (fp, quant_tier(TIER_INT8, n8, head_dim), quant_tier(TIER_INT4, n4, head_dim // 2)),
        head_dim, group_size,
    )
    layer.check()
    return layer


@dataclass
class TieredBlockTables:
    """Per-batch paging metadata. tables[t]: int32 [B, max_pages_t] (unused entries: any
    valid page id, e.g. 0); lens[t]: int32 [B] tokens of request b held in tier t.
    The width max_pages_t bounds the kernels' grids, so no host sync is needed.

    Filled form (module docstring): fills[t] int32 [B, max_pages_t], tokens held in each listed
    page (a prefix of it; entries past num_pages are ignored), num_pages[t] int32 [B]."""

    tables: tuple
    lens: tuple
    fills: Optional[tuple] = None
    num_pages: Optional[tuple] = None

    @property
    def filled(self) -> bool:
        return self.fills is not None

    @property
    def batch_size(self) -> int:
        return self.lens[0].shape[0]

    def check(self, page_size: int) -> None:
        for t in TIERS:
            bt, ln = self.tables[t], self.lens[t]
            assert bt.dtype == torch.int32 and ln.dtype == torch.int32, (bt.dtype, ln.dtype)
            assert bt.dim() == 2 and bt.shape[0] == self.batch_size and bt.shape[1] >= 1
            assert bt.stride(1) == 1 and ln.is_contiguous()
            if self.filled:
                f, n = self.fills[t], self.num_pages[t]
                assert f.dtype == torch.int32 and f.shape == bt.shape and f.stride(1) == 1, (f.dtype, f.shape)
                assert n.dtype == torch.int32 and n.shape == ln.shape and n.is_contiguous()

    def total_lens(self) -> torch.Tensor:
        return self.lens[0] + self.lens[1] + self.lens[2]


def gather_request_kv(layer: TieredKVLayer, tables: TieredBlockTables, b: int,
                      out_dtype: torch.dtype = torch.float32):
    """Torch reference: request b's cached (k, v) as dense [n, Hkv, D] tensors, tiers
    concatenated fp16 -> int8 -> int4 and dequantized through tier_codec (fp16 rounding
    of dequantized values included, then cast to out_dtype)."""
    from .tier_codec import TIER_BITS, dequantize

    ks, vs = [], []
    for t in TIERS:
        PAGE = layer.page_size_of(t)
        n = int(tables.lens[t][b])
        if n == 0:
            continue
        if tables.filled:
            npg = int(tables.num_pages[t][b])
            fill = tables.fills[t][b, :npg].long()
        else:
            npg = -(-n // PAGE)
            fill = torch.full((npg,), PAGE, dtype=torch.long)
            fill[-1] = n - (npg - 1) * PAGE
        ids = tables.tables[t][b, :npg].long()
        keep = (torch.arange(PAGE)[None, :] < fill.cpu()[:, None]).reshape(-1).to(ids.device)
        tp = layer[t]

        def rows(x):  # [npg, H, PAGE, W] -> [n, H, W]: each page's first `fill` slots, in order
            return x[ids].permute(0, 2, 1, 3).reshape(npg * PAGE, x.shape[1], x.shape[3])[keep]

        if t == TIER_FP16:
            k, v = rows(tp.k), rows(tp.v)
        else:
            bits = TIER_BITS[t]
            k = dequantize(rows(tp.k), rows(tp.k_scale), rows(tp.k_zero), bits,
                           layer.group_size, layer.dtype)
            v = dequantize(rows(tp.v), rows(tp.v_scale), rows(tp.v_zero), bits,
                           layer.group_size, layer.dtype)
        ks.append(k.to(out_dtype))
        vs.append(v.to(out_dtype))
    if not ks:
        H, D = layer.num_kv_heads, layer.head_dim
        z = torch.zeros(0, H, D, dtype=out_dtype, device=layer[0].k.device)
        return z, z
    return torch.cat(ks), torch.cat(vs)
