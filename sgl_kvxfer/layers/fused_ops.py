"""Dispatch of the model's elementwise ops: fused Triton kernels on CUDA fp16/bf16, native C++
kernels on CPU bf16 (`sgl_kvxfer.kernels.cpu_ops`), torch otherwise.

Under CUDA graphs a Llama decode step is launch-bound by ~44 small kernels per layer; the fused
kernels (`sgl_kvxfer.kernels.fused_rmsnorm / fused_rope / fused_silu_mul`) cut RMSNorm, RoPE and
SwiGLU to one launch each, and the Triton attention backend fuses RoPE with the KV store
(`kernels/rope_store.py`, via `forward_qkv`). On by default on CUDA
(SGL_KVXFER_FUSED_ELEMENTWISE=0 turns them off): compiled for a GPU they are within 2 ulp
(RMSNorm, SiLU) or the product-rounding bound (RoPE) of the torch ops, and greedy runs with
and without them part only at near ties of the top-2 logits (kernels/README.md section 7).
The CPU / fp32 path stays the plain torch code (the HF-exactness tests rely on it).
Kernel modules are imported lazily (they import triton) and looked up at call time.

On CPU bf16 the native kernels are the default (SGL_KVXFER_CPU_KERNELS=0 turns them off): torch
runs each of these ops as 5-10 separate bf16 passes, which was ~45% of a CPU prefill. fp32 keeps
the torch path, which the HF-exactness tests pin.
"""
from __future__ import annotations

import torch

from sgl_kvxfer import env
# the torch paths below are the kernels' own references: a kernel is tested against this math
from sgl_kvxfer.kernels.reference import apply_rope, rmsnorm_torch, silu_mul_torch  # noqa: F401

_FUSED_DTYPES = (torch.float16, torch.bfloat16)


def wants_fused(device_type: str, dtype: torch.dtype) -> bool:
    """True iff tensors of this device type and dtype take the fused kernels."""
    return (device_type == "cuda" and dtype in _FUSED_DTYPES
            and env.FUSED_ELEMENTWISE.get_bool())


def wants_cpu_native(t: torch.Tensor) -> bool:
    """True iff this CPU tensor takes the native C++ kernels (bf16, enabled, extension built)."""
    if t.device.type != "cpu" or t.dtype != torch.bfloat16:
        return False
    from sgl_kvxfer.kernels import cpu_ops

    return cpu_ops.enabled()


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """x [T, H] -> normed; with residual: (normed(x + residual), x + residual). HF-exact math."""
    if wants_fused(x.device.type, x.dtype) and weight.dtype == x.dtype:
        from sgl_kvxfer.kernels import fused_rmsnorm as k

        return k.fused_rmsnorm(x, weight, eps, residual)
    if weight.dtype == x.dtype and wants_cpu_native(x):
        from sgl_kvxfer.kernels import cpu_ops

        return cpu_ops.add_rmsnorm(x, weight, eps, residual)
    return rmsnorm_torch(x, weight, eps, residual)



def rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """q [T, Hq, D], k [T, Hkv, D] (views allowed), cos/sin [T, 1, D/2] -> contiguous rotated q, k."""
    if wants_fused(q.device.type, q.dtype) and cos.dtype == q.dtype:
        from sgl_kvxfer.kernels import fused_rope as k_mod

        return k_mod.fused_rope(q, k, cos, sin)
    if cos.dtype == q.dtype and wants_cpu_native(q):
        from sgl_kvxfer.kernels import cpu_ops

        return cpu_ops.rope_qk(q, k, cos, sin)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] = [gate | up] -> silu(gate) * up [T, I]."""
    if wants_fused(x.device.type, x.dtype):
        from sgl_kvxfer.kernels import fused_silu_mul as k

        return k.fused_silu_mul(x)
    if wants_cpu_native(x):
        from sgl_kvxfer.kernels import cpu_ops

        return cpu_ops.silu_mul(x)
    return silu_mul_torch(x)

