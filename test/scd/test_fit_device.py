"""The joint Reuse fit gives the same encoder / decoders wherever it runs: eigenvector signs
are canonical (LAPACK and cuSOLVER may return either sign), and the GPU path equals the CPU one."""
import pytest
import torch

from sgl_kvxfer.scd.calib import fit as fit_mod
from sgl_kvxfer.scd.calib.fit import JointMoments, fit_joint


def _moments(groups=2, width=12, blocks=3, n=600, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(groups, n, width, generator=g, dtype=torch.float64) @ torch.randn(width, width, generator=g,
                                                                                        dtype=torch.float64)
    x = torch.cat([a @ torch.randn(width, width, generator=g, dtype=torch.float64) * 0.3 + a
                   + 0.05 * torch.randn(groups, n, width, generator=g, dtype=torch.float64)
                   for _ in range(blocks)], -1)
    jm = JointMoments(groups, width, blocks, device)
    jm.update(x[:, : n // 2].to(device))
    jm.update(x[:, n // 2:].to(device))
    return jm


def _assert_same(f1, f2, atol=1e-5):
    assert torch.allclose(f1.enc.cpu(), f2.enc.cpu(), atol=atol, rtol=1e-4)
    for key in ("dec", "mu_b", "rel_err"):
        for x, y in zip(getattr(f1, key), getattr(f2, key)):
            assert torch.allclose(x.cpu(), y.cpu(), atol=atol, rtol=1e-4), key
    assert sorted(f1.dec_at) == sorted(f2.dec_at)
    for r in f1.dec_at:
        for x, y in zip(f1.dec_at[r], f2.dec_at[r]):
            assert torch.allclose(x.cpu(), y.cpu(), atol=atol, rtol=1e-4)


def test_fit_is_independent_of_eigenvector_signs(monkeypatch):
    """An eigensolver returning the opposite sign for some directions gives the same fit."""
    jm = _moments()
    ref = fit_joint(jm, 8, 1e-4, levels=(2, 5))
    eigh = torch.linalg.eigh

    def flipped(cov):
        evals, evecs = eigh(cov)
        signs = torch.tensor([(-1.0) ** i for i in range(evecs.shape[-1])], dtype=evecs.dtype)
        return evals, evecs * signs

    monkeypatch.setattr(fit_mod.torch.linalg, "eigh", flipped)
    _assert_same(fit_joint(jm, 8, 1e-4, levels=(2, 5)), ref, atol=1e-9)


def test_device_argument_moves_the_solve():
    jm = _moments()
    f = fit_joint(jm, 6, 1e-4, device="cpu")
    assert f.enc.device.type == "cpu" and f.enc.dtype == torch.float32 and f.enc.shape == (2, 12, 6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_fit_equals_cpu_fit():
    cpu = _moments(width=64, blocks=4, n=4000)
    gpu = JointMoments.from_state({k: v.cuda() for k, v in cpu.state("m").items()}, "m")
    ref = fit_joint(cpu, 24, 1e-4, levels=(4, 12))
    out = fit_joint(gpu, 24, 1e-4, levels=(4, 12))
    assert out.enc.device.type == "cuda"
    _assert_same(out, ref, atol=1e-4)
    # the moments on the CPU, the solve on the GPU
    _assert_same(fit_joint(cpu, 24, 1e-4, levels=(4, 12), device="cuda"), ref, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_unit_codes_fit_equals_cpu_fit():
    """Unit codes (each column divided by its code's std) come out the same from cuSOLVER as
    from LAPACK, encoders, decoders and nested levels."""
    cpu = _moments(width=64, blocks=4, n=4000)
    ref = fit_joint(cpu, 24, 1e-4, levels=(4, 12), unit_codes=True)
    out = fit_joint(cpu, 24, 1e-4, levels=(4, 12), device="cuda", unit_codes=True)
    assert out.enc.device.type == "cuda"
    _assert_same(out, ref, atol=1e-4)
