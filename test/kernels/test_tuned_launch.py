"""TunedLauncher: the first launch per key goes through the autotuner, later ones reuse its
pick through the jitted function; both give the same result."""
import pytest
import torch
import triton

from sgl_kvxfer.kernels import extend_attention as ea
from sgl_kvxfer.kernels.testing import build_random_cache
from sgl_kvxfer.kernels.tuned_launch import TunedLauncher

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(D):
    layer, tables, _ = build_random_cache([(17, 5, 20), (0, 0, 0)], 2, D, 16, 16, torch.float16, DEVICE, seed=3)
    g = torch.Generator().manual_seed(4)
    q = torch.randn(12, 4, D, generator=g).half().to(DEVICE)
    k = torch.randn(12, 2, D, generator=g).half().to(DEVICE)
    v = torch.randn(12, 2, D, generator=g).half().to(DEVICE)
    ind = torch.tensor([0, 5, 12], dtype=torch.int32, device=DEVICE)
    return q, k, v, ind, layer, tables


def test_second_launch_bypasses_the_autotuner_with_the_same_result(monkeypatch):
    launcher = TunedLauncher(ea._extend_fp16_kernel)
    monkeypatch.setattr(ea, "_launch_fp16", launcher)
    args = _inputs(32)
    first = ea.extend_attention_tiered(*args)
    assert len(launcher.configs) == 1
    (options,) = launcher.configs.values()
    assert options in [c.all_kwargs() for c in ea._extend_fp16_kernel.configs]
    calls = []
    plain_run = ea._extend_fp16_kernel.run
    monkeypatch.setattr(ea._extend_fp16_kernel, "run", lambda *a, **k: calls.append(1) or plain_run(*a, **k))
    second = ea.extend_attention_tiered(*args)
    assert not calls, "the second launch with the same key must not go through Autotuner.run"
    torch.testing.assert_close(first, second, atol=0, rtol=0)
    torch.testing.assert_close(second.float(), ea.extend_attention_tiered_reference(*args).float(), atol=4e-3, rtol=0)
    ea.extend_attention_tiered(*_inputs(16))  # another head_dim: a new key, through the autotuner
    assert len(launcher.configs) == 2 and len(calls) == 1


def test_rejects_an_autotuner_with_hooks():
    @triton.autotune(configs=[triton.Config({}, num_warps=1)], key=[], reset_to_zero=["x_ptr"])
    @triton.jit
    def _zeroed(x_ptr):
        pass

    with pytest.raises(ValueError, match="hooks"):
        TunedLauncher(_zeroed)


def test_prefix_bucket_steps():
    assert [ea.prefix_bucket(n) for n in (None, 0, 1, 1024, 1025, 5000, 16384, 30000, 100000)] == \
        [0, 0, 1024, 1024, 2048, 8192, 16384, 32768, 32768]


def test_a_new_prefix_bucket_is_tuned_apart_with_the_same_result(monkeypatch):
    """max_prefix_len picks the tuning bucket: a launch in a new bucket goes through the autotuner
    (a key of its own there too), one in a known bucket does not; results never depend on it."""
    launcher = TunedLauncher(ea._extend_fp16_kernel)
    monkeypatch.setattr(ea, "_launch_fp16", launcher)
    args = _inputs(32)
    plain = ea.extend_attention_tiered(*args)
    calls = []
    plain_run = ea._extend_fp16_kernel.run
    monkeypatch.setattr(ea._extend_fp16_kernel, "run", lambda *a, **k: calls.append(1) or plain_run(*a, **k))
    hinted = ea.extend_attention_tiered(*args, max_prefix_len=20)
    assert len(calls) == 1 and len(launcher.configs) == 2
    again = ea.extend_attention_tiered(*args, max_prefix_len=900)  # the same bucket (1024)
    assert len(calls) == 1
    torch.testing.assert_close(plain, hinted, atol=0, rtol=0)
    torch.testing.assert_close(hinted, again, atol=0, rtol=0)
