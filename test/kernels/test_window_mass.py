"""window_mass (importance capture's per-layer kernel) vs its torch reference and vs the
accumulator's torch path: GQA groups, window rows not a multiple of the block, queries that start
inside the keys, soft-capping, sliding windows, accumulation across calls, bf16 inputs."""
import pytest
import torch

from sgl_kvxfer.kernels.window_mass import window_mass, window_mass_reference
from sgl_kvxfer.spectrum.importance import ImportanceAccumulator

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _qk(w, t, hq, hkv, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(w, hq, d, generator=g) * 1.5).to(dtype).to(DEVICE)
    k = (torch.randn(t, hkv, d, generator=g) * 1.5).to(dtype).to(DEVICE)
    return q, k


@pytest.mark.parametrize("w,t,hq,hkv,d,pos0,softcap,sliding", [
    (5, 70, 4, 2, 16, 65, None, None),     # the window at the keys' end; 5 * 2 rows: one partial block
    (9, 130, 9, 3, 32, 100, None, None),   # SmolLM2's group of 3; queries before the last key
    (3, 40, 4, 1, 16, 0, None, None),      # queries at the start: few visible keys
    (4, 64, 4, 2, 16, 60, 5.0, None),      # soft-capped logits
    (6, 90, 4, 2, 16, 84, None, 20),       # sliding window
])
def test_matches_reference(w, t, hq, hkv, d, pos0, softcap, sliding):
    q, k = _qk(w, t, hq, hkv, d, torch.float32, seed=w + t)
    got = window_mass(q, k, pos0, d ** -0.5, torch.zeros(t + 3, device=DEVICE), softcap, sliding)
    want = window_mass_reference(q, k, pos0, d ** -0.5, torch.zeros(t + 3, device=DEVICE), softcap, sliding)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert got[t:].abs().max() == 0  # past the keys: untouched
    assert got.sum().item() == pytest.approx(w * hq, rel=1e-4)  # every row's probabilities sum to 1


@pytest.mark.parametrize("splits", [2, 3, 50])
def test_key_splits_match_reference(splits):
    """Keys split across programs (the stats pass, then the combine): the same sums; a split count
    past the key blocks leaves no split empty."""
    w, t, hq, hkv, d, pos0 = 6, 300, 4, 2, 16, 280
    q, k = _qk(w, t, hq, hkv, d, torch.float32, seed=9)
    got = window_mass(q, k, pos0, d ** -0.5, torch.zeros(t, device=DEVICE), splits=splits, block_n=16)
    want = window_mass_reference(q, k, pos0, d ** -0.5, torch.zeros(t, device=DEVICE))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert got.sum().item() == pytest.approx(w * hq, rel=1e-4)


def test_key_split_count():
    from sgl_kvxfer.kernels.window_mass import key_splits

    assert key_splits(32768, 64, 64) == 8  # Llama-3-8B heads, a 32-query window: 512 programs
    assert key_splits(300, 64, 64) == 1  # a short prompt: one launch
    assert key_splits(100000, 1, 64) == 196


def test_accumulates_and_takes_bf16():
    q, k = _qk(7, 96, 8, 2, 32, torch.bfloat16, seed=3)
    mass = torch.full((96,), 0.5, device=DEVICE)
    window_mass(q, k, 89, 0.2, mass)
    window_mass(q, k, 89, 0.2, mass)
    want = window_mass_reference(q, k, 89, 0.2, torch.zeros(96, device=DEVICE))
    torch.testing.assert_close(mass, 0.5 + 2 * want, rtol=1e-3, atol=1e-4)


def test_accumulator_kernel_path_matches_its_torch_path(monkeypatch):
    """add_range through window_mass (forced here; on a GPU it is the default) gives the scores of
    the torch path: the chunk's window rows only, several layers, queries cut at the window start."""
    q1, k1 = _qk(24, 24, 4, 2, 16, torch.float32, seed=1)
    q2, k2 = _qk(16, 40, 4, 2, 16, torch.float32, seed=2)
    scores = {}
    for kernel in (False, True):
        monkeypatch.setattr(ImportanceAccumulator, "window_kernel", staticmethod(lambda q, k, _on=kernel: _on))
        acc = ImportanceAccumulator(40, window=20, device=DEVICE, fused_heads=True)
        acc.add_range(q1, k1, 0)     # positions [0, 24): the window's first 4 rows only
        acc.add_range(q2, k2, 24)    # positions [24, 40): all window rows
        scores[kernel] = acc.scores()
        assert acc.num_rows == 20 * 4
    torch.testing.assert_close(scores[True], scores[False], rtol=1e-4, atol=1e-6)


def test_accumulator_takes_the_kernel_only_where_it_applies(monkeypatch):
    monkeypatch.setattr("torch.Tensor.is_cuda", property(lambda self: True))
    pick = ImportanceAccumulator.window_kernel
    assert pick(torch.zeros(2, 4, 64), torch.zeros(8, 2, 64))
    assert not pick(torch.zeros(2, 4, 80), torch.zeros(8, 2, 80))  # head dim 80: not a power of two
    assert not pick(torch.zeros(2, 4, 8), torch.zeros(8, 2, 8))
    assert not pick(torch.zeros(2, 4, 64), torch.zeros(8, 2, 128)[..., ::2])  # strided rows
    monkeypatch.setenv("SGL_KVXFER_WINDOW_MASS", "0")
    assert not pick(torch.zeros(2, 4, 64), torch.zeros(8, 2, 64))
