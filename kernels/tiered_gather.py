"""Gather one layer's K and V at global tier ids, dequantized, in one launch (no host sync).

    gather_tiered_kv(rows_k, rows_v, int8, int4, ids, base8, base4, out_dtype) -> (k, v) [n, Hkv, D]
    gather_tiered_kv_reference(...)                                           (torch, same contract)

The id space of mem_cache/tiered_pool.py: ids < base8 are rows of the fp16 store (rows_k / rows_v
[rows, Hkv, D], slot-granular, row 0 the zero padding row), ids in [base8, base4) tokens of the
int8 store at (page, offset) = divmod(id - base8, PAGE), ids >= base4 of the int4 store likewise.
`int8` / `int4` are TierPages of page-head blocks (paged_layout.py), None where the store is
empty. Values are code * scale + zero in fp32, cast once to out_dtype (tier_codec.dequantize).

FusedKV's reconstruction layers read their source layers this way during decode (TieredKVPool
.get_kv_no_sync on CUDA): a captured step cannot split ids by store on the host, and the torch
form of the same read is tens of kernels over every id per layer. grid (cdiv(n, BLOCK_N), Hkv);
each lane loads only from the store its id is in (masked loads).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .paged_layout import TierPages
from .tier_codec import TIER_INT4, TIER_INT8


@triton.jit
def _int_values(c_ptr, h_ptr, ids, inside, base, page0, h, d, stride_p, stride_h,
                PAGE: tl.constexpr, D: tl.constexpr, G: tl.constexpr, BITS: tl.constexpr, IS_V: tl.constexpr):
    """K (IS_V False: token-major codes) or V (dim-major codes) [BLOCK_N, D] fp32 of the lanes
    `inside` one int store, 0 elsewhere. page0: the layer's first page in a stacked store."""
    W: tl.constexpr = D if BITS == 8 else D // 2
    NG: tl.constexpr = D // G
    # no tl.where on the ids: Triton 3.6's TritonGPURemoveLayoutConversions rejects that select
    # (kernels/compile_only.py reproduces it); lanes outside the store compute an address that
    # their masked loads never read
    r = (ids - base).to(tl.int64)
    page, off = page0 + r // PAGE, r % PAGE
    blk = page * stride_p + h * stride_h  # bytes: the page-head block
    col = d % W  # int4: byte j holds channel j (low nibble) and j + D/2 (high nibble)
    m = inside[:, None]
    if IS_V:
        c = tl.load(c_ptr + blk[:, None] + col[None, :] * PAGE + off[:, None], mask=m, other=0)
    else:
        c = tl.load(c_ptr + blk[:, None] + off[:, None] * W + col[None, :], mask=m, other=0)
    if BITS == 4:
        c = (c >> ((d >= W).to(tl.uint8) * 4)[None, :]) & 15
    # scale [PAGE, NG] then zero [PAGE, NG], fp16, behind the codes (element offsets of the fp16 view)
    row = blk // 2 + PAGE * W // 2 + off * NG
    if NG == 1:  # one pair per token-head (the engine's default group): one load a token, broadcast
        scale = tl.load(h_ptr + row, mask=inside, other=0.0).to(tl.float32)[:, None]
        zero = tl.load(h_ptr + row + PAGE, mask=inside, other=0.0).to(tl.float32)[:, None]
    else:
        at = row[:, None] + (d // G)[None, :]
        scale = tl.load(h_ptr + at, mask=m, other=0.0).to(tl.float32)
        zero = tl.load(h_ptr + at + PAGE * NG, mask=m, other=0.0).to(tl.float32)
    return c.to(tl.float32) * scale + zero


@triton.jit
def _tier_values(rows_ptr, c8_ptr, h8_ptr, c4_ptr, h4_ptr, layer, ids, live, base8, base4, h, d,
                 stride_rl, stride_row, stride_rh, pages8, pages4, stride_p8, stride_h8, stride_p4, stride_h4,
                 D: tl.constexpr, G: tl.constexpr, PAGE8: tl.constexpr, PAGE4: tl.constexpr,
                 HAS8: tl.constexpr, HAS4: tl.constexpr, IS_V: tl.constexpr):
    """K or V [BLOCK_N, D] fp32 of layer `layer` at tier ids (lanes not `live`: 0). Each lane
    loads only from the store its id is in. Strides are elements of the stacked stores: fp16
    rows [L, rows, Hkv, D]; int blocks [L * pages, Hkv, BLOCK] (layer l's page p at l * pages + p)."""
    in16 = live & (ids < base8)
    at = layer * stride_rl + ids[:, None] * stride_row + h * stride_rh + d[None, :]  # masked: only in16 lanes read
    x = tl.load(rows_ptr + at, mask=in16[:, None], other=0.0).to(tl.float32)
    if HAS8:
        in8 = live & (ids >= base8) & (ids < base4)
        x8 = _int_values(c8_ptr, h8_ptr, ids, in8, base8, layer * pages8, h, d, stride_p8, stride_h8, PAGE8, D, G, 8, IS_V)
        x = tl.where(in8[:, None], x8, x)
    if HAS4:
        in4 = live & (ids >= base4)
        x4 = _int_values(c4_ptr, h4_ptr, ids, in4, base4, layer * pages4, h, d, stride_p4, stride_h4, PAGE4, D, G, 4, IS_V)
        x = tl.where(in4[:, None], x4, x)
    return x


@triton.jit
def _gather_kernel(ids_ptr, n, rk_ptr, rv_ptr, k8_ptr, v8_ptr, hk8_ptr, hv8_ptr, k4_ptr, v4_ptr, hk4_ptr, hv4_ptr,
                   ko_ptr, vo_ptr, base8, base4, stride_row, stride_rh, stride_p8, stride_h8, stride_p4, stride_h4,
                   stride_on, stride_oh,
                   D: tl.constexpr, G: tl.constexpr, PAGE8: tl.constexpr, PAGE4: tl.constexpr,
                   HAS8: tl.constexpr, HAS4: tl.constexpr, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    h = tl.program_id(1)
    offs = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    live = offs < n
    ids = tl.load(ids_ptr + offs, mask=live, other=0).to(tl.int64)
    d = tl.arange(0, D)
    k = _tier_values(rk_ptr, k8_ptr, hk8_ptr, k4_ptr, hk4_ptr, 0, ids, live, base8, base4, h, d,
                     0, stride_row, stride_rh, 0, 0, stride_p8, stride_h8, stride_p4, stride_h4,
                     D, G, PAGE8, PAGE4, HAS8, HAS4, False)
    v = _tier_values(rv_ptr, v8_ptr, hv8_ptr, v4_ptr, hv4_ptr, 0, ids, live, base8, base4, h, d,
                     0, stride_row, stride_rh, 0, 0, stride_p8, stride_h8, stride_p4, stride_h4,
                     D, G, PAGE8, PAGE4, HAS8, HAS4, True)
    out = offs[:, None].to(tl.int64) * stride_on + h * stride_oh + d[None, :]
    tl.store(ko_ptr + out, k.to(ko_ptr.dtype.element_ty), mask=live[:, None])
    tl.store(vo_ptr + out, v.to(vo_ptr.dtype.element_ty), mask=live[:, None])


def _check_int(store: TierPages | None, tier: int, head_dim: int, group_size: int) -> None:
    if store is None:
        return
    assert isinstance(store, TierPages) and store.tier == tier, "a TierPages of page-head blocks of that tier"
    assert store.head_dim == head_dim and store.group_size == group_size, (store.head_dim, store.group_size)
    assert store.k.is_contiguous() and store.v.is_contiguous() and store.k.stride() == store.v.stride()
    assert (store.page * store.width) % 2 == 0, "the fp16 scales must start on a 2-byte boundary"


def gather_tiered_kv(rows_k: torch.Tensor, rows_v: torch.Tensor, int8: TierPages | None, int4: TierPages | None,
                     ids: torch.Tensor, base8: int, base4: int, out_dtype: torch.dtype,
                     block_n: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """(k, v) [n, Hkv, D] in out_dtype of the tokens at global ids `ids` [n] (module docstring)."""
    n_rows, num_heads, head_dim = rows_k.shape
    assert rows_v.shape == rows_k.shape and rows_k.stride() == rows_v.stride() and rows_k.stride(2) == 1
    assert head_dim & (head_dim - 1) == 0 and head_dim >= 16, f"head_dim {head_dim}: a power of two >= 16"
    group = (int8 or int4).group_size if (int8 or int4) is not None else head_dim
    _check_int(int8, TIER_INT8, head_dim, group)
    _check_int(int4, TIER_INT4, head_dim, group)
    assert 0 < base8 <= base4 and n_rows <= base8, (n_rows, base8, base4)
    ids = ids.reshape(-1).contiguous()
    n = ids.numel()
    k = torch.empty((n, num_heads, head_dim), dtype=out_dtype, device=rows_k.device)
    v = torch.empty_like(k)
    if n == 0:
        return k, v
    dummy = rows_k.new_empty(0, dtype=torch.uint8)
    k8, v8 = (int8.k, int8.v) if int8 is not None else (dummy, dummy)
    k4, v4 = (int4.k, int4.v) if int4 is not None else (dummy, dummy)
    half = lambda x: x.view(torch.float16) if x.numel() else x.new_empty(0, dtype=torch.float16)  # noqa: E731
    _gather_kernel[(triton.cdiv(n, block_n), num_heads)](
        ids, n, rows_k, rows_v, k8, v8, half(k8), half(v8), k4, v4, half(k4), half(v4), k, v, base8, base4,
        rows_k.stride(0), rows_k.stride(1),
        k8.stride(0) if int8 is not None else 0, k8.stride(1) if int8 is not None else 0,
        k4.stride(0) if int4 is not None else 0, k4.stride(1) if int4 is not None else 0,
        k.stride(0), k.stride(1),
        D=head_dim, G=group, PAGE8=int8.page if int8 is not None else 1, PAGE4=int4.page if int4 is not None else 1,
        HAS8=int8 is not None, HAS4=int4 is not None, BLOCK_N=block_n, num_warps=4)
    return k, v


def gather_tiered_kv_reference(rows_k, rows_v, int8, int4, ids, base8, base4, out_dtype):
    """Torch: each store's tokens gathered and dequantized through TierPages.read."""
    ids = ids.reshape(-1)
    k = torch.empty((ids.numel(), *rows_k.shape[1:]), dtype=out_dtype, device=rows_k.device)
    v = torch.empty_like(k)
    in16 = ids < base8
    k[in16], v[in16] = rows_k[ids[in16]].to(out_dtype), rows_v[ids[in16]].to(out_dtype)
    for store, lo, hi in ((int8, base8, base4), (int4, base4, None)):
        inside = (ids >= lo) if hi is None else (ids >= lo) & (ids < hi)
        if store is None or not bool(inside.any()):
            continue
        r = ids[inside] - lo
        kk, vv = store.read(r // store.page, r % store.page, out_dtype)
        k[inside], v[inside] = kk, vv
    return k, v
