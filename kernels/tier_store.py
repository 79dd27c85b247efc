"""Quantize fp16 slot rows into an int tier's page-head blocks: one launch per tier for every layer of
the stacked stores (rows and pages of all layers as one [L * R] / [L * pages] store), else per (layer, tier).

    store_rows_quantized(k_rows, v_rows, src, dst, page, off) -> None
    store_rows_quantized_reference(...)                      (torch: tier_codec + TierPages.write)

k_rows, v_rows  [R, Hkv, D] model dtype: the tiered pool's fp16 store of one layer
src             int64 [n]: the rows to move
dst             TierPages of an int tier (paged_layout.py); page, off int64 [n]: where token i goes
grid (n, Hkv): program (i, h) reads row src[i], kv head h, of K and of V, quantizes each exactly as
tier_codec.quantize does (fp32 math, IEEE division, zero rounded down and scale up to fp16,
half-up rounding; _tiles' helpers), and writes the codes (K token-major, V dim-major), scales and
zeros into block (page[i], h). This is what the engine's re-tiering moves (TieredKVPool.move):
a prefill's prompt and every decode demotion run, all layers.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._tiles import _quant_params, _quantize_values
from .paged_layout import TierPages, code_width
from .tier_codec import TIER_BITS, TIER_FP16


@triton.jit
def _quantize_row(x_ptr, NG: tl.constexpr, G: tl.constexpr, QMAX: tl.constexpr):
    """One token-head row [D] -> (codes int32 [NG, G], scale fp16 [NG], zero fp16 [NG])."""
    offs = tl.arange(0, NG)[:, None] * G + tl.arange(0, G)[None, :]
    x = tl.load(x_ptr + offs).to(tl.float32)
    scale, zero, scale32, zero32, safe = _quant_params(tl.min(x, 1), tl.max(x, 1), QMAX)
    q = _quantize_values(x, zero32[:, None], safe[:, None], scale32[:, None], QMAX)
    return q, scale, zero


@triton.jit
def _store_block(blk_ptr, half_ptr, q, scale, zero, off, V_MAJOR: tl.constexpr, TIER: tl.constexpr,
                 PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, NG: tl.constexpr, G: tl.constexpr):
    """Codes [NG, G] (channel order) into a page-head block at slot `off`; scales behind the codes."""
    W: tl.constexpr = HEAD_DIM if TIER == 1 else HEAD_DIM // 2
    if TIER == 1:
        codes = tl.reshape(q, (W,))
    else:  # split halves: byte j = channel j | channel j + D/2 << 4
        lo, hi = tl.split(tl.permute(tl.reshape(q, (2, W)), (1, 0)))
        codes = lo | (hi << 4)
    c = tl.arange(0, W)
    if V_MAJOR:
        tl.store(blk_ptr + c * PAGE + off, codes.to(tl.uint8))
    else:
        tl.store(blk_ptr + off * W + c, codes.to(tl.uint8))
    g = tl.arange(0, NG)
    srow = PAGE * W // 2 + off * NG
    tl.store(half_ptr + srow + g, scale)
    tl.store(half_ptr + srow + PAGE * NG + g, zero)


@triton.jit
def _store_rows_kernel(k_ptr, v_ptr, src_ptr, page_ptr, off_ptr, dk_ptr, dv_ptr, hk_ptr, hv_ptr,
                       stride_r, stride_rh, stride_p, stride_h,
                       TIER: tl.constexpr, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, G: tl.constexpr):
    i = tl.program_id(0)
    h = tl.program_id(1)
    NG: tl.constexpr = HEAD_DIM // G
    QMAX: tl.constexpr = 255.0 if TIER == 1 else 15.0
    row = tl.load(src_ptr + i).to(tl.int64) * stride_r + h * stride_rh
    page = tl.load(page_ptr + i).to(tl.int64)
    off = tl.load(off_ptr + i).to(tl.int64)
    blk = page * stride_p + h * stride_h  # bytes
    q, scale, zero = _quantize_row(k_ptr + row, NG, G, QMAX)
    _store_block(dk_ptr + blk, hk_ptr + blk // 2, q, scale, zero, off, False, TIER, PAGE, HEAD_DIM, NG, G)
    q, scale, zero = _quantize_row(v_ptr + row, NG, G, QMAX)
    _store_block(dv_ptr + blk, hv_ptr + blk // 2, q, scale, zero, off, True, TIER, PAGE, HEAD_DIM, NG, G)


def store_rows_quantized(k_rows: torch.Tensor, v_rows: torch.Tensor, src: torch.Tensor, dst: TierPages,
                         page: torch.Tensor, off: torch.Tensor) -> None:
    """Quantize rows `src` of k_rows / v_rows [R, Hkv, D] into int tier `dst` at (page, off)
    (module docstring). No host sync."""
    assert dst.tier != TIER_FP16, "the fp16 tier stores rows as they are"
    R, H, D = k_rows.shape
    assert v_rows.shape == k_rows.shape and k_rows.stride() == v_rows.stride() and k_rows.stride(-1) == 1
    assert k_rows.dtype in (torch.float16, torch.bfloat16, torch.float32)
    assert dst.num_kv_heads == H and dst.head_dim == D and dst.k.is_contiguous() and dst.v.is_contiguous()
    G = dst.group_size
    assert G & (G - 1) == 0 and D & (D - 1) == 0 and code_width(dst.tier, D) >= 2, (G, D)
    n = src.numel()
    assert page.numel() == off.numel() == n
    if n == 0:
        return
    _store_rows_kernel[(n, H)](
        k_rows, v_rows, src.contiguous(), page.contiguous(), off.contiguous(), dst.k, dst.v,
        dst.k.view(torch.float16), dst.v.view(torch.float16),
        k_rows.stride(0), k_rows.stride(1), dst.k.stride(0), dst.k.stride(1),
        TIER=dst.tier, PAGE=dst.page_size, HEAD_DIM=D, G=G, num_warps=1)


def store_rows_quantized_reference(k_rows, v_rows, src, dst: TierPages, page, off) -> None:
    """Torch reference: tier_codec.quantize through TierPages.write."""
    assert TIER_BITS[dst.tier] in (8, 4)
    dst.write(page, off, k_rows[src], v_rows[src])
