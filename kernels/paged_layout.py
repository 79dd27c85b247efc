"""Tensor bundles of the paged tiered KV layout (one layer), shared by every kernel here.

See kernels/README.md for the why. Per layer and per tier t in (fp16, int8, int4):

    fp16   k, v  [num_pages, Hkv, PAGE, D]   model dtype, head-major pages (PAGE 1: slot rows)
    int8 / int4  k, v  uint8 [num_pages, Hkv, BLOCK]: one page-head block per (page, kv head)

        K block   codes [PAGE, W] token-major | scale [PAGE, NG] fp16 | zero [PAGE, NG] fp16
        V block   codes [W, PAGE] dim-major   | scale [PAGE, NG] fp16 | zero [PAGE, NG] fp16
                  0                           PAGE*W                   PAGE*W + 2*PAGE*NG    BLOCK
        W = D (int8) | D/2 (int4: byte j = channel j low nibble, channel j + D/2 high nibble, the
        tier codec's split halves); NG = D / G groups (1 at G = D: one scale and one zero per
        token-head); BLOCK = PAGE*W + 4*PAGE*NG bytes

A decode step over (page, kv head) reads each block as one contiguous run, its scales right
behind its codes. V is stored dim-major so that the P @ V operand arrives K-major, as tl.dot
takes it, with no transpose through shared memory; K token-major serves q @ K^T the same way.
`TierPages.streams()` gives token-major views [P, Hkv, PAGE, X] of the six streams of an int
tier (k codes, v codes, k scale, k zero, v scale, v zero), which is what torch code indexes.

Per request and tier: a block table row (page ids into that tier's pool, in fill order) and a
token count n_t. Two forms:
  dense  (fills None)  the tier's tokens occupy pages[0 .. cdiv(n_t, PAGE)) and inside them slots
                       0 .. n_t-1 in order; only the last page of a tier may be partial.
  filled (fills set)   num_pages[t][b] pages are listed; page j holds fills[t][b, j] tokens in its
                       slots 0 .. fill-1 (a prefix of the page); any listed page may be partial.
                       n_t == sum of the fills. This is what the engine's paged tiered pool gives:
                       each re-tiered run fills fresh pages in position order, so a request sees
                       a prefix of every page it shares (mem_cache/README.md section 7).
Tiers may have different page sizes (the engine's fp16 store is slot-granular: PAGE 1).
Because K is stored post-RoPE, attention is a set function of the cached (k, v) pairs: the
order of tokens inside and across tiers does not matter.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .tier_codec import DEFAULT_GROUP_SIZE, TIER_BITS, TIER_FP16, TIER_INT4, TIER_INT8, TIERS, dequantize, quantize

DEFAULT_PAGE_SIZE = 64


def code_width(tier: int, head_dim: int) -> int:
    """Code bytes per token-head of an int tier (its row of K codes / column of V codes)."""
    return head_dim if tier == TIER_INT8 else head_dim // 2


def block_bytes(tier: int, page_size: int, head_dim: int, group_size: int) -> int:
    """Bytes of one page-head block of an int tier (module docstring)."""
    return page_size * code_width(tier, head_dim) + 4 * page_size * (head_dim // group_size)


@dataclass
class TierPages:
    """One layer's pool of one tier. fp16: k, v [P, Hkv, PAGE, D]. int8 / int4: k, v uint8
    [P, Hkv, BLOCK] page-head blocks (module docstring); `page`, `head_dim` and `group_size`
    describe them (the fp16 tier's page is k.shape[2])."""

    tier: int
    k: torch.Tensor
    v: torch.Tensor
    page: int = 0
    head_dim: int = 0
    group_size: int = 0

    @property
    def num_pages(self) -> int:
        return self.k.shape[0]

    @property
    def page_size(self) -> int:
        return self.k.shape[2] if self.tier == TIER_FP16 else self.page

    @property
    def num_kv_heads(self) -> int:
        return self.k.shape[1]

    @property
    def width(self) -> int:
        return code_width(self.tier, self.head_dim)

    @property
    def num_groups(self) -> int:
        return self.head_dim // self.group_size

    # ---- views of an int tier's blocks (they write through to k / v)
    def _scales(self, x: torch.Tensor) -> torch.Tensor:
        P, H, _ = x.shape
        return x[..., self.page * self.width:].view(torch.float16).view(P, H, 2, self.page, self.num_groups)

    @property
    def k_codes(self) -> torch.Tensor:
        """[P, Hkv, PAGE, W] uint8 (token-major)."""
        P, H, _ = self.k.shape
        return self.k[..., :self.page * self.width].view(P, H, self.page, self.width)

    @property
    def v_codes(self) -> torch.Tensor:
        """[P, Hkv, W, PAGE] uint8 (dim-major, as stored)."""
        P, H, _ = self.v.shape
        return self.v[..., :self.page * self.width].view(P, H, self.width, self.page)

    @property
    def k_scale(self) -> torch.Tensor:
        return self._scales(self.k)[:, :, 0]

    @property
    def k_zero(self) -> torch.Tensor:
        return self._scales(self.k)[:, :, 1]

    @property
    def v_scale(self) -> torch.Tensor:
        return self._scales(self.v)[:, :, 0]

    @property
    def v_zero(self) -> torch.Tensor:
        return self._scales(self.v)[:, :, 1]

    def streams(self) -> tuple:
        """Token-major views [P, Hkv, PAGE, X]: (k, v) for fp16; (k codes, v codes, k scale,
        k zero, v scale, v zero) for an int tier (the pack / wire order)."""
        if self.tier == TIER_FP16:
            return self.k, self.v
        return (self.k_codes, self.v_codes.transpose(2, 3), self.k_scale, self.k_zero, self.v_scale, self.v_zero)

    def tensors(self) -> tuple:
        """The storage tensors (k, v): what a kernel receives."""
        return self.k, self.v

    # ---- token access: tokens at (page[i], offset[i]), index tensors of one shape [n]
    def codes(self, page: torch.Tensor, off: torch.Tensor) -> tuple:
        """The streams of tokens (page, off) as stored, each [n, Hkv, X] (streams() order)."""
        return tuple(x[page, :, off] for x in self.streams())

    def put_codes(self, page: torch.Tensor, off: torch.Tensor, parts) -> None:
        """Write streams (as `codes` returns them) at tokens (page, off), as they are."""
        for x, src in zip(self.streams(), parts):
            x[page, :, off] = src

    def write(self, page: torch.Tensor, off: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [n, Hkv, D] at tokens (page, off): fp16 as the pool dtype, int tiers through
        tier_codec.quantize."""
        if self.tier == TIER_FP16:
            self.put_codes(page, off, (k.to(self.k.dtype), v.to(self.v.dtype)))
            return
        bits = TIER_BITS[self.tier]
        kq, ks, kz = quantize(k, bits, self.group_size)
        vq, vs, vz = quantize(v, bits, self.group_size)
        self.put_codes(page, off, (kq, vq, ks, kz, vs, vz))

    def read(self, page: torch.Tensor, off: torch.Tensor, dtype: torch.dtype) -> tuple:
        """(k, v) [n, Hkv, D] of tokens (page, off), dequantized through tier_codec, in dtype."""
        if self.tier == TIER_FP16:
            k, v = self.codes(page, off)
            return k.to(dtype), v.to(dtype)
        kq, vq, ks, kz, vs, vz = self.codes(page, off)
        bits = TIER_BITS[self.tier]
        return (dequantize(kq, ks, kz, bits, self.group_size, dtype),
                dequantize(vq, vs, vz, bits, self.group_size, dtype))

    def check(self, head_dim: int, group_size: int) -> None:
        """Assert the layout every kernel relies on (dtype, shape, contiguity)."""
        assert self.v.shape == self.k.shape and self.v.dtype == self.k.dtype
        if self.tier == TIER_FP16:
            assert self.k.dim() == 4 and self.k.shape[3] == head_dim, self.k.shape
            assert self.k.dtype in (torch.float16, torch.bfloat16), self.k.dtype
            # rows (PAGE 1) may be a strided view of a slot store; pages must be contiguous
            assert self.k.stride(-1) == 1 and self.v.stride() == self.k.stride()
            assert self.page_size == 1 or self.k.is_contiguous()
            return
        assert self.k.dtype == torch.uint8, self.k.dtype
        assert self.head_dim == head_dim and self.group_size == group_size, (self.head_dim, self.group_size)
        assert self.page >= 1 and head_dim % group_size == 0
        assert self.k.dim() == 3 and self.k.shape[2] == block_bytes(self.tier, self.page, head_dim, group_size), \
            (self.k.shape, block_bytes(self.tier, self.page, head_dim, group_size))
        assert self.k.is_contiguous() and self.v.is_contiguous()


def int_tier_pages(tier: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                   group_size: int, device="cpu", fill: Optional[float] = 0.0) -> TierPages:
    """An int tier's pool of `num_pages` page-head blocks (zeros; fill=None: uninitialised)."""
    shape = (num_pages, num_kv_heads, block_bytes(tier, page_size, head_dim, group_size))
    new = torch.zeros if fill is not None else torch.empty
    return TierPages(tier, new(shape, dtype=torch.uint8, device=device), new(shape, dtype=torch.uint8, device=device),
                     page_size, head_dim, group_size)


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
        D, G = self.head_dim, self.group_size
        # int4 split halves: a scale group never straddles the two halves
        assert D % G == 0 and G % 2 == 0 and (G == D or (D // 2) % G == 0), (D, G)
        for t in TIERS:
            assert self.pages[t].tier == t
            self.pages[t].check(self.head_dim, self.group_size)
            assert not uniform or self.pages[t].page_size == self.page_size
            assert self.pages[t].num_kv_heads == self.num_kv_heads


def allocate_tiered_layer(
    num_pages: tuple,
    page_size,
    num_kv_heads: int,
    head_dim: int,
    group_size: int = DEFAULT_GROUP_SIZE,
    dtype: torch.dtype = torch.float16,
    device="cpu",
    fill: Optional[float] = None,
) -> TieredKVLayer:
    """Allocate one layer's pools; num_pages = (n_fp16, n_int8, n_int4) pages; page_size one int
    for every tier or (PAGE16, PAGE8, PAGE4). `fill=None` leaves memory uninitialised
    (torch.empty); a number fills the fp16 tier with it and the int blocks with zeros."""
    pages = (page_size,) * 3 if isinstance(page_size, int) else tuple(page_size)
    n16, n8, n4 = num_pages
    shape16 = (n16, num_kv_heads, pages[0], head_dim)
    k16 = torch.empty(shape16, dtype=dtype, device=device)
    v16 = torch.empty(shape16, dtype=dtype, device=device)
    if fill is not None:
        k16.fill_(fill)
        v16.fill_(fill)
    quant = [int_tier_pages(t, n, pages[t], num_kv_heads, head_dim, group_size, device, fill)
             for t, n in ((TIER_INT8, n8), (TIER_INT4, n4))]
    layer = TieredKVLayer((TierPages(TIER_FP16, k16, v16), *quant), head_dim, group_size)
    layer.check(uniform=False)
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
        keep = (torch.arange(PAGE)[None, :] < fill.cpu()[:, None]).reshape(-1)
        page = ids.cpu()[:, None].expand(npg, PAGE).reshape(-1)[keep].to(ids.device)
        off = torch.arange(PAGE)[None, :].expand(npg, PAGE).reshape(-1)[keep].to(ids.device)
        k, v = layer[t].read(page, off, layer.dtype)  # each page's first `fill` slots, in order
        ks.append(k.to(out_dtype))
        vs.append(v.to(out_dtype))
    if not ks:
        H, D = layer.num_kv_heads, layer.head_dim
        z = torch.zeros(0, H, D, dtype=out_dtype, device=layer[0].k.device)
        return z, z
    return torch.cat(ks), torch.cat(vs)
