"""sgl_kvxfer/fusedkv/scratch.py and scripts/fusedkv/compare_scratch.py: run names, one toy run, and
the grid end to end on two worker processes (equal parameters, summaries over seeds, the PNG)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from sgl_kvxfer.fusedkv.data import Tokenized, chunks, mixed_chunks
from sgl_kvxfer.fusedkv.scratch import PRESETS, RunSpec, train_run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_run_names_parse_and_validate():
    s = RunSpec.parse("fusedkv[init=lite,fusion_lr=x30]", seed=2)
    assert (s.layout, s.fusion_init, s.fusion_lr_mult, s.seed) == ("fusedkv", "lite", 30.0, 2)
    assert s.name == "fusedkv[init=lite,fusion_lr=x30]" and RunSpec.parse("cla2", 0).name == "cla2"
    for bad in ("gqa", "fusedkv[init=zero]", "fusedkv[lr=x2]", "fusedkv[fusion_lr=x0]", "fusedkv[fusion_lr=xnan]"):
        with pytest.raises(ValueError):
            RunSpec.parse(bad, 0)


def test_one_toy_run_per_layout(tiny_model, text_data):
    p = {**PRESETS["toy"], "seq": 16}
    data = Tokenized(text_data, tiny_model)
    train = mixed_chunks(data.split("train"), 16)
    doms = {d: chunks(t, 16, 4) for d, t in data.split("eval").items()}
    runs = {lay: train_run(RunSpec(lay), p, 49152, 3, train, doms["prose"], doms, "cpu")
            for lay in ("vanilla", "fusedkv", "cla2")}
    n = runs["vanilla"]["params"]["total"]
    for r in runs.values():
        assert len(r["train_loss"]) == 3 and r["val_steps"][-1] == 3 and r["final_val_loss"] > 0
        assert abs(r["params"]["total"] / n - 1) < 1e-3
    assert runs["cla2"]["kv_bytes_per_token_bf16"] * 2 == runs["vanilla"]["kv_bytes_per_token_bf16"]
    assert len(runs["fusedkv"]["fusion_mean_abs"]["key"]) == 2 and "fusion_mean_abs_init" in runs["fusedkv"]


@pytest.mark.slow
def test_compare_scratch_grid_on_two_workers(tmp_path, tiny_model, text_data):
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": ROOT, "TMPDIR": str(tmp_path)}
    cmd = [sys.executable, "scripts/fusedkv/compare_scratch.py", "--preset", "toy", "--device", "cpu", "--data-dir",
           text_data, "--tokenizer", tiny_model, "--runs", "vanilla", "fusedkv[init=lite]", "yoco", "--seeds", "0", "1",
           "--workers", "2", "--out-dir", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    res = json.load(open(out / "fusedkv_scratch_toy_cpu.json"))
    assert os.path.isfile(out / "fusedkv_scratch_toy_cpu.png") and not res["partial"]
    assert len(res["results"]) == 6 and res["steps"] == PRESETS["toy"]["steps"] and len(res["probes"]) == 2
    s = res["summary"]
    assert set(s) == {"vanilla", "fusedkv[init=lite]", "yoco"} and all(sorted(v["seeds"]) == [0, 1] for v in s.values())
    assert all(v["min"] <= v["mean"] <= v["max"] for v in s.values())
    assert set(res["comparisons"]["minus_vanilla"]) == {"fusedkv[init=lite]", "yoco"}
