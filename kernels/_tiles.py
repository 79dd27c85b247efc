"""Shared @triton.jit helpers: fp16 directed rounding, tier quantize, page-tile and row-gather
loads, dequantize.

Every helper mirrors kernels/tier_codec.py; a change to the codec must land here too.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .tier_codec import TIER_FP16, TIER_INT4, TIER_INT8  # noqa: F401  (documented constants)


def is_interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


@triton.jit
def _round_up_fp16(v):
    """Smallest fp16 >= v (v fp32 >= 0), as fp16."""
    h = v.to(tl.float16)
    bumped = (h.to(tl.int16, bitcast=True) + 1).to(tl.float16, bitcast=True)
    return tl.where(h.to(tl.float32) < v, bumped, h)


@triton.jit
def _round_down_fp16(v):
    """Largest fp16 <= v (v fp32, any sign), as fp16."""
    h = v.to(tl.float16)
    bits = h.to(tl.int16, bitcast=True)
    one = tl.full(bits.shape, 1, tl.int16)
    neg_tiny = tl.full(bits.shape, -32767, tl.int16)  # 0x8001: smallest negative subnormal
    down = tl.where(h > 0, bits - one, tl.where(h < 0, bits + one, neg_tiny))
    return tl.where(h.to(tl.float32) > v, down.to(tl.float16, bitcast=True), h)


@triton.jit
def _quant_params(mn, mx, QMAX: tl.constexpr):
    """Group (min, max) fp32 -> (scale fp16, zero fp16, scale fp32, zero fp32, 1/scale-safe)."""
    zero = _round_down_fp16(mn)
    zero32 = zero.to(tl.float32)
    scale = _round_up_fp16(tl.math.div_rn(mx - zero32, tl.full(mx.shape, QMAX, tl.float32)))
    scale32 = scale.to(tl.float32)
    safe = tl.where(scale32 > 0, scale32, 1.0)
    return scale, zero, scale32, zero32, safe


@triton.jit
def _quantize_values(x, zero32, safe, scale32, QMAX: tl.constexpr):
    """q = clamp(floor((x - zero)/scale + 0.5), 0, QMAX), 0 where scale == 0; int32."""
    qf = tl.floor(tl.math.div_rn(x - zero32, safe) + 0.5)
    qf = tl.minimum(tl.maximum(qf, 0.0), QMAX)
    qf = tl.where(scale32 > 0, qf, 0.0)
    return qf.to(tl.int32)


@triton.jit
def _load_page_raw(
    data_ptr, scale_ptr, zero_ptr, base, sbase, offs_t, tmask,
    TIER: tl.constexpr, HEAD_DIM: tl.constexpr, GROUP_SIZE: tl.constexpr,
):
    """Issue the loads of one page-head tile of K or V, without using them yet (so a caller
    can prefetch page p+1 while computing page p). Returns (data, scale, zero):

        fp16: data [PAGE, D] (scale = zero = data, unused)
        int8: data [PAGE, NG, G] uint8, scale/zero [PAGE, NG] fp16
        int4: data [PAGE, NG, G/2] uint8 (low nibble = even channel), scale/zero [PAGE, NG]

    data_ptr + base: the contiguous [PAGE, W] block; scale/zero_ptr + sbase: [PAGE, NG].
    Rows with tmask == False read as 0."""
    NG: tl.constexpr = HEAD_DIM // GROUP_SIZE
    if TIER == 0:
        offs_d = tl.arange(0, HEAD_DIM)
        x = tl.load(data_ptr + base + offs_t[:, None] * HEAD_DIM + offs_d[None, :],
                    mask=tmask[:, None], other=0.0)
        return x, x, x
    else:
        W: tl.constexpr = HEAD_DIM if TIER == 1 else HEAD_DIM // 2
        GW: tl.constexpr = GROUP_SIZE if TIER == 1 else GROUP_SIZE // 2
        offs_g = tl.arange(0, NG)
        offs_j = tl.arange(0, GW)
        offs3 = offs_t[:, None, None] * W + offs_g[None, :, None] * GW + offs_j[None, None, :]
        q = tl.load(data_ptr + base + offs3, mask=tmask[:, None, None], other=0)
        soff = sbase + offs_t[:, None] * NG + offs_g[None, :]
        s = tl.load(scale_ptr + soff, mask=tmask[:, None], other=0.0)
        z = tl.load(zero_ptr + soff, mask=tmask[:, None], other=0.0)
        return q, s, z


@triton.jit
def _u8_to_f16(c):
    """uint8 0..255 -> exact fp16 without an int->float conversion instruction:
    fp16 bits 0x6400 | c encode 1024 + c, so subtract 1024 (exact)."""
    return (c.to(tl.int32) | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - 1024.0


@triton.jit
def _dequant_tile(q, s, z, OUT_DTYPE: tl.constexpr, TIER: tl.constexpr, PAGE: tl.constexpr,
                  HEAD_DIM: tl.constexpr, FAST: tl.constexpr):
    """(data, scale, zero) from _load_page_raw -> [PAGE, HEAD_DIM] OUT_DTYPE.

    FAST=False: fp32 math exactly as tier_codec.dequantize (x = q*scale + zero, one rounding).
    FAST=True: q -> fp16 by bit trick, x = q*scale + zero in fp16 (q*scale is exact in fp32,
    fp16 FMA rounds once; an unfused mul+add can differ by 1 fp16 ulp): no I2F/F2F
    conversions, which are quarter-rate and bound the fp32 path."""
    if TIER == 0:
        return q.to(OUT_DTYPE)
    else:
        if FAST:
            s3 = s.to(tl.float16)[:, :, None]
            z3 = z.to(tl.float16)[:, :, None]
            if TIER == 1:
                x = (_u8_to_f16(q) * s3 + z3).to(OUT_DTYPE)
                return tl.reshape(x, (PAGE, HEAD_DIM))
            else:
                lo = (_u8_to_f16(q & 15) * s3 + z3).to(OUT_DTYPE)
                hi = (_u8_to_f16(q >> 4) * s3 + z3).to(OUT_DTYPE)
                return tl.reshape(tl.join(lo, hi), (PAGE, HEAD_DIM))
        else:
            s3 = s.to(tl.float32)[:, :, None]
            z3 = z.to(tl.float32)[:, :, None]
            if TIER == 1:
                x = (q.to(tl.float32) * s3 + z3).to(OUT_DTYPE)
                return tl.reshape(x, (PAGE, HEAD_DIM))
            else:
                lo = ((q & 15).to(tl.float32) * s3 + z3).to(OUT_DTYPE)
                hi = ((q >> 4).to(tl.float32) * s3 + z3).to(OUT_DTYPE)
                # join -> [PAGE, NG, G/2, 2]: channel g*G + 2j + i, low nibble = even channel
                return tl.reshape(tl.join(lo, hi), (PAGE, HEAD_DIM))


@triton.jit
def _load_page_tile(
    data_ptr, scale_ptr, zero_ptr, base, sbase, offs_t, tmask,
    OUT_DTYPE: tl.constexpr, TIER: tl.constexpr, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr,
    GROUP_SIZE: tl.constexpr, FAST: tl.constexpr,
):
    """One page-head tile [PAGE, HEAD_DIM] of K or V in OUT_DTYPE (load + dequantize)."""
    q, s, z = _load_page_raw(data_ptr, scale_ptr, zero_ptr, base, sbase, offs_t, tmask,
                             TIER, HEAD_DIM, GROUP_SIZE)
    return _dequant_tile(q, s, z, OUT_DTYPE, TIER, PAGE, HEAD_DIM, FAST)


@triton.jit
def _load_rows_raw(
    data_ptr, scale_ptr, zero_ptr, row_off, srow_off, tmask,
    TIER: tl.constexpr, HEAD_DIM: tl.constexpr, GROUP_SIZE: tl.constexpr,
):
    """Token-gather twin of _load_page_raw: BLOCK_N rows that need not be adjacent.

    row_off  int64 [BLOCK_N]: element offset of each token's (row, kv-head) vector in data_ptr
    srow_off int64 [BLOCK_N]: the same for its D/G scales (and zeros)
    Returns the (data, scale, zero) shapes of _load_page_raw with PAGE = BLOCK_N, so
    _dequant_tile applies unchanged. Rows with tmask == False read as 0.
    NOTE: each row is a separate short burst (int4: D/2 bytes + two D/G*2-byte scale rows),
    so a gather moves whole sectors for a few useful bytes; see kernels/README.md section 6."""
    NG: tl.constexpr = HEAD_DIM // GROUP_SIZE
    if TIER == 0:
        offs_d = tl.arange(0, HEAD_DIM)
        x = tl.load(data_ptr + row_off[:, None] + offs_d[None, :], mask=tmask[:, None], other=0.0)
        return x, x, x
    else:
        GW: tl.constexpr = GROUP_SIZE if TIER == 1 else GROUP_SIZE // 2
        offs_g = tl.arange(0, NG)
        offs_j = tl.arange(0, GW)
        offs3 = row_off[:, None, None] + offs_g[None, :, None] * GW + offs_j[None, None, :]
        q = tl.load(data_ptr + offs3, mask=tmask[:, None, None], other=0)
        soff = srow_off[:, None] + offs_g[None, :]
        s = tl.load(scale_ptr + soff, mask=tmask[:, None], other=0.0)
        z = tl.load(zero_ptr + soff, mask=tmask[:, None], other=0.0)
        return q, s, z
