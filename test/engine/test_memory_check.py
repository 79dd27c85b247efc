"""The start-up memory check (engine/memory.py): weights + KV pool + activations against what
the device has, checked before any weight loads."""
import json
import os
import subprocess
import sys

import pytest
import torch

from sgl_kvxfer.engine import memory
from sgl_kvxfer.models.arch_config import ModelArchConfig
from sgl_kvxfer.models.presets import PRESETS, write_preset_config

GIB = 2 ** 30
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _arch(name: str) -> ModelArchConfig:
    return ModelArchConfig.from_hf_dict(PRESETS[name])


@pytest.mark.parametrize("name", ["tiny", "smollm2-135m"])
def test_param_count_matches_the_built_model(name):
    from sgl_kvxfer.models.loader import create_model

    model = create_model(_arch(name), torch.float32, "meta")
    assert memory.param_count(_arch(name))[0] == sum(p.numel() for p in model.parameters())


def test_param_count_of_llama_3_8b():
    assert memory.param_count(_arch("llama-3-8b"))[0] == 8_030_261_248


def _cpu_machine(monkeypatch, total_gib: float, available_gib: float):
    monkeypatch.setattr(memory, "device_memory_bytes", lambda device: (int(total_gib * GIB), int(available_gib * GIB)))
    monkeypatch.setattr(memory, "host_available_bytes", lambda: int(available_gib * GIB))


def test_an_8b_model_is_refused_on_a_24_gib_cpu_machine(monkeypatch):
    _cpu_machine(monkeypatch, 24, 22)
    arch = _arch("llama-3-8b")
    with pytest.raises(memory.InsufficientMemoryError, match=r"not enough memory: the model needs about 3\d\.\d\d GiB"):
        memory.plan_memory("cpu", arch, 4, 131072.0, None, None, 16384, None)
    # bf16 weights fit, but not with the linears' prepared fp32 copies (an AVX2-only CPU)
    with pytest.raises(memory.InsufficientMemoryError, match="prepared copies"):
        memory.plan_memory("cpu", arch, 2, 131072.0, None, 4096, 2048, None, prepared_copy_bytes=4)


def test_a_pool_that_does_not_fit_is_refused_and_one_that_does_is_planned(monkeypatch):
    _cpu_machine(monkeypatch, 24, 4)
    arch = _arch("smollm2-135m")
    bpt = 2 * 30 * 3 * 64 * 4.0
    plan = memory.plan_memory("cpu", arch, 4, bpt, None, 16384, 2048, 64)
    assert plan.pool_tokens == 16384 and plan.needed < 4 * GIB
    assert plan.weights == memory.param_count(arch)[0] * 4
    with pytest.raises(memory.InsufficientMemoryError, match="KV pool .* for 100000 tokens.*--max-total-tokens"):
        memory.plan_memory("cpu", arch, 4, bpt, 0.9, 100_000, 2048, 64)


def test_the_server_refuses_a_model_the_machine_cannot_hold(tmp_path):
    """A config no machine holds (~40 TB of fp32 dummy weights): the server stops at start-up with
    the numbers, before allocating anything."""
    d = write_preset_config("llama-3-8b", str(tmp_path / "huge"))
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({**cfg, "num_hidden_layers": 32 * 40 * 40}, f)
    out = subprocess.run([sys.executable, "-m", "sgl_kvxfer.launch_server", "--model-path", d, "--load-format",
                          "dummy", "--device", "cpu", "--port", "1"], cwd=ROOT, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 1, out.stderr[-3000:]
    assert "not enough memory: the model needs about" in out.stderr and "GiB the host has available" in out.stderr
