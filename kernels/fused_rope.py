"""Fused rotary embedding of q and k: one launch instead of ~12 elementwise kernels.

    fused_rope(q, k, cos, sin) -> (q_rot, k_rot)

q    [T, Hq, D]  model dtype (fp16/bf16); any strides with stride(-1) == 1, e.g. a view of
k    [T, Hkv, D] the fused qkv projection output (row stride q_size + 2 * kv_size)
cos, sin [T, 1, D/2] model dtype (RotaryEmbedding.cos_sin), last dim contiguous
q_rot, k_rot: NEW contiguous [T, H, D] tensors (what the attention backends expect).

grid = (T, Hq + Hkv): program (t, h) rotates q head h (h < Hq) or k head h - Hq.
Neox / HF rotate_half layout, x = [x1 | x2] (halves of D):
    out = [x1*cos - x2*sin | x2*cos + x1*sin]
Rounding replicates `sgl_kvxfer.layers.rope.apply_rope` (torch, same-dtype ops): every product
is rounded to the model dtype, then the add/sub of the two rounded products is rounded. fp16 and
bf16 products are exact in fp32 and each op is a single fp32 op + one rounding, so the result is
bitwise equal to torch (no FMA can form: a rounding sits between the mul and the add).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _fused_rope_kernel(
    q_ptr, k_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_ct, stride_st,
    HQ, HKV,
    HALF: tl.constexpr, BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    mask = offs < HALF
    c = tl.load(cos_ptr + t * stride_ct + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + t * stride_st + offs, mask=mask, other=0.0).to(tl.float32)
    if h < HQ:
        src = q_ptr + t * stride_qt + h * stride_qh
        dst = qo_ptr + (t * HQ + h) * (2 * HALF)  # contiguous [T, Hq, D]
    else:
        src = k_ptr + t * stride_kt + (h - HQ) * stride_kh
        dst = ko_ptr + (t * HKV + (h - HQ)) * (2 * HALF)
    x1 = tl.load(src + offs, mask=mask, other=0.0)
    x2 = tl.load(src + HALF + offs, mask=mask, other=0.0)
    dt = x1.dtype
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    # each product rounded to the model dtype, then the add/sub rounded (torch op order)
    x1c = (x1 * c).to(dt).to(tl.float32)
    x2s = (x2 * s).to(dt).to(tl.float32)
    x2c = (x2 * c).to(dt).to(tl.float32)
    x1s = (x1 * s).to(dt).to(tl.float32)
    tl.store(dst + offs, (x1c - x2s).to(dt), mask=mask)
    tl.store(dst + HALF + offs, (x2c + x1s).to(dt), mask=mask)


def fused_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """q [T, Hq, D], k [T, Hkv, D], cos/sin [T, 1, D/2] -> (q_rot, k_rot) new contiguous.
    No host sync, shapes from the inputs only: CUDA-graph capturable."""
    assert q.dim() == 3 and k.dim() == 3 and q.dtype in (torch.float16, torch.bfloat16)
    T, HQ, D = q.shape
    HKV = k.shape[1]
    assert k.shape == (T, HKV, D) and k.dtype == q.dtype and D % 2 == 0
    assert q.stride(2) == 1 and k.stride(2) == 1, "head dim must be contiguous"
    half = D // 2
    for c in (cos, sin):
        assert c.shape == (T, 1, half) and c.dtype == q.dtype and c.stride(2) == 1, (c.shape, c.dtype)
    q_out = torch.empty((T, HQ, D), dtype=q.dtype, device=q.device)
    k_out = torch.empty((T, HKV, D), dtype=k.dtype, device=k.device)
    if T > 0:
        _fused_rope_kernel[(T, HQ + HKV)](
            q, k, cos, sin, q_out, k_out,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), sin.stride(0),
            HQ, HKV,
            HALF=half, BLOCK=triton.next_power_of_2(half), num_warps=1,
        )
    return q_out, k_out


def fused_rope_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Torch reference: `apply_rope` on q and on k."""
    from .reference import apply_rope

    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)
