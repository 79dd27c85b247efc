"""Torch references of the elementwise and FusedKV kernels (no triton import).

Each kernel's test compares it with the function here; the runtime runs the same functions
wherever no kernel applies (CPU fp32, a disabled kernel), so a kernel is checked against the
exact math the model runs without it. The runtime imports them from here (layers/fused_ops.py,
layers/rope.py, models/fusedkv_math.py), never the other way round.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def rmsnorm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """The unfused HF-exact math (float32 statistics); the fused kernel's reference."""
    if residual is not None:
        x = x + residual
        residual = x
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * xf.to(x.dtype)
    return out if residual is None else (out, residual)


def silu_mul_torch(x: torch.Tensor) -> torch.Tensor:
    """The unfused torch math; the fused kernel's reference."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D], cos/sin [T, 1, D/2] -> new rotated tensor [T, H, D] (contiguous)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    torch.sub(x1 * cos, x2 * sin, out=out[..., :half])
    torch.add(x2 * cos, x1 * sin, out=out[..., half:])
    return out


def fuse_kv(k0: torch.Tensor, k1: torch.Tensor, v0: torch.Tensor, v1: torch.Tensor,
            key_weight: torch.Tensor, value_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference fusion. k*, v* [..., Hkv, D] (sources s0, s1; post-RoPE keys);
    key_weight, value_weight [2, Hkv, D] PER CHANNEL (key: `expand_key_weight` of the stored
    pair weights). Numerics contract (the kernels follow it): fp32 products and sum (fp64 for
    fp64 inputs), one rounding to the sources' dtype. Returns (K, V) [..., Hkv, D] in the sources' dtype."""
    if key_weight.shape != value_weight.shape or key_weight.shape[0] != 2:
        raise ValueError(f"weights must both be [2, Hkv, D], got {tuple(key_weight.shape)} / {tuple(value_weight.shape)}")
    if k0.shape[-2:] != key_weight.shape[1:]:
        raise ValueError(f"KV [..., Hkv, D] = {tuple(k0.shape)} does not match weights {tuple(key_weight.shape)}")
    acc = torch.promote_types(k0.dtype, torch.float32)  # fp32 (fp64 inputs stay fp64)
    a, b = key_weight.to(acc), value_weight.to(acc)
    k = a[0] * k0.to(acc) + a[1] * k1.to(acc)
    v = b[0] * v0.to(acc) + b[1] * v1.to(acc)
    return k.to(k0.dtype), v.to(v0.dtype)
