"""sgl_kvxfer/fusedkv/scratch.py and scripts/fusedkv/compare_scratch.py: run names, one toy run, the
step plan under a time budget and its audit, and the grid end to end on two worker processes under
a budget (equal parameters, summaries over seeds, the PNG, every run trained its planned steps)."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from sgl_kvxfer.fusedkv.data import Tokenized, chunks, mixed_chunks, prepare
from sgl_kvxfer.fusedkv.scratch import PRESETS, RunSpec, train_run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _compare_scratch():
    spec = importlib.util.spec_from_file_location("compare_scratch", os.path.join(ROOT, "scripts/fusedkv/compare_scratch.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


CS = _compare_scratch()
# the H100 probe of a 3-worker grid: 52 ms a step; a warm 32-window eval ~50 ms, a cold one 1.3 s
H100_WARM = [{"step_s": 0.052, "eval_sub_s": 0.05, "eval_full_windows": 941}]
H100_COLD = [{"step_s": 0.052, "eval_sub_s": 1.29, "eval_full_windows": 941}]


def test_plan_fits_the_budget_and_never_goes_under_the_floor():
    small = PRESETS["small"]
    plan = CS.plan_steps(H100_WARM, small, runs_per_worker=7, budget_s=150, elapsed_s=20, min_steps=small["min_steps"])
    assert small["min_steps"] <= plan["steps"] < small["steps"] and plan["budget_capped"] and not plan["over_budget"]
    assert plan["expected_s"] <= 150
    roomy = CS.plan_steps(H100_WARM, small, 5, 150, 20, small["min_steps"])
    assert roomy["steps"] == small["steps"] and not roomy["budget_capped"]
    # cold evals priced at 59 s a run: the budget affords nothing, the floor holds (and says so)
    cold = CS.plan_steps(H100_COLD, small, 7, 48, 10, small["min_steps"])
    assert cold["afforded_steps"] < 1 and cold["steps"] == small["min_steps"] and cold["over_budget"]
    assert CS.plan_steps(H100_WARM, small, 7, 0, 20, 200)["steps"] == small["steps"]  # no budget


def test_audit_flags_runs_that_trained_less_than_planned():
    def run(n):
        return {"name": "vanilla", "spec": {"seed": 0}, "steps": n, "train_loss": [1.0] * n, "val_steps": [n]}

    ok = {"steps": 300, "planned_steps": 400, "min_steps": 200, "budget_capped": True, "results": [run(300)]}
    assert CS.audit_steps(ok) == []
    assert CS.audit_steps({**ok, "budget_capped": False})  # fewer than planned, not said
    assert CS.audit_steps({**ok, "steps": 1, "results": [run(1)]})  # one step trains nothing
    assert CS.audit_steps({**ok, "steps": 100, "results": [run(100)]})  # under the floor
    short = {**run(300), "train_loss": [1.0] * 120}
    assert CS.audit_steps({**ok, "results": [short]})  # a run that stopped early
    assert CS.audit_steps({"results": []}) == ["no step plan"]


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


@pytest.mark.heavy  # tens of seconds on 2 cores; CI runs -m "not heavy" (README, Tests)
def test_compare_scratch_grid_on_two_workers(tmp_path, tiny_model, text_data):
    """Under a time budget (the GPU path) and on a token folder with no tokenizer (the GPU machine
    has no model dir): every run trains the planned steps, > 1, and the audit is clean."""
    tok = str(tmp_path / "tok")
    prepare(text_data, tok, tiny_model)
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": ROOT, "TMPDIR": str(tmp_path)}
    cmd = [sys.executable, "scripts/fusedkv/compare_scratch.py", "--preset", "toy", "--device", "cpu", "--data-dir",
           tok, "--runs", "vanilla", "fusedkv[init=lite]", "--seeds", "0", "1", "--workers", "2",
           "--time-budget-s", "900", "--out-dir", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    res = json.load(open(out / "fusedkv_scratch_toy_cpu.json"))
    assert os.path.isfile(out / "fusedkv_scratch_toy_cpu.png") and not res["partial"]
    assert len(res["results"]) == 4 and len(res["probes"]) == 2 and res["audit"] == []
    assert res["steps"] == PRESETS["toy"]["steps"] > 1 and not res["budget_capped"]
    assert all(r["steps"] == len(r["train_loss"]) == res["steps"] for r in res["results"])
    assert res["plan"]["afforded_steps"] >= res["steps"] and res["plan"]["per_run_fixed_s"] > 0
    s = res["summary"]
    assert set(s) == {"vanilla", "fusedkv[init=lite]"} and all(sorted(v["seeds"]) == [0, 1] for v in s.values())
    assert all(v["min"] <= v["mean"] <= v["max"] for v in s.values())
    assert set(res["comparisons"]["minus_vanilla"]) == {"fusedkv[init=lite]"}


@pytest.mark.heavy  # over 10 s on 2 cores: CI leaves it out (README, Tests)
@pytest.mark.slow
def test_compare_scratch_budget_too_small_runs_the_floor(tmp_path, tiny_model, text_data):
    tok = str(tmp_path / "tok")
    prepare(text_data, tok, tiny_model)
    env = {**os.environ, "PYTHONPATH": ROOT, "TMPDIR": str(tmp_path)}
    cmd = [sys.executable, "scripts/fusedkv/compare_scratch.py", "--preset", "toy", "--device", "cpu", "--data-dir",
           tok, "--runs", "vanilla", "--seeds", "0", "--time-budget-s", "0.01", "--min-steps", "3",
           "--out-dir", str(tmp_path / "out")]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "WARNING: the budget affords" in proc.stdout and "budget capped: 3 of" in proc.stdout
    res = json.load(open(tmp_path / "out" / "fusedkv_scratch_toy_cpu.json"))
    assert res["steps"] == 3 and res["budget_capped"] and res["plan"]["over_budget"] and res["audit"] == []
    assert len(res["results"][0]["train_loss"]) == 3
