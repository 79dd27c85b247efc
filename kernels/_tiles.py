"""Shared @triton.jit helpers: fp16 directed rounding and the tier quantizer (mirrors of
kernels/tier_codec.py: a change to the codec must land here too), exact uint8 / nibble -> fp16
code conversion (portable and PRMT / LOP3), a GPU-scope fence; host helpers.
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
def _u8_to_f16(c):
    """uint8 0..255 -> exact fp16 without an int->float conversion instruction:
    fp16 bits 0x6400 | c encode 1024 + c, so subtract 1024 (exact)."""
    return (c.to(tl.int32) | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - 1024.0


@triton.jit
def _u8x4_to_f16_asm(x):
    """4 packed bytes -> fp16 (1024 + byte) each: two byte permutes (PRMT) per 4 codes. Lane
    pairs: out0 = (b0, b1), out1 = (b2, b3), each byte under a 0x64 high byte."""
    return tl.inline_asm_elementwise(
        "{ .reg .b32 c; mov.b32 c, 0x64646464;"
        " prmt.b32 $0, $2, c, 0x5150; prmt.b32 $1, $2, c, 0x5352; }",
        "=r,=r,r", [x], dtype=tl.float16, is_pure=True, pack=4)


@triton.jit
def _nibbles_to_f16_asm(x):
    """4 packed bytes -> (1024 + low nibble, 1024 + high nibble) as fp16, each of the 8 codes with
    one LOP3 ((t & 0x000F000F) | 0x64006400) after spreading the bytes into 16-bit lanes (PRMT
    with zeros) and, for the high nibbles, a 4-bit shift."""
    return tl.inline_asm_elementwise(
        "{ .reg .b32 t0, t1, u0, u1, z; mov.b32 z, 0;"
        " prmt.b32 t0, $4, z, 0x5150; prmt.b32 t1, $4, z, 0x5352;"
        " shr.b32 u0, t0, 4; shr.b32 u1, t1, 4;"
        " lop3.b32 $0, t0, 0x000F000F, 0x64006400, 0xEA; lop3.b32 $1, t1, 0x000F000F, 0x64006400, 0xEA;"
        " lop3.b32 $2, u0, 0x000F000F, 0x64006400, 0xEA; lop3.b32 $3, u1, 0x000F000F, 0x64006400, 0xEA; }",
        "=r,=r,=r,=r,r", [x], dtype=(tl.float16, tl.float16), is_pure=True, pack=4)


@triton.jit
def _cvt_u8(c, FAST: tl.constexpr):
    """uint8 codes -> the same integers in fp16 (exact). FAST: PRMT (GPU only)."""
    if FAST:
        return _u8x4_to_f16_asm(c) - 1024.0
    else:
        return _u8_to_f16(c)


@triton.jit
def _cvt_nibbles(c, FAST: tl.constexpr):
    """uint8 bytes -> (low nibbles, high nibbles) as exact fp16 integers. FAST: PRMT/LOP3 (GPU)."""
    if FAST:
        lo, hi = _nibbles_to_f16_asm(c)
        return lo - 1024.0, hi - 1024.0
    else:
        return _u8_to_f16(c & 15), _u8_to_f16(c >> 4)


# Single-result conversions (codes -> exact fp16 values, the 1024 bias removed inside the asm): a
# pure one-input one-result inline asm lets Triton move the layout conversion into the dot operand
# ahead of it, so the 8-bit codes, not their fp16 values, go through shared memory (1 byte per
# int8 code, half a byte per int4 code, against 2 bytes per fp16 value).

@triton.jit
def _u8x4_exact_asm(x):
    """4 bytes -> the 4 codes as exact fp16 (2 PRMT + 2 HSUB2)."""
    return tl.inline_asm_elementwise(
        "{ .reg .b32 c, b; mov.b32 c, 0x64646464; mov.b32 b, 0x64006400;"
        " prmt.b32 $0, $2, c, 0x5150; prmt.b32 $1, $2, c, 0x5352;"
        " sub.f16x2 $0, $0, b; sub.f16x2 $1, $1, b; }",
        "=r,=r,r", [x], dtype=tl.float16, is_pure=True, pack=4)


@triton.jit
def _lo_nibbles_exact_asm(x):
    """4 bytes -> their low nibbles as exact fp16 (2 PRMT + 2 LOP3 + 2 HSUB2)."""
    return tl.inline_asm_elementwise(
        "{ .reg .b32 z, b; mov.b32 z, 0; mov.b32 b, 0x64006400;"
        " prmt.b32 $0, $2, z, 0x5150; prmt.b32 $1, $2, z, 0x5352;"
        " lop3.b32 $0, $0, 0x000F000F, 0x64006400, 0xEA; lop3.b32 $1, $1, 0x000F000F, 0x64006400, 0xEA;"
        " sub.f16x2 $0, $0, b; sub.f16x2 $1, $1, b; }",
        "=r,=r,r", [x], dtype=tl.float16, is_pure=True, pack=4)


@triton.jit
def _hi_nibbles16_exact_asm(x):
    """4 bytes -> 16 * their high nibbles as exact fp16 (the nibble masked in place, no shift)."""
    return tl.inline_asm_elementwise(
        "{ .reg .b32 z, b; mov.b32 z, 0; mov.b32 b, 0x64006400;"
        " prmt.b32 $0, $2, z, 0x5150; prmt.b32 $1, $2, z, 0x5352;"
        " lop3.b32 $0, $0, 0x00F000F0, 0x64006400, 0xEA; lop3.b32 $1, $1, 0x00F000F0, 0x64006400, 0xEA;"
        " sub.f16x2 $0, $0, b; sub.f16x2 $1, $1, b; }",
        "=r,=r,r", [x], dtype=tl.float16, is_pure=True, pack=4)


@triton.jit
def _u8x4_subnormal_asm(x):
    """4 bytes -> c * 2^-24 as fp16 each (the byte under a zero high byte: an exact subnormal)."""
    return tl.inline_asm_elementwise(
        "{ .reg .b32 z; mov.b32 z, 0; prmt.b32 $0, $2, z, 0x5150; prmt.b32 $1, $2, z, 0x5352; }",
        "=r,=r,r", [x], dtype=tl.float16, is_pure=True, pack=4)


@triton.jit
def _nibbles_subnormal_asm(x, MASK: tl.constexpr):
    """4 bytes -> (byte & MASK) * 2^-24 as fp16 each (MASK 0x0F: low nibbles; 0xF0: 16 * high)."""
    if MASK == 15:
        return tl.inline_asm_elementwise(
            "{ .reg .b32 z; mov.b32 z, 0; prmt.b32 $0, $2, z, 0x5150; prmt.b32 $1, $2, z, 0x5352;"
            " and.b32 $0, $0, 0x000F000F; and.b32 $1, $1, 0x000F000F; }",
            "=r,=r,r", [x], dtype=tl.float16, is_pure=True, pack=4)
    else:
        return tl.inline_asm_elementwise(
            "{ .reg .b32 z; mov.b32 z, 0; prmt.b32 $0, $2, z, 0x5150; prmt.b32 $1, $2, z, 0x5352;"
            " and.b32 $0, $0, 0x00F000F0; and.b32 $1, $1, 0x00F000F0; }",
            "=r,=r,r", [x], dtype=tl.float16, is_pure=True, pack=4)


@triton.jit
def _u8_subnormal(c):
    """uint8 0..255 -> c * 2^-24 as fp16 (portable)."""
    return c.to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _cvt_u8_one(c, FAST: tl.constexpr, SUB: tl.constexpr):
    """uint8 codes -> c * U as fp16, one result: U = 1 (SUB False) or 2^-24 (SUB: a subnormal,
    no bias to subtract). FAST: PRMT asm (GPU only)."""
    if SUB:
        if FAST:
            return _u8x4_subnormal_asm(c)
        else:
            return _u8_subnormal(c)
    else:
        if FAST:
            return _u8x4_exact_asm(c)
        else:
            return _u8_to_f16(c)


@triton.jit
def _cvt_lo_one(c, FAST: tl.constexpr, SUB: tl.constexpr):
    """uint8 bytes -> low nibbles * U as fp16, one result (U as in _cvt_u8_one)."""
    if SUB:
        if FAST:
            return _nibbles_subnormal_asm(c, 15)
        else:
            return _u8_subnormal(c & 15)
    else:
        if FAST:
            return _lo_nibbles_exact_asm(c)
        else:
            return _u8_to_f16(c & 15)


@triton.jit
def _cvt_hi16_one(c, FAST: tl.constexpr, SUB: tl.constexpr):
    """uint8 bytes -> 16 * high nibbles * U as fp16, one result (U as in _cvt_u8_one)."""
    if SUB:
        if FAST:
            return _nibbles_subnormal_asm(c, 240)
        else:
            return _u8_subnormal(c & 0xF0)
    else:
        if FAST:
            return _hi_nibbles16_exact_asm(c)
        else:
            return _u8_to_f16(c & 0xF0)


@triton.jit
def _gpu_fence(x):
    """fence.acq_rel.gpu in every thread that holds an element of x (GPU only): orders this
    thread's earlier stores before a later release by another thread of the CTA."""
    return tl.inline_asm_elementwise("fence.acq_rel.gpu; mov.b32 $0, $1;", "=r,r", [x.to(tl.int32)],
                                     dtype=tl.int32, is_pure=False, pack=1)
