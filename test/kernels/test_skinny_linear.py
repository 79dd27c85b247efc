"""kernels/skinny_linear.py against its torch reference (fp32 math, one rounding) and F.linear.

CPU runs the interpreter at small shapes (operands to the dot as fp32 there; the interpreter
rounds fp32 -> bf16 by truncation, so bf16 may be one bf16 step off the reference); `gpu` runs
the real kernel at Llama-3-8B's projection shapes.
"""
import pytest
import torch
import torch.nn.functional as F

from sgl_kvxfer.kernels.skinny_linear import (MAX_ROWS, SkinnyConfig, default_config, skinny_linear,
                                              skinny_linear_reference)


def _one_rounding(got: torch.Tensor, ref: torch.Tensor) -> None:
    """|got - ref| <= one step of the output dtype at |ref| (plus a hair for values near 0)."""
    eps = torch.finfo(got.dtype).eps
    tol = 2 * eps * ref.float().abs() + 1e-3
    bad = (got.float() - ref.float()).abs() > tol
    assert not bool(bad.any()), f"{int(bad.sum())} of {bad.numel()} outside one rounding"


def _inputs(m, n, k, dtype, device, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype).to(device)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype).to(device)
    b = torch.randn(n, generator=g).to(dtype).to(device) if bias else None
    return x, w, b


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m,n,k,bias", [(1, 48, 64, False), (8, 100, 200, True), (16, 64, 256, False),
                                        (3, 33, 96, True), (MAX_ROWS, 16, 16, False)])
def test_matches_reference(m, n, k, bias, dtype, device):
    x, w, b = _inputs(m, n, k, dtype, device, bias)
    got = skinny_linear(x, w, b, SkinnyConfig(block_n=16, block_k=64, num_stages=2))
    _one_rounding(got, skinny_linear_reference(x, w, b))
    _one_rounding(got, F.linear(x.float(), w.float(), None if b is None else b.float()).to(dtype))


def test_strided_rows_and_out(device):
    """x may be a row-strided view (the attention output's reshape is not, a column slice is);
    `out` is written in place and returned."""
    x_full, w, _ = _inputs(5, 40, 2 * 64, torch.float16, device, False)
    x = x_full[:, :64]
    w = w[:, :64].contiguous()
    out = torch.full((5, 40), float("nan"), dtype=torch.float16, device=device)
    got = skinny_linear(x, w, config=SkinnyConfig(block_n=16, block_k=32, num_stages=2), out=out)
    assert got.data_ptr() == out.data_ptr()
    _one_rounding(out, skinny_linear_reference(x, w))


def test_rows_past_m_and_n_are_never_written(device):
    """The clamped rows (past M, past N) load but must not store: the bytes around y stay put."""
    x, w, _ = _inputs(3, 20, 32, torch.float16, device, False)
    buf = torch.full((8, 32), 7.0, dtype=torch.float16, device=device)
    view = buf[2:5, :20]  # not contiguous: refused as out; write into a contiguous slice instead
    with pytest.raises(AssertionError):
        skinny_linear(x, w, out=view)
    flat = torch.full((3 * 20 + 16,), 7.0, dtype=torch.float16, device=device)
    out = flat[:60].view(3, 20)
    skinny_linear(x, w, config=SkinnyConfig(block_n=16, block_k=32, num_stages=2), out=out)
    assert bool((flat[60:] == 7.0).all())
    _one_rounding(out, skinny_linear_reference(x, w))


def test_bad_input_is_refused(device):
    x, w, _ = _inputs(MAX_ROWS + 1, 16, 32, torch.float16, device, False)
    with pytest.raises(AssertionError, match="rows"):
        skinny_linear(x, w)
    with pytest.raises(AssertionError):
        skinny_linear(x[:2].float(), w)  # dtype mismatch
    with pytest.raises(AssertionError):
        skinny_linear(x[:2], w[:, :16])  # K mismatch


def test_default_config_is_the_dataclass_default():
    assert default_config(4096, 4096) == SkinnyConfig() == SkinnyConfig(64, 256, 4, 4, False)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8, 16])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])
def test_llama3_8b_shapes_on_gpu(m, n, k):
    x, w, _ = _inputs(m, n, k, torch.bfloat16, "cuda", False, seed=m)
    got = skinny_linear(x, w)
    ref = skinny_linear_reference(x, w)
    _one_rounding(got, ref)
    torch.testing.assert_close(got.float(), F.linear(x, w).float(), atol=2e-2, rtol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("graph", [False, True])
def test_pdl_chain_reads_each_previous_output(graph):
    """Launched as programmatic dependents, each linear starts before the previous one ends and
    reads its first W tile early: x (the previous output) must still be read only after it is
    complete. A chain of 6, eager and as a CUDA graph replay, equals the same chain without PDL."""
    g = torch.Generator().manual_seed(3)
    ws = [(torch.randn(1024, 1024, generator=g) / 32).to(torch.bfloat16).cuda() for _ in range(6)]
    x = torch.randn(8, 1024, generator=g).to(torch.bfloat16).cuda()
    plain, pdl = SkinnyConfig(block_n=16, block_k=256), SkinnyConfig(block_n=16, block_k=256, pdl=True)

    def chain(cfg):
        y = x
        for w in ws:
            y = skinny_linear(y, w, config=cfg)
        return y

    want = chain(plain)
    if not graph:
        got = chain(pdl)
    else:
        chain(pdl)  # JIT outside the capture
        torch.cuda.synchronize()
        cg = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cg):
            got = chain(pdl)
        x.mul_(-1)  # new input: a replay that read stale x would not follow
        want = chain(plain)
        cg.replay()
        torch.cuda.synchronize()
    assert torch.equal(got, want)
