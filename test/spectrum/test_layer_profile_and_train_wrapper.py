"""The offline layer profile (spectrum_calib/layer_profile.py) and scripts/gpu/spectrum_train.py's
prefetch, on CPU with a tiny random model."""
import json
import os
import subprocess
import sys

import pytest
import torch

from sgl_kvxfer.spectrum_calib.layer_profile import profile_layers, roundtrip
from sgl_kvxfer.spectrum.formats import IntFormat
from sgl_kvxfer.spectrum.layer_budget import LayerProfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_roundtrip_formats_are_close_and_ordered():
    x = torch.randn(2, 70, 2, 64, generator=torch.Generator().manual_seed(0))
    errs = {}
    for fmt in (IntFormat(8), IntFormat(4), IntFormat(4, "channel"), IntFormat(2, "channel")):
        y = roundtrip(x, fmt, True, 64, 16)
        assert y.shape == x.shape
        errs[fmt.label()] = float((y - x).abs().mean())
    assert errs["int8"] < errs["int4c"] < errs["int2c"] and errs["int8"] < errs["int4"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    sys.path.insert(0, os.path.join(ROOT, "scripts", "train"))
    from make_tiny_model import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("tiny")), layers=2, hidden=64, heads=4, kv_heads=2)


def test_profile_restore_one_has_no_gain_when_nothing_is_quantized(tiny):
    from sgl_kvxfer.models.loader import load_model
    from sgl_kvxfer.scd.calib.forward import LlamaRunner

    model, _ = load_model(tiny, "auto", torch.float32, "cpu", 0)
    g = torch.Generator().manual_seed(1)
    samples = [(torch.randint(10, 4000, (60,), generator=g).tolist(),
                torch.randint(10, 4000, (8,), generator=g).tolist()) for _ in range(3)]
    prof = profile_layers(LlamaRunner(model), samples, 16, 16, num_sink=60, batch=2)  # every context token a sink
    assert prof.base_kl == pytest.approx(0, abs=1e-9)
    assert all(abs(x) < 1e-9 for x in prof.gain_up + prof.loss_down)
    prof = profile_layers(LlamaRunner(model), samples, 16, 16, num_sink=4, batch=2)
    assert prof.base_kl > 0 and all(d >= -1e-6 for d in prof.loss_down)  # int2c costs more than int4
    assert prof.meta["scored_tokens"] == 24


@pytest.mark.heavy  # over 10 s on 2 cores: CI leaves it out (README, Tests)
def test_profile_command_writes_a_profile(tiny, tmp_path):
    prose = tmp_path / "prose.jsonl"
    with open(prose, "w") as f:
        for name in ("README.md", "sgl_kvxfer/mem_cache/README.md"):
            with open(os.path.join(ROOT, name)) as doc:
                f.write(json.dumps({"text": doc.read()}) + "\n")
    out = tmp_path / "profile.json"
    cmd = [sys.executable, "-m", "sgl_kvxfer.spectrum_calib.layer_profile", "--out", str(out), "--model", tiny,
           "--prose", str(prose), "--context", "96", "--chunk", "16", "--windows", "2", "--device", "cpu",
           "--dtype", "float32", "--page-size", "16"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    prof = LayerProfile.load(str(out))
    assert prof.num_layers == 2 and prof.meta["samples"] == 2
    bad = subprocess.run(cmd[:-6] + ["--context", "0"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "must be >= 1" in bad.stderr


def test_train_wrapper_serves_the_items_finetune_would_make(tiny):
    sys.path.insert(0, os.path.join(ROOT, "scripts", "gpu"))
    sys.path.insert(0, os.path.join(ROOT, "scripts", "train"))
    import spectrum_train
    import task_data

    from sgl_kvxfer import tasks
    from sgl_kvxfer.models.loader import load_tokenizer

    params = task_data.parse_task_params(["kv.context_tokens=128", "kv.depth=0.5"])
    assert params == {"kv": {"context_tokens": 128, "depth": 0.5}}
    for bad in (["kv.nope=1"], ["kv.context_tokens=abc"], ["kv.context_tokens=1.5"]):
        with pytest.raises(ValueError):
            task_data.parse_task_params(bad)
    cache = spectrum_train.prefetch(tiny, {"kv": 1.0}, params, 3, 3, 1)
    tok = load_tokenizer(tiny)
    for i in range(3):
        assert cache[("kv", i)] == tasks.generate("kv", "train", 1, 3, tokenizer=tok, start=i, **params["kv"])[0]


def test_train_wrapper_curriculum_makes_the_first_items_short(tiny):
    sys.path.insert(0, os.path.join(ROOT, "scripts", "gpu"))
    import spectrum_train

    from sgl_kvxfer import tasks
    from sgl_kvxfer.models.loader import load_tokenizer

    params = {"kv": {"context_tokens": 160}}
    cache = spectrum_train.prefetch(tiny, {"kv": 1.0}, params, 3, 4, 1, short=(64, 0.5))
    tok = load_tokenizer(tiny)
    for i in range(4):
        ctx = 64 if i < 2 else 160
        assert cache[("kv", i)] == tasks.generate("kv", "train", 1, 3, tokenizer=tok, start=i, context_tokens=ctx)[0]
    assert cache[("kv", 0)].meta["context_tokens"] == 64 and cache[("kv", 3)].meta["context_tokens"] == 160
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "gpu", "spectrum_train.py"), "--short-fraction", "nan", "--",
           "--mix", "kv=1", "--out", "/nonexistent"]
    bad = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "--short-fraction must be in [0, 1]" in bad.stderr
    cmd[2:4] = ["--finish-within", "-5"]
    bad = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "--finish-within must be in [0, 1e6]" in bad.stderr
