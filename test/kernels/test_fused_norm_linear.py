"""Fused RMSNorm + linear (+ SwiGLU) vs the unfused path it replaces.

The normalized activation and the new residual are the same bits as the unfused kernels', so
what may differ is the GEMM's fp32 accumulation order: outputs must agree with the reference
computed from the same normalized activation in fp32 within a few dtype ulps. A wrong row,
column, K block or missed norm weight is off by whole units.
CPU (interpreter): fp16 only (the interpreter truncates fp32 -> bf16; see
test_fused_elementwise.py); bf16 and real shapes run in the `gpu` tests.
"""
import pytest
import torch
import torch.nn.functional as F

from sgl_kvxfer.kernels import fused_norm_linear as mod
from sgl_kvxfer.models.fused_ops import rmsnorm_torch, silu_mul_torch


def _inputs(M, K, N, dtype, device, residual, bias, seed=0):
    g = torch.Generator().manual_seed(seed + M * 31 + K)
    x = (torch.randn(M, K, generator=g) * 2).to(dtype).to(device)
    r = (torch.randn(M, K, generator=g) * 2).to(dtype).to(device) if residual else None
    nw = (1 + 0.2 * torch.randn(K, generator=g)).to(dtype).to(device)
    w = (torch.randn(N, K, generator=g) / K**0.5).to(dtype).to(device)
    b = (0.1 * torch.randn(N, generator=g)).to(dtype).to(device) if bias else None
    return x, r, nw, w, b


def _expected(x, r, nw, w, b, swiglu, eps=1e-5):
    """The unfused path with an fp32 GEMM: (out, new_residual); rounded as the linear rounds."""
    normed = rmsnorm_torch(x, nw, eps, r)
    h, new_res = normed if r is not None else (normed, None)
    lin = F.linear(h.float(), w.float(), None if b is None else b.float()).to(x.dtype)
    out = silu_mul_torch(lin.float()).to(x.dtype) if swiglu else lin
    if swiglu:  # as fused_silu_mul rounds: silu rounded to dtype, then the product
        gate, up = lin.chunk(2, dim=-1)
        act = F.silu(gate.float()).to(x.dtype)
        out = (act.float() * up.float()).to(x.dtype)
    return out, new_res


def _check(M, K, N, dtype, device, residual=True, bias=False, swiglu=False, config=None):
    x, r, nw, w, b = _inputs(M, K, N, dtype, device, residual, bias)
    got = mod.fused_norm_linear(x, nw, 1e-5, w, b, r, swiglu=swiglu, config=config)
    ref_out, ref_res = _expected(x.cpu(), None if r is None else r.cpu(), nw.cpu(), w.cpu(),
                                 None if b is None else b.cpu(), swiglu)
    if residual:
        got, got_res = got
        assert torch.equal(got_res.cpu(), ref_res)  # (x + residual) rounded: bitwise
    assert got.shape == ref_out.shape and got.dtype == dtype and got.is_contiguous()
    eps = torch.finfo(dtype).eps
    # a few ulps of the output plus the accumulation-order error of the K-long fp32 sum
    torch.testing.assert_close(got.cpu().float(), ref_out.float(), atol=2e-3, rtol=4 * eps)


@pytest.mark.parametrize("M", [1, 5, 16, 33])
@pytest.mark.parametrize("residual", [False, True])
def test_norm_linear_matches_unfused(device, M, residual):
    _check(M, 96, 80, torch.float16, device, residual=residual)


@pytest.mark.parametrize("M", [3, 40])
def test_norm_linear_swiglu_and_bias(device, M):
    _check(M, 64, 2 * 72, torch.float16, device, residual=True, swiglu=True)
    _check(M, 64, 48, torch.float16, device, residual=True, bias=True)
    _check(M, 64, 2 * 40, torch.float16, device, residual=False, bias=True, swiglu=True)


def test_norm_linear_k_and_n_tails(device):
    """K and N not multiples of the blocks: the masked lanes must add nothing."""
    cfg = mod.NormLinearConfig(block_m=16, block_n=32, block_k=32, num_warps=4, num_stages=1)
    _check(7, 72, 50, torch.float16, device, residual=True, config=cfg)
    _check(7, 72, 2 * 50, torch.float16, device, residual=True, swiglu=True, config=cfg)


def test_norm_linear_several_n_tiles_write_one_residual(device):
    """Only N tile 0 writes x + residual; with 4 N tiles the result is still that sum, once."""
    cfg = mod.NormLinearConfig(block_m=16, block_n=16, block_k=32, num_warps=4, num_stages=1)
    _check(20, 64, 64, torch.float16, device, residual=True, config=cfg)


def test_reference_is_the_unfused_model_path(device):
    x, r, nw, w, b = _inputs(4, 32, 2 * 24, torch.float32, "cpu", True, True)
    out, new_res = mod.fused_norm_linear_reference(x, nw, 1e-5, w, b, r, swiglu=True)
    h, res = rmsnorm_torch(x, nw, 1e-5, r)
    assert torch.equal(new_res, res)
    assert torch.equal(out, silu_mul_torch(F.linear(h, w, b)))


def test_rejects_wrong_shapes(device):
    x, r, nw, w, b = _inputs(4, 32, 48, torch.float16, device, True, False)
    with pytest.raises(AssertionError):
        mod.fused_norm_linear(x, nw, 1e-5, w[:, :16], None, r)  # K mismatch
    with pytest.raises(AssertionError):
        mod.fused_norm_linear(x, nw, 1e-5, w[:47], None, r, swiglu=True)  # odd rows for swiglu


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M", [1, 8, 64, 200, 256])
@pytest.mark.parametrize("shape", ["smollm2", "llama8b"])
def test_norm_linear_real_shapes(device, dtype, M, shape):
    K, q_kv, inter = (576, 960, 1536) if shape == "smollm2" else (4096, 6144, 14336)
    _check(M, K, q_kv, dtype, device, residual=True)
    _check(M, K, 2 * inter, dtype, device, residual=True, swiglu=True)
    _check(M, K, q_kv, dtype, device, residual=False)
