"""RMSNorm (+ residual add) fused into the linear that consumes it, with an optional SwiGLU
epilogue: one launch where the decode layer ran three (norm, GEMM, SiLU-mul).

    fused_norm_linear(x, norm_weight, eps, weight, bias=None, residual=None, swiglu=False)
        -> out | (out, new_residual)

x, residual  [M, K] model dtype (fp16/bf16), last dim contiguous
norm_weight  [K]
weight       [N, K] (nn.Linear layout, last dim contiguous); bias [N] or None
out          [M, N], or with swiglu [M, N/2]: weight rows are [gate | up] (gate_up_proj) and
             out = silu(x_n @ W_gate^T) * (x_n @ W_up^T)
grid = (cdiv(M, BLOCK_M), cdiv(N_out, BLOCK_N)); every program first reduces its rows' sums of
squares over all of K (pass 1), then runs the GEMM over K again (pass 2). Recomputing the norm
per N tile costs K reads of x per tile, small next to the weight tile (meant for M <= 256).

Rounding: the normalized activation is bit-for-bit `kernels/fused_rmsnorm.py`'s output (same
formula, fp32 statistics; the sum order may differ in the last fp32 bits), so only the GEMM's
fp32 accumulation order differs from the unfused path. Products then round as the unfused ops
do: acc -> dtype (the linear's output), then SiLU-mul as `kernels/fused_silu_mul.py`.
new_residual = (x + residual) rounded to dtype, written once (by the programs of N tile 0).

Hazard: this kernel reads each x row once per N tile; if `out` aliased x the later tiles would
read outputs. Outputs are always new tensors here.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@triton.jit
def _rounded_sum(x_ptr, res_ptr, rm, rk, mask, stride_x, stride_r, HAS_RESIDUAL: tl.constexpr):
    """x[rm, rk] (+ residual, rounded to the model dtype as torch's add is)."""
    s = tl.load(x_ptr + rm[:, None] * stride_x + rk[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + rm[:, None] * stride_r + rk[None, :], mask=mask, other=0.0)
        s = (s.to(tl.float32) + r.to(tl.float32)).to(s.dtype)
    return s


@triton.jit
def _norm_linear_kernel(
    x_ptr, res_ptr, nw_ptr, w_ptr, b_ptr, out_ptr, new_res_ptr,
    M, N_OUT, K, eps,
    stride_x, stride_r, stride_w, stride_o, stride_nr,
    HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rmask = rm < M
    # pass 1: fp32 sum of squares of each (rounded) row; N tile 0 also writes x + residual
    sumsq = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        mask = rmask[:, None] & (rk < K)[None, :]
        s = _rounded_sum(x_ptr, res_ptr, rm, rk, mask, stride_x, stride_r, HAS_RESIDUAL)
        if HAS_RESIDUAL:
            if pid_n == 0:
                tl.store(new_res_ptr + rm[:, None] * stride_nr + rk[None, :], s, mask=mask)
        sf = s.to(tl.float32)  # masked lanes are 0: they add nothing
        sumsq += tl.sum(sf * sf, axis=1)
    rstd = tl.math.rsqrt(sumsq / K + eps)
    # pass 2: normalized rows (as fused_rmsnorm rounds them) times the weight tile(s)
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    nmask = rn < N_OUT
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        kmask = rk < K
        s = _rounded_sum(x_ptr, res_ptr, rm, rk, rmask[:, None] & kmask[None, :], stride_x, stride_r,
                         HAS_RESIDUAL)
        dt = s.dtype
        y = (s.to(tl.float32) * rstd[:, None]).to(dt)
        nw = tl.load(nw_ptr + rk, mask=kmask, other=0.0)
        a = (nw.to(tl.float32)[None, :] * y.to(tl.float32)).to(dt)
        wmask = kmask[:, None] & nmask[None, :]
        w_tile = tl.load(w_ptr + rn[None, :] * stride_w + rk[:, None], mask=wmask, other=0.0)  # [BK, BN]
        acc = tl.dot(a, w_tile, acc)
        if SWIGLU:
            u_tile = tl.load(w_ptr + (rn + N_OUT)[None, :] * stride_w + rk[:, None], mask=wmask, other=0.0)
            acc_up = tl.dot(a, u_tile, acc_up)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
        if SWIGLU:
            acc_up += tl.load(b_ptr + N_OUT + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
    odt = out_ptr.dtype.element_ty
    if SWIGLU:
        g = acc.to(odt).to(tl.float32)  # the gate as the linear would have returned it
        act = (g / (1.0 + tl.exp(-g))).to(odt)
        out = (act.to(tl.float32) * acc_up.to(odt).to(tl.float32)).to(odt)
    else:
        out = acc.to(odt)
    tl.store(out_ptr + rm[:, None] * stride_o + rn[None, :], out, mask=rmask[:, None] & nmask[None, :])


@dataclass(frozen=True)
class NormLinearConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def default_config(M: int, N_out: int, K: int, swiglu: bool) -> NormLinearConfig:
    """Launch shape by batch rows. tl.dot needs BLOCK_M >= 16; rows past M are masked.
    Chosen on an H200 (benchmarks/kernels/norm_linear.py sweeps the alternatives)."""
    block_m = 16 if M <= 16 else 32 if M <= 32 else 64
    return NormLinearConfig(block_m, 64, 64, 4, 3 if K >= 1024 else 2)


def fused_norm_linear(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                      bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                      swiglu: bool = False, config: NormLinearConfig | None = None):
    """See the module doc. No host sync, shapes from the inputs only: CUDA-graph capturable."""
    assert x.dim() == 2 and x.dtype in (torch.float16, torch.bfloat16), (x.shape, x.dtype)
    M, K = x.shape
    N = weight.shape[0]
    assert weight.shape == (N, K) and weight.dtype == x.dtype and weight.stride(1) == 1
    assert norm_weight.shape == (K,) and norm_weight.dtype == x.dtype and norm_weight.stride(0) == 1
    assert x.stride(1) == 1, "last dim must be contiguous"
    assert not swiglu or N % 2 == 0, "swiglu needs [gate | up] rows"
    if bias is not None:
        assert bias.shape == (N,) and bias.dtype == x.dtype and bias.stride(0) == 1
    n_out = N // 2 if swiglu else N
    out = torch.empty((M, n_out), dtype=x.dtype, device=x.device)
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(1) == 1
        new_res = torch.empty((M, K), dtype=x.dtype, device=x.device)
        res_arg, stride_r = residual, residual.stride(0)
    else:
        new_res, res_arg, stride_r = out, x, 0  # unused (HAS_RESIDUAL=False prunes them)
    if M > 0:
        cfg = config or default_config(M, n_out, K, swiglu)
        grid = (triton.cdiv(M, cfg.block_m), triton.cdiv(n_out, cfg.block_n))
        _norm_linear_kernel[grid](
            x, res_arg, norm_weight, weight, bias if bias is not None else weight, out, new_res,
            M, n_out, K, float(eps),
            x.stride(0), stride_r, weight.stride(0), out.stride(0), new_res.stride(0),
            HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None, SWIGLU=swiglu,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    return out if residual is None else (out, new_res)


def fused_norm_linear_reference(x, norm_weight, eps, weight, bias=None, residual=None, swiglu=False):
    """The unfused torch path the model runs without this kernel: RMSNorm, F.linear, SiLU-mul."""
    import torch.nn.functional as F

    from sgl_kvxfer.models.fused_ops import rmsnorm_torch, silu_mul_torch

    normed = rmsnorm_torch(x, norm_weight, eps, residual)
    h, new_res = normed if residual is not None else (normed, None)
    out = F.linear(h, weight, bias)
    if swiglu:
        out = silu_mul_torch(out)
    return out if residual is None else (out, new_res)
