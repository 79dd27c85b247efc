"""Quantised SCD codes on the wire (manifest dtype "int8" / "int4").

One code field of one token (a Reuse layer's k [H, r_k] or v [H, r_v], a Patch layer's h [r_h],
flattened to n numbers) is sent as n signed integers of `bits` bits plus ONE bfloat16 scale
(bf16 has float32's range, so a field of tiny or huge codes keeps its grid; its 8-bit mantissa
only moves the step, since the integers are rounded against the stored scale):

    s = bf16(max|z| / qmax)   q = clamp(round(z / s), -qmax, qmax)   z_hat = q * s

qmax = 127 (int8) or 7 (int4, two values per byte: low nibble first, stored as q + 8; an odd
count ends with a pad nibble of 0). Per-token scales follow each token's magnitude; within a
field the code's leading (principal) columns carry most of the variance, so a symmetric uniform
grid spends its levels on them and rounds the weak tail columns towards zero.

The producer's encoder already returns z_hat (fake quantisation, float32), so whatever the
offline harness measures is what the wire delivers: `pack_field` of z_hat re-derives the same
scale and the same integers (max|z_hat| / qmax = s exactly: s has 8 significant bits, qmax 7).
"""
from __future__ import annotations

import torch

WIRE_BITS = {"int8": 8, "int4": 4}
SCALE_BYTES = 2  # one bfloat16 per token and field
_TINY = 1e-30  # an all-zero field keeps a finite, normal scale


def qmax(bits: int) -> int:
    return (1 << (bits - 1)) - 1


def field_bytes(elems: int, bits: int) -> int:
    """Wire bytes of one token's field of `elems` numbers: the integers plus the scale."""
    return (elems * bits + 7) // 8 + SCALE_BYTES


def quantize(z: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """z [T, n] -> (q int8 [T, n] in [-qmax, qmax], scale bfloat16 [T])."""
    zf = z.float()
    qm = qmax(bits)
    scale = (zf.abs().amax(-1) / qm).clamp(min=_TINY).to(torch.bfloat16)
    q = torch.round(zf / scale.float()[:, None]).clamp_(-qm, qm).to(torch.int8)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(q [T, n], scale [T]) -> float32 [T, n]."""
    return q.float() * scale.float()[:, None]


def fake_quant(z: torch.Tensor, bits: int) -> torch.Tensor:
    """z [T, ...] -> float32 of the same shape, on the wire grid (per-token scale over the rest)."""
    flat = z.reshape(z.shape[0], -1)
    return dequantize(*quantize(flat, bits)).view(z.shape)


def pack_field(z: torch.Tensor, bits: int) -> torch.Tensor:
    """z [T, ...] -> uint8 [T * field_bytes(n)] as the field's wire block: the integers of every
    token ([T, ceil(n * bits / 8)], token-major), then the T bfloat16 scales."""
    flat = z.reshape(z.shape[0], -1)
    q, scale = quantize(flat, bits)
    if bits == 8:
        body = q.view(torch.uint8)
    else:
        u = (q.to(torch.int16) + 8).to(torch.uint8)  # 1..15
        if u.shape[1] % 2:
            u = torch.cat([u, torch.zeros_like(u[:, :1])], 1)
        body = u[:, 0::2] | (u[:, 1::2] << 4)
    return torch.cat([body.reshape(-1), scale.view(torch.uint8).reshape(-1)])


def unpack_field(block: torch.Tensor, tokens: int, elems: int, bits: int) -> torch.Tensor:
    """The inverse of pack_field: uint8 block of tokens * field_bytes(elems) -> float32 [tokens, elems]."""
    qb = (elems * bits + 7) // 8
    body = block[:tokens * qb].view(tokens, qb)
    # a copy: a bf16 view needs an even offset, and the integers before may have left an odd one
    scale = block[tokens * qb:tokens * (qb + SCALE_BYTES)].clone().view(torch.bfloat16)
    if bits == 8:
        q = body.contiguous().view(torch.int8)
    else:
        lo, hi = (body & 0xF).to(torch.int16) - 8, (body >> 4).to(torch.int16) - 8
        q = torch.stack([lo, hi], -1).reshape(tokens, 2 * qb)[:, :elems]
    return dequantize(q, scale)
