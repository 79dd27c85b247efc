"""Torch reference codec for the SpectrumKV precision tiers (fp16 / int8 / int4).

This module is the *definition* of the tier formats: the Triton kernels in this package
(store, attention, pack) must agree with it bit for bit on the stored bytes, up to the
documented rounding-boundary exceptions on GPU.

Format (per token, per head, for K and V independently)
-------------------------------------------------------
The last dim D is split into D // group_size groups of `group_size` contiguous channels.
Each group g has an fp16 `scale[g]` and an fp16 `zero[g]` and is *asymmetric*:

    x  ~=  q * scale + zero          q in [0, QMAX],  QMAX = 2**bits - 1

    zero  = round_down_fp16(min(x_g))          (exactly min(x_g) for fp16 inputs)
    scale = round_up_fp16((max(x_g) - zero) / QMAX)
    q     = clamp(floor((x - zero) / scale + 0.5), 0, QMAX)     (q = 0 where scale == 0)

Rounding `zero` down and `scale` up guarantees that the whole group range
[zero, zero + QMAX*scale] covers [min, max], so clamping never bites and the round-trip
error is at most scale/2 (plus fp32 arithmetic noise and the final cast to out_dtype).
The arithmetic is done in fp32 with IEEE division; rounding is half-up (floor(v + 0.5)),
not torch.round's half-to-even, because that is what the kernels can reproduce.

Packing
-------
int8: q is uint8 [..., D].
int4: q is uint8 [..., D // 2], split halves: byte j holds channel j in its LOW nibble and
      channel j + D/2 in its HIGH nibble:  byte = q[j] | (q[j + D/2] << 4). A kernel takes the
      low nibbles of a row as the first half of the head dim and the high nibbles as the second,
      so it never interleaves nibbles in registers (q . k = q[:D/2] . lo + q[D/2:] . hi).
scale, zero: float16 [..., D // group_size].
fp16 tier: the tensor itself (model dtype, 2 bytes/elem), no scales.

Values must lie in fp16 range (|x| <= 65504); K/V activations of fp16/bf16 models do.
"""
from __future__ import annotations

import torch

TIER_FP16, TIER_INT8, TIER_INT4 = 0, 1, 2
TIERS = (TIER_FP16, TIER_INT8, TIER_INT4)
TIER_BITS = {TIER_FP16: 16, TIER_INT8: 8, TIER_INT4: 4}
TIER_NAMES = {TIER_FP16: "fp16", TIER_INT8: "int8", TIER_INT4: "int4"}
BITS_TO_TIER = {16: TIER_FP16, 8: TIER_INT8, 4: TIER_INT4}

# Channels per (scale, zero) pair. 32 keeps the int4 scale overhead at 4 bytes per
# 16 payload bytes (D=128: 64 B payload + 16 B scales per token/head) -- see payload_bytes.
DEFAULT_GROUP_SIZE = 32

_SCALE_DTYPE = torch.float16


def _check(x_last: int, bits: int, group_size: int) -> None:
    if bits not in (8, 4):
        raise ValueError(f"quantize/dequantize take bits in (8, 4), got {bits}")
    if group_size <= 0 or x_last % group_size != 0:
        raise ValueError(f"head_dim {x_last} must be a multiple of group_size {group_size}")
    if bits == 4 and x_last % 2 != 0:
        raise ValueError("int4 needs an even head_dim (two channels per byte)")


def _round_up_fp16(v: torch.Tensor) -> torch.Tensor:
    """Smallest fp16 >= v (v fp32, v >= 0)."""
    h = v.to(torch.float16)
    low = h.to(torch.float32) < v
    bumped = (h.view(torch.int16) + 1).view(torch.float16)
    return torch.where(low, bumped, h)


def _round_down_fp16(v: torch.Tensor) -> torch.Tensor:
    """Largest fp16 <= v (v fp32, any sign)."""
    h = v.to(torch.float16)
    high = h.to(torch.float32) > v
    bits = h.view(torch.int16)
    # positive: one ulp down is bits-1; negative: bits+1; +0 -> smallest negative subnormal.
    down = torch.where(h > 0, bits - 1, torch.where(h < 0, bits + 1, torch.full_like(bits, -32767)))
    return torch.where(high, down.view(torch.float16), h)


def quantize(x: torch.Tensor, bits: int, group_size: int = DEFAULT_GROUP_SIZE):
    """x [..., D] (fp16/bf16/fp32) -> (q, scale, zero); see the module docstring.

    Returns q uint8 [..., D] (bits=8) or [..., D//2] (bits=4, split halves: low nibble = channel j,
    high nibble = channel j + D/2),
    scale/zero float16 [..., D // group_size].
    """
    D = x.shape[-1]
    _check(D, bits, group_size)
    qmax = float((1 << bits) - 1)
    xg = x.float().reshape(*x.shape[:-1], D // group_size, group_size)
    zero = _round_down_fp16(xg.amin(dim=-1))
    zero32 = zero.float()
    # NOTE: divide by a tensor: CUDA torch turns `/ python_scalar` into a reciprocal multiply,
    # which is not the IEEE quotient the kernels compute (1-ulp scale differences on GPU).
    scale = _round_up_fp16((xg.amax(dim=-1) - zero32) / torch.full_like(zero32, qmax))
    scale32 = scale.float()
    safe = torch.where(scale32 > 0, scale32, torch.ones_like(scale32))
    v = (xg - zero32[..., None]) / safe[..., None]
    q = torch.floor(v + 0.5).clamp_(0.0, qmax)
    q = torch.where(scale32[..., None] > 0, q, torch.zeros_like(q))
    q = q.to(torch.uint8).reshape(*x.shape[:-1], D)
    if bits == 4:
        q = q[..., : D // 2] | (q[..., D // 2:] << 4)
    return q.contiguous(), scale.to(_SCALE_DTYPE), zero.to(_SCALE_DTYPE)


def unpack_int4(q: torch.Tensor) -> torch.Tensor:
    """uint8 [..., D//2] packed (split halves) -> uint8 [..., D] (one 4-bit value per byte)."""
    return torch.cat((q & 0x0F, q >> 4), dim=-1)


def dequantize(
    q: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    bits: int,
    group_size: int = DEFAULT_GROUP_SIZE,
    out_dtype: torch.dtype = torch.float16,
) -> torch.Tensor:
    """Inverse of quantize: x[..., c] = q[c] * scale[c // G] + zero[c // G], computed in
    fp32 and cast once to out_dtype. Returns [..., D]."""
    if q.dtype != torch.uint8:
        raise TypeError(f"q must be uint8, got {q.dtype}")
    vals = unpack_int4(q) if bits == 4 else q
    D = vals.shape[-1]
    _check(D, bits, group_size)
    vg = vals.float().reshape(*vals.shape[:-1], D // group_size, group_size)
    x = vg * scale.float()[..., None] + zero.float()[..., None]
    return x.reshape(*vals.shape[:-1], D).to(out_dtype)


def payload_bytes(
    tier: int, head_dim: int, group_size: int = DEFAULT_GROUP_SIZE, elem_bytes: int = 2,
    with_scales: bool = True,
) -> int:
    """Bytes per token, per head, for K or V alone (multiply by 2 for K+V).

    fp16: head_dim * elem_bytes
    int8: head_dim       + with_scales * (head_dim // group_size) * 4   (fp16 scale + zero)
    int4: head_dim // 2  + with_scales * (head_dim // group_size) * 4
    """
    if tier == TIER_FP16:
        return head_dim * elem_bytes
    bits = TIER_BITS[tier]
    _check(head_dim, bits, group_size)
    data = head_dim * bits // 8
    return data + (4 * (head_dim // group_size) if with_scales else 0)


def budget_cost(tier: int) -> float:
    """The paper's normalized per-element cost c(q): fp16 1.0, int8 0.5, int4 0.25
    (payload only, scales not counted -- see payload_bytes for the real byte count)."""
    return {TIER_FP16: 1.0, TIER_INT8: 0.5, TIER_INT4: 0.25}[tier]


def greedy_tier_fractions(budget: float, allow_int4: bool = True) -> tuple[float, float, float]:
    """(f16, f8, f4) token fractions of the paper's 3-tier greedy mapping (Eq. 14/15):
    b in [0.5, 1]: f16 = 2b-1, f8 = 2-2b; b in [0.25, 0.5]: f8 = 4b-1, f4 = 2-4b.
    With allow_int4=False (2-tier models) b is clamped to >= 0.5."""
    lo = 0.25 if allow_int4 else 0.5
    b = min(1.0, max(lo, float(budget)))
    if b >= 0.5:
        return (2 * b - 1, 2 - 2 * b, 0.0)
    return (0.0, 4 * b - 1, 2 - 4 * b)
