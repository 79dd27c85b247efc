"""python -m sgl_kvxfer.fusedkv.convert: a tiny model converted within a tiny budget, its report
(curve, final PPL), the final PPL line, flag validation, and the converted dir served by
launch_server unchanged."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import requests

from sgl_kvxfer.fusedkv import convert

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = ["--seq", "16", "--batch", "2", "--eval-windows", "2", "--calib-windows", "4", "--no-progress"]


@pytest.mark.parametrize("variant,tasks", [("fusedkv", []), ("lite", ["--tasks", "qa,kv", "--task-n", "2"])])
@pytest.mark.heavy  # over 10 s on 2 cores: CI leaves it out (README, Tests)
def test_convert_writes_a_served_model_and_a_report(tmp_path, tiny_model, text_data, capsys, variant, tasks):
    out, report_path = tmp_path / "out", tmp_path / "r" / "report.json"
    report = convert.main(["--model", tiny_model, "--variant", variant, "--out", str(out), "--train-data", text_data,
                           "--budget-min", "0.15", "--device", "cpu", "--report", str(report_path), "--dtype",
                           "float32", *SMALL, *tasks])
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1].startswith("PPL code: original") and "; prose: original" in lines[-1] and "converted" in lines[-1]
    if tasks:  # both models answered the same items through the engine
        ts = report["task_scores"]
        assert ts["tasks"] == ["qa", "kv"] and ts["original"]["kv"]["n"] == ts["converted"]["kv"]["n"] == 2
        assert set(ts["headline_points"]) == {"qa", "kv"} and lines[-2].startswith("tasks (headline, points): qa f1")
    saved = json.load(open(report_path))
    assert os.path.isfile(str(report_path)[:-5] + ".png")
    assert saved["final_ppl"] == report["final_ppl"] and set(saved["final_ppl"]) == {"prose", "code"}
    assert [p["phase"] for p in saved["curve"]][0] == "init" and saved["curve"][-1]["phase"] == "final"
    gpu = [p["gpu_s"] for p in saved["curve"]]
    assert gpu == sorted(gpu) and saved["train_gpu_s"] >= gpu[-1] - 1e-9
    assert all(math.isfinite(v) for v in saved["final_ppl"].values())
    assert saved["commit"] and saved["device"]
    tsp = saved["train_split_ppl"]  # the training text's PPL, both models, and the converted one's ratio
    assert set(tsp["original"]) == set(tsp["converted"]) == set(tsp["rel"]) == {"prose", "code"}
    assert all(abs(tsp["rel"][d] - (tsp["converted"][d] / tsp["original"][d] - 1)) < 1e-9 for d in tsp["rel"])
    cfg = json.load(open(out / "config.json"))
    assert cfg["fusedkv"]["variant"] == variant and cfg["fusedkv"]["source_layers"] == saved["source_search"]["sources"]

    from sgl_kvxfer import Engine

    with Engine(str(out), max_total_tokens=256, chunked_prefill_size=64, dtype="float32") as eng:
        got = eng.generate("the cat sat on", {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True})
        info = eng.get_server_info()
    assert len(got["output_ids"]) == 4 and info["extra"]["fusedkv"]["kv_bytes_ratio_vs_vanilla"] == 0.5


def test_report_is_on_disk_before_the_task_suite(tmp_path, tiny_model, text_data, monkeypatch):
    """A stage's time limit that interrupts the task suite (SIGINT) keeps the PPL report and PNG."""
    from sgl_kvxfer.fusedkv import task_eval

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(task_eval, "compare", interrupted)
    report_path = tmp_path / "report.json"
    with pytest.raises(KeyboardInterrupt):
        convert.main(["--model", tiny_model, "--variant", "lite", "--out", str(tmp_path / "out"), "--train-data",
                      text_data, "--budget-min", "0", "--device", "cpu", "--report", str(report_path), *SMALL,
                      "--tasks", "qa", "--task-n", "1"])
    saved = json.load(open(report_path))
    assert set(saved["final_ppl"]) == {"prose", "code"} and "task_scores" not in saved
    assert os.path.isfile(tmp_path / "report.png") and os.path.isfile(tmp_path / "out" / "config.json")


@pytest.mark.parametrize("shift", [False, True])
def test_retrofit_trains_within_its_budget(tiny_model, text_data, shift):
    from sgl_kvxfer.fusedkv.data import Tokenized
    from sgl_kvxfer.fusedkv.retrofit import RetrofitConfig, run_retrofit

    cfg = RetrofitConfig(budget_s=5.0, seq=16, batch=2, eval_windows=2, calib_windows=4,
                         eval_points=3, shift_windows=shift)
    student, rep = run_retrofit(tiny_model, Tokenized(text_data, tiny_model), cfg, "cpu", progress=False)
    assert rep["config"]["shift_windows"] is shift
    assert rep["local_steps"] >= 1 and rep["distill_steps"] >= cfg.probe_steps
    assert rep["distill_steps"] <= rep["distill_planned_steps"]
    # the clock stops at the budget, give or take one step
    assert rep["train_gpu_s"] <= cfg.budget_s + 2 * rep["distill_step_s"] + 1.0
    assert [p["phase"] for p in rep["curve"]][:2] == ["init", "local"] and rep["curve"][-1]["phase"] == "final"
    assert student.config.fusedkv.source_layers == tuple(rep["source_search"]["sources"])
    assert rep["tokens_seen"] == (rep["local_steps"] + rep["distill_steps"]) * 2 * 16


def test_held_out_windows_can_outreach_the_training_windows(tiny_model, text_data):
    """--eval-seq: the held-out PPL over windows longer than the training windows (positions the
    retrofit never trains at), in evaluation batches of about a training batch's tokens."""
    from sgl_kvxfer.fusedkv.data import Tokenized
    from sgl_kvxfer.fusedkv.retrofit import RetrofitConfig, run_retrofit

    data = Tokenized(text_data, tiny_model)
    reps = {}
    for eval_seq in (None, 48):
        cfg = RetrofitConfig(budget_s=0.0, seq=16, batch=2, eval_windows=2, calib_windows=4, eval_seq=eval_seq)
        _, reps[eval_seq] = run_retrofit(tiny_model, data, cfg, "cpu", progress=False)
    assert reps[None]["eval_seq"] == 16 and reps[48]["eval_seq"] == 48
    assert reps[None]["eval_tokens"] == {"prose": 2 * 16, "code": 2 * 16}
    assert reps[48]["eval_tokens"] == {"prose": 2 * 48, "code": 2 * 48}
    assert reps[48]["teacher_ppl"] != reps[None]["teacher_ppl"]  # other windows, other positions
    with pytest.raises(ValueError, match="eval_seq"):
        RetrofitConfig(eval_seq=0)


@pytest.mark.parametrize("flags,err", [
    (["--budget-min", "-1"], "--budget-min"), (["--budget-min", "nan"], "--budget-min"),
    (["--budget-min", "inf"], "--budget-min"), (["--batch", "0"], "--batch"), (["--seq", "x"], "--seq"),
    (["--variant", "gqa"], "--variant"), (["--tasks", "chess"], "--tasks"), (["--task-n", "0"], "--task-n"),
    (["--init", "random"], "--init"), (["--eval-seq", "4"], "--eval-seq"), (["--ema", "1"], "--ema"),
    (["--ema", "nan"], "--ema"), (["--anchor-decay", "-1"], "--anchor-decay"), (["--anchor-decay", "inf"], "--anchor-decay"),
])
def test_bad_flags_are_argparse_errors(tmp_path, flags, err, capsys):
    args = ["--model", "m", "--variant", "fusedkv", "--out", str(tmp_path / "o")]
    with pytest.raises(SystemExit) as e:
        convert.main(args + flags)
    assert e.value.code == 2 and err in capsys.readouterr().err


def test_missing_data_is_a_clear_error(tmp_path, tiny_model, monkeypatch):
    monkeypatch.delenv("SGL_KVXFER_FUSEDKV_DATA", raising=False)
    with pytest.raises(SystemExit, match="no training data"):
        convert.main(["--model", tiny_model, "--variant", "lite", "--out", str(tmp_path / "o"), "--device", "cpu"])
    with pytest.raises(SystemExit, match="does not exist"):
        convert.main(["--model", tiny_model, "--variant", "lite", "--out", str(tmp_path / "o"), "--device", "cpu",
                      "--train-data", str(tmp_path / "nowhere")])


@pytest.mark.heavy  # tens of seconds on 2 cores; CI runs -m "not heavy" (README, Tests)
def test_cli_converts_and_launch_server_serves_it(tmp_path, tiny_model, text_data):
    """The documented commands as a user runs them: the CLI in a subprocess (data from the
    environment variable), then launch_server --model-path on its output."""
    from servers import start_server

    out = tmp_path / "served"
    env = {**os.environ, "SGL_KVXFER_FUSEDKV_DATA": text_data, "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, "-m", "sgl_kvxfer.fusedkv.convert", "--model", tiny_model, "--variant",
                           "fusedkv", "--out", str(out), "--budget-min", "0.05", "--device", "cpu", *SMALL[:-1]],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "retrofit" in proc.stderr  # the progress bar
    assert proc.stdout.strip().splitlines()[-1].startswith("PPL code: original")
    handle = start_server(["--model-path", str(out), "--max-total-tokens", "512", "--dtype", "float32",
                           "--log-level", "warning"], name="fusedkv-converted")
    try:
        r = requests.post(handle.url + "/generate", timeout=120, json={
            "text": "the cat sat on", "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}})
        assert r.status_code == 200, r.text
        assert len(r.json()["output_ids"]) == 4
        state = requests.get(handle.url + "/get_server_info", timeout=30).json()["internal_states"][0]
        assert state["fusedkv"]["variant"] == "fusedkv" and state["fusedkv"]["kv_bytes_ratio_vs_vanilla"] == 0.5
    finally:
        assert handle.stop() == []
