"""Quantize-and-store: new K/V rows of a batch into the paged tiered pool, one launch.

    store_tiered_kv(layer, k, v, tiers, page_ids, offsets)

k, v     [N, Hkv, D] model dtype (post-RoPE K)
tiers    int32 [N]   TIER_FP16 / TIER_INT8 / TIER_INT4 of each token
page_ids int32 [N]   page id inside that token's tier pool
offsets  int32 [N]   slot inside the page, 0 <= offset < PAGE

grid = (N, Hkv): one program quantizes K and V of one (token, kv-head) row, writing
data + fp16 scale/zero exactly as tier_codec.quantize does.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import tier_codec as tc
from ._tiles import _quant_params, _quantize_values
from .paged_layout import TieredKVLayer


@triton.jit
def _store_row_int8(x_ptr, data_ptr, scale_ptr, zero_ptr, dbase, sbase,
                    HEAD_DIM: tl.constexpr, GROUP_SIZE: tl.constexpr):
    NG: tl.constexpr = HEAD_DIM // GROUP_SIZE
    offs_g = tl.arange(0, NG)
    offs_j = tl.arange(0, GROUP_SIZE)
    offs = offs_g[:, None] * GROUP_SIZE + offs_j[None, :]  # [NG, G] channel ids
    x = tl.load(x_ptr + offs).to(tl.float32)
    scale, zero, scale32, zero32, safe = _quant_params(tl.min(x, 1), tl.max(x, 1), 255.0)
    q = _quantize_values(x, zero32[:, None], safe[:, None], scale32[:, None], 255.0)
    tl.store(data_ptr + dbase + offs, q.to(tl.uint8))
    tl.store(scale_ptr + sbase + offs_g, scale)
    tl.store(zero_ptr + sbase + offs_g, zero)


@triton.jit
def _store_row_int4(x_ptr, data_ptr, scale_ptr, zero_ptr, dbase, sbase,
                    HEAD_DIM: tl.constexpr, GROUP_SIZE: tl.constexpr):
    NG: tl.constexpr = HEAD_DIM // GROUP_SIZE
    HG: tl.constexpr = GROUP_SIZE // 2
    offs_g = tl.arange(0, NG)
    offs_i = tl.arange(0, HG)
    offs_j = tl.arange(0, 2)
    # [NG, G/2, 2]: channel g*G + 2i + j; byte g*G/2 + i holds j=0 low, j=1 high
    offs = (offs_g[:, None, None] * GROUP_SIZE + offs_i[None, :, None] * 2
            + offs_j[None, None, :])
    x = tl.load(x_ptr + offs).to(tl.float32)
    mn = tl.min(tl.min(x, 2), 1)
    mx = tl.max(tl.max(x, 2), 1)
    scale, zero, scale32, zero32, safe = _quant_params(mn, mx, 15.0)
    q = _quantize_values(x, zero32[:, None, None], safe[:, None, None],
                         scale32[:, None, None], 15.0)
    nib = tl.where(offs_j == 1, 16, 1)
    packed = tl.sum(q * nib[None, None, :], axis=2)  # [NG, G/2]
    boffs = offs_g[:, None] * HG + offs_i[None, :]
    tl.store(data_ptr + dbase + boffs, packed.to(tl.uint8))
    tl.store(scale_ptr + sbase + offs_g, scale)
    tl.store(zero_ptr + sbase + offs_g, zero)


@triton.jit
def _store_tiered_kv_kernel(
    k_ptr, v_ptr, tier_ptr, page_ptr, off_ptr,
    k16_ptr, v16_ptr,
    k8_ptr, v8_ptr, k8s_ptr, k8z_ptr, v8s_ptr, v8z_ptr,
    k4_ptr, v4_ptr, k4s_ptr, k4z_ptr, v4s_ptr, v4z_ptr,
    stride_xn, stride_xh,
    stride_p16, stride_h16, stride_p8, stride_h8, stride_p4, stride_h4,
    stride_sp8, stride_sh8, stride_sp4, stride_sh4,
    HEAD_DIM: tl.constexpr, GROUP_SIZE: tl.constexpr,
):
    n = tl.program_id(0)
    h = tl.program_id(1)
    tier = tl.load(tier_ptr + n)
    page = tl.load(page_ptr + n).to(tl.int64)
    slot = tl.load(off_ptr + n)
    NG: tl.constexpr = HEAD_DIM // GROUP_SIZE
    xo = n.to(tl.int64) * stride_xn + h * stride_xh
    if tier == 0:
        offs_d = tl.arange(0, HEAD_DIM)
        dbase = page * stride_p16 + h * stride_h16 + slot * HEAD_DIM
        tl.store(k16_ptr + dbase + offs_d, tl.load(k_ptr + xo + offs_d))
        tl.store(v16_ptr + dbase + offs_d, tl.load(v_ptr + xo + offs_d))
    elif tier == 1:
        dbase = page * stride_p8 + h * stride_h8 + slot * HEAD_DIM
        sbase = page * stride_sp8 + h * stride_sh8 + slot * NG
        _store_row_int8(k_ptr + xo, k8_ptr, k8s_ptr, k8z_ptr, dbase, sbase, HEAD_DIM, GROUP_SIZE)
        _store_row_int8(v_ptr + xo, v8_ptr, v8s_ptr, v8z_ptr, dbase, sbase, HEAD_DIM, GROUP_SIZE)
    else:
        dbase = page * stride_p4 + h * stride_h4 + slot * (HEAD_DIM // 2)
        sbase = page * stride_sp4 + h * stride_sh4 + slot * NG
        _store_row_int4(k_ptr + xo, k4_ptr, k4s_ptr, k4z_ptr, dbase, sbase, HEAD_DIM, GROUP_SIZE)
        _store_row_int4(v_ptr + xo, v4_ptr, v4s_ptr, v4z_ptr, dbase, sbase, HEAD_DIM, GROUP_SIZE)


def store_tiered_kv(layer: TieredKVLayer, k: torch.Tensor, v: torch.Tensor,
                    tiers: torch.Tensor, page_ids: torch.Tensor, offsets: torch.Tensor) -> None:
    """Quantize k, v [N, Hkv, D] per token tier and write them into `layer` (in place)."""
    layer.check()
    N, H, D = k.shape
    assert v.shape == k.shape and D == layer.head_dim and H == layer.num_kv_heads
    assert k.dtype == v.dtype == layer.dtype, (k.dtype, layer.dtype)
    assert k.stride(-1) == 1 and v.stride() == k.stride(), "k/v: last dim contiguous, same strides"
    for t in (tiers, page_ids, offsets):
        assert t.dtype == torch.int32 and t.shape == (N,) and t.is_contiguous()
    if N == 0:
        return
    f16, i8, i4 = layer.pages
    _store_tiered_kv_kernel[(N, H)](
        k, v, tiers, page_ids, offsets,
        f16.k, f16.v,
        i8.k, i8.v, i8.k_scale, i8.k_zero, i8.v_scale, i8.v_zero,
        i4.k, i4.v, i4.k_scale, i4.k_zero, i4.v_scale, i4.v_zero,
        k.stride(0), k.stride(1),
        f16.k.stride(0), f16.k.stride(1), i8.k.stride(0), i8.k.stride(1),
        i4.k.stride(0), i4.k.stride(1),
        i8.k_scale.stride(0), i8.k_scale.stride(1), i4.k_scale.stride(0), i4.k_scale.stride(1),
        HEAD_DIM=D, GROUP_SIZE=layer.group_size,
        num_warps=1,
    )


def store_tiered_kv_reference(layer: TieredKVLayer, k, v, tiers, page_ids, offsets) -> None:
    """Torch reference of store_tiered_kv (same bytes, via tier_codec.quantize)."""
    tiers, page_ids, offsets = tiers.long(), page_ids.long(), offsets.long()
    for t in tc.TIERS:
        sel = (tiers == t).nonzero().flatten()
        if sel.numel() == 0:
            continue
        p, o = page_ids[sel], offsets[sel]
        tp = layer[t]
        if t == tc.TIER_FP16:
            tp.k[p, :, o] = k[sel]
            tp.v[p, :, o] = v[sel]
            continue
        bits = tc.TIER_BITS[t]
        for x, data, sc, zr in ((k, tp.k, tp.k_scale, tp.k_zero), (v, tp.v, tp.v_scale, tp.v_zero)):
            q, s, z = tc.quantize(x[sel], bits, layer.group_size)
            data[p, :, o] = q
            sc[p, :, o] = s
            zr[p, :, o] = z
