"""Fused SwiGLU activation: silu(gate) * up in one launch instead of chunk + 2 kernels.

    fused_silu_mul(x) -> out

x   [T, 2I] model dtype (fp16/bf16), [gate | up] halves as gate_up_proj produces; rows may be
    strided, last dim contiguous
out [T, I] new contiguous tensor
grid = (T, cdiv(I, BLOCK)).

Rounding as torch's `F.silu(gate) * up`: silu computed in fp32 (x / (1 + exp(-x))) and rounded
to the model dtype, then the product of the two dtype values in fp32, rounded. exp may differ
from torch's by an fp32 ulp, so rare elements can differ by one dtype ulp.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _fused_silu_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, I, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    gate = tl.load(x_ptr + t * stride_x + offs, mask=mask, other=0.0)
    up = tl.load(x_ptr + t * stride_x + I + offs, mask=mask, other=0.0)
    dt = gate.dtype
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(dt)  # rounded to the model dtype, as F.silu returns it
    out = (act.to(tl.float32) * up.to(tl.float32)).to(dt)
    tl.store(out_ptr + t * stride_o + offs, out, mask=mask)


def fused_silu_mul(x: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """x [T, 2I] -> silu(x[:, :I]) * x[:, I:] as a new [T, I]. CUDA-graph capturable."""
    assert x.dim() == 2 and x.dtype in (torch.float16, torch.bfloat16), (x.shape, x.dtype)
    assert x.shape[1] % 2 == 0 and x.stride(1) == 1
    T, I = x.shape[0], x.shape[1] // 2
    out = torch.empty((T, I), dtype=x.dtype, device=x.device)
    if T > 0:
        BLOCK = min(block, triton.next_power_of_2(I))
        _fused_silu_mul_kernel[(T, triton.cdiv(I, BLOCK))](
            x, out, x.stride(0), out.stride(0), I, BLOCK=BLOCK, num_warps=4,
        )
    return out


def fused_silu_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """The unfused torch math the model runs without this kernel (`reference.silu_mul_torch`)."""
    from .reference import silu_mul_torch

    return silu_mul_torch(x)
