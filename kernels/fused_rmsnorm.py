"""Fused (residual add +) RMSNorm: one launch instead of ~9 elementwise kernels.

    fused_rmsnorm(x, weight, eps, residual=None) -> out | (out, new_residual)

x, residual  [T, H] model dtype (fp16/bf16), rows may be strided, last dim contiguous
weight       [H] same dtype
grid = (T,): one program normalizes one token row (BLOCK_H = next_pow2(H) >= H, masked).

Rounding (bit-for-bit the torch reference up to fp32 reduction order):
    s   = (x.f32 + residual.f32).to(dtype)          torch's same-dtype add; written as new_residual
    var = mean(s.f32 ** 2)                          fp32 statistics (HF LlamaRMSNorm)
    y   = (s.f32 * rsqrt(var + eps)).to(dtype)
    out = (weight.f32 * y.f32).to(dtype)            torch's same-dtype `weight * y`
The sum order differs from torch's, so var may differ in the last fp32 bits: out can be off by
one dtype ulp on rare elements (tests allow exactly that).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _fused_rmsnorm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, new_res_ptr,
    stride_x, stride_r, stride_o, stride_nr,
    H, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK_H: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    mask = offs < H
    s = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0)
        # round the sum to the model dtype before the statistics, as torch's add does
        s = (s.to(tl.float32) + r.to(tl.float32)).to(new_res_ptr.dtype.element_ty)
        tl.store(new_res_ptr + row * stride_nr + offs, s, mask=mask)
    sf = s.to(tl.float32)  # masked lanes are 0: they add nothing to the sum of squares
    var = tl.sum(sf * sf, axis=0) / H
    y = (sf * tl.math.rsqrt(var + eps)).to(out_ptr.dtype.element_ty)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    out = (w.to(tl.float32) * y.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + offs, out, mask=mask)


def fused_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                  residual: torch.Tensor | None = None):
    """x [T, H] -> out [T, H]; with residual: (out, x + residual), both new contiguous tensors.
    No host sync, shapes from the inputs only: CUDA-graph capturable."""
    assert x.dim() == 2 and x.dtype in (torch.float16, torch.bfloat16), (x.shape, x.dtype)
    T, H = x.shape
    assert weight.shape == (H,) and weight.dtype == x.dtype and weight.stride(0) == 1
    assert x.stride(1) == 1, "last dim must be contiguous"
    out = torch.empty((T, H), dtype=x.dtype, device=x.device)
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(1) == 1
        new_res = torch.empty_like(out)
        res_arg, stride_r = residual, residual.stride(0)
    else:
        new_res, res_arg, stride_r = out, x, 0  # unused (HAS_RESIDUAL=False prunes the loads)
    if T > 0:
        BLOCK_H = triton.next_power_of_2(H)
        _fused_rmsnorm_kernel[(T,)](
            x, res_arg, weight, out, new_res,
            x.stride(0), stride_r, out.stride(0), new_res.stride(0),
            H, float(eps),
            HAS_RESIDUAL=residual is not None, BLOCK_H=BLOCK_H,
            num_warps=min(max(BLOCK_H // 256, 1), 16),
        )
    return out if residual is None else (out, new_res)


def fused_rmsnorm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float,
                            residual: torch.Tensor | None = None):
    """The unfused torch math the model runs without this kernel (`reference.rmsnorm_torch`)."""
    from .reference import rmsnorm_torch

    return rmsnorm_torch(x, weight, eps, residual)
