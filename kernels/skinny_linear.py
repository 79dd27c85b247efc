"""Linear layer for decode-sized batches: y = x @ W^T (+ bias) with few rows, read at the weight's
byte rate.

    skinny_linear(x, weight, bias=None, config=None) -> y

x      [M, K] fp16 / bf16, 1 <= M <= MAX_ROWS, rows may be strided, last dim contiguous
weight [N, K] same dtype, row-major (nn.Linear's layout), contiguous
bias   [N] or None
y      [M, N] contiguous, x's dtype (new, or `out`)
grid = (cdiv(N, BLOCK_N),): one program streams BLOCK_N whole rows of W (all of K) and keeps
every x row; no split over K, so there is no second launch and no atomics.

Why it exists: at M = 8 a decode step's small projections are bound by reading W, and cuBLAS
reads the two smallest Llama-3-8B ones (qkv 6144 x 4096, o_proj 4096 x 4096) at 61-67% of a
device copy's rate on an H200. This kernel is the test of whether another GEMM closes that: W is
the dot's A operand ([BLOCK_N, BLOCK_K] tiles, K contiguous as stored), x^T the B operand (rows
padded to BLOCK_M = 16, the smallest tensor-core tile), both loads prefetched `num_stages` ahead.
Measured (kernels/README.md, section 5, "What a GEMM for few rows changes"): at the best of 32
launches it reads qkv in 16.0-16.7 us against cuBLAS's 18.0-18.7 at M = 8 and 16 and o_proj in
12.5-12.8 against 13.1-13.6, no faster for gate_up and down, and slower at M = 1: the small
projections' shortfall is a fixed cost per kernel, not cuBLAS's kernel choice. So the model
keeps F.linear; `benchmarks/kernels/dense_linear.py --variants skinny` times this kernel beside it.

pdl (SkinnyConfig): launched as a programmatic dependent (Triton's launch_pdl), the program lets
the next kernel launch at once, reads its first W tile, then waits for the previous kernel
(gdc_wait) before it reads x or writes y. W must not be written by an earlier kernel of the
stream that has not finished (weights are written at load time only). Measured: within 0.6 us
of the plain launch at every shape.

Invariants and hazards:
- Rows past M and past N are clamped to the last valid row for the loads (no mask, so the
  loads stay cp.async prefetches); the store is masked, so they are never written.
- K need not divide BLOCK_K: the last step masks along K (EVEN_K=False).
- fp32 accumulation over K in BLOCK_K steps, one rounding to the output dtype: equal to F.linear
  up to fp32 summation order (at most one output-dtype rounding apart; tested).
- Under the CPU interpreter bf16 dots are wrong, so operands go to the dot as fp32 there.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._tiles import is_interpret

MAX_ROWS = 16  # one BLOCK_M tile; more rows are F.linear's (the prefill path)


@dataclass(frozen=True)
class SkinnyConfig:
    block_n: int = 64
    block_k: int = 256
    num_stages: int = 4
    num_warps: int = 4
    pdl: bool = False  # programmatic dependent launch: see the module doc

    def as_launch(self) -> dict:
        return dict(BLOCK_N=self.block_n, BLOCK_K=self.block_k, num_stages=self.num_stages,
                    num_warps=self.num_warps)


@triton.jit
def _tiles_at(w_ptrs, x_ptrs, k0, offs_k, K, EVEN_K: tl.constexpr):
    """The W tile [BLOCK_N, BLOCK_K] and the x^T tile [BLOCK_K, BLOCK_M] of the K step at k0."""
    if EVEN_K:
        return tl.load(w_ptrs), tl.load(x_ptrs)
    k_ok = k0 + offs_k < K
    return tl.load(w_ptrs, mask=k_ok[None, :], other=0.0), tl.load(x_ptrs, mask=k_ok[:, None], other=0.0)


@triton.jit
def _skinny_linear_kernel(x_ptr, w_ptr, bias_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                          HAS_BIAS: tl.constexpr, DOT_F32: tl.constexpr, EVEN_K: tl.constexpr,
                          PDL: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    rows_w = tl.minimum(offs_n, N - 1).to(tl.int64)  # clamped: loads unmasked along N
    rows_x = tl.minimum(offs_m, M - 1)
    w_ptrs = w_ptr + rows_w[:, None] * stride_wn + offs_k[None, :]
    x_ptrs = x_ptr + rows_x[None, :] * stride_xm + offs_k[:, None]  # x^T tile [BLOCK_K, BLOCK_M]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    k_start = 0
    if PDL:
        # Launched as a programmatic dependent: this grid may start while the previous kernel
        # still runs. Let the next kernel launch as early, read the first W tile (weights: no
        # kernel of the stream writes them), and only then wait for the previous kernel's
        # writes (x, and y's memory) before touching x or y.
        tl.extra.cuda.gdc_launch_dependents()
        if EVEN_K:
            w = tl.load(w_ptrs)
        else:
            w = tl.load(w_ptrs, mask=offs_k[None, :] < K, other=0.0)
        tl.extra.cuda.gdc_wait()
        if EVEN_K:
            xt = tl.load(x_ptrs)
        else:
            xt = tl.load(x_ptrs, mask=offs_k[:, None] < K, other=0.0)
        acc += tl.dot(w, xt)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        k_start = BLOCK_K
    for k0 in range(k_start, K, BLOCK_K):
        w, xt = _tiles_at(w_ptrs, x_ptrs, k0, offs_k, K, EVEN_K)
        if DOT_F32:
            acc += tl.dot(w.to(tl.float32), xt.to(tl.float32))
        else:
            acc += tl.dot(w, xt)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[:, None]
    y_ptrs = y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=(offs_n[:, None] < N) & (offs_m[None, :] < M))


def default_config(n: int, k: int) -> SkinnyConfig:
    """The launch for an [n, k] weight: 64 rows of W a program, 256-wide K steps, 4 stages, 4
    warps. In the 32-launch sweep on an H200 at M = 8 (benchmarks/results/
    dense_linear_skinny_sweep_llama-3-8b_NVIDIA_H200.json) the fastest at qkv and o_proj, within
    1 us at gate_up and down and 4 us at lm_head; in the second call 1.8 us off at qkv."""
    return SkinnyConfig()


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  config: SkinnyConfig | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] -> x @ weight.T + bias, [M, N]; 1 <= M <= MAX_ROWS. CUDA-graph capturable.
    out: a contiguous [M, N] tensor of x's dtype to write instead of a new one."""
    assert x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1], (x.shape, weight.shape)
    assert x.dtype == weight.dtype and x.dtype in (torch.float16, torch.bfloat16), (x.dtype, weight.dtype)
    assert 1 <= x.shape[0] <= MAX_ROWS, f"{x.shape[0]} rows: skinny_linear takes 1..{MAX_ROWS}"
    assert x.stride(1) == 1 and weight.is_contiguous()
    M, K = x.shape
    N = weight.shape[0]
    cfg = config or default_config(N, K)
    block_k = min(cfg.block_k, triton.next_power_of_2(K))
    if out is None:
        y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    else:
        assert out.shape == (M, N) and out.dtype == x.dtype and out.is_contiguous(), (out.shape, out.dtype)
        y = out
    pdl = cfg.pdl and x.is_cuda and not is_interpret()
    launch = cfg.as_launch()
    launch["BLOCK_K"] = max(16, block_k)
    _skinny_linear_kernel[(triton.cdiv(N, cfg.block_n),)](
        x, weight, bias if bias is not None else weight, y, M, N, K, x.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, DOT_F32=is_interpret(), EVEN_K=K % launch["BLOCK_K"] == 0,
        PDL=pdl, BLOCK_M=MAX_ROWS, **launch, **({"launch_pdl": True} if pdl else {}),
    )
    return y


def skinny_linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 math, one rounding to x's dtype: what the kernel computes up to summation order."""
    y = x.float() @ weight.float().t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
