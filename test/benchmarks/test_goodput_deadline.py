"""benchmarks/pd/goodput.py cut short: a --deadline-s or a SIGINT keeps every finished rate.

The servers and bench_serving are replaced by fakes (start_setup, stop_all, bench) and the
script's clock by a counter each fake run advances, so the tests run in a second and the cut
always lands at the same rate: what is checked is the sweep's bookkeeping (which rates run, the
timeout each gets, the JSON's `skipped` rows and `complete`), not any measurement.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import pytest

RUN_S = 10.0  # each fake bench_serving run takes this long on the fake clock


@pytest.fixture
def goodput(monkeypatch, load_benchmark):
    mod = load_benchmark("pd/goodput.py")
    now = [1000.0]
    mod.time = types.SimpleNamespace(time=lambda: now[0])
    stopped = []
    monkeypatch.setattr(mod, "start_setup", lambda setup, args: [types.SimpleNamespace(url=f"http://{setup}")])
    monkeypatch.setattr(mod, "stop_all", lambda *hs: stopped.extend(h.url for h in hs))
    mod.now, mod.stopped = now, stopped
    return mod


def _row(rate):
    return {"completed": 8, "num_prompts": 8, "request_throughput": rate, "median_ttft_ms": 100.0,
            "p99_ttft_ms": 200.0, "median_itl_ms": 5.0, "p99_itl_ms": 10.0, "mean_e2e_latency_ms": 500.0,
            "output_throughput": 100.0, "duration": 2.0}


def _main(mod, monkeypatch, tmp_path, *extra):
    monkeypatch.setattr(sys, "argv", ["goodput.py", "--tokenizer", "x", "--rates", "4", "8", "16",
                                      "--out-dir", str(tmp_path), "--name", "gp", *extra])
    mod.main()
    return json.load(open(tmp_path / "gp.json"))


def test_deadline_skips_the_rates_that_cannot_finish(goodput, monkeypatch, tmp_path):
    timeouts = []

    def bench(url, rate, args, out_file, timeout):
        timeouts.append(timeout)
        goodput.now[0] += RUN_S
        return _row(rate)

    monkeypatch.setattr(goodput, "bench", bench)
    data = _main(goodput, monkeypatch, tmp_path, "--deadline-s", "35")
    # 35 s: pd 4 (35 left), colocated 4 (25 left), pd 8 (15 left); colocated 8 (5 left < 10) on: skipped
    assert timeouts == [35.0, 25.0, 15.0]
    assert "skipped" not in data["setups"]["pd"]["8"] and data["setups"]["pd"]["8"]["p99_ttft_ms"] == 200.0
    for setup, rate in (("colocated", "8"), ("pd", "16"), ("colocated", "16")):
        assert "--deadline-s 35" in data["setups"][setup][rate]["skipped"]
    assert data["complete"] is False
    assert data["max_rate_within_slo"] == {"pd": 8.0, "colocated": 4.0}
    assert sorted(goodput.stopped) == ["http://colocated", "http://pd"]
    assert os.path.exists(tmp_path / "gp.png")


def test_no_deadline_runs_every_rate(goodput, monkeypatch, tmp_path):
    monkeypatch.setattr(goodput, "bench", lambda url, rate, args, out_file, timeout: _row(rate))
    data = _main(goodput, monkeypatch, tmp_path)
    assert data["complete"] is True
    assert all(len(rows) == 3 and not any("skipped" in r for r in rows.values()) for rows in data["setups"].values())


def test_interrupt_keeps_the_finished_rates(goodput, monkeypatch, tmp_path, capsys):
    def bench(url, rate, args, out_file, timeout):
        if rate == 8 and url == "http://colocated":
            raise KeyboardInterrupt  # what `timeout -s INT` raises in the main thread
        return _row(rate)

    monkeypatch.setattr(goodput, "bench", bench)
    data = _main(goodput, monkeypatch, tmp_path)
    assert "interrupted" in capsys.readouterr().out
    assert set(data["setups"]["pd"]["8"]) >= {"p99_ttft_ms", "p99_itl_ms"}
    assert data["setups"]["colocated"]["8"] == {"skipped": "interrupted"}
    assert data["setups"]["pd"]["16"] == {"skipped": "interrupted"}
    assert data["complete"] is False and data["max_rate_within_slo"] == {"pd": 8.0, "colocated": 4.0}
    assert sorted(goodput.stopped) == ["http://colocated", "http://pd"]


def test_bench_cut_at_its_timeout_is_skipped(goodput, monkeypatch, tmp_path):
    def run(cmd, timeout, **kw):
        raise subprocess.TimeoutExpired(cmd, timeout)

    monkeypatch.setattr(goodput.subprocess, "run", run)
    args = types.SimpleNamespace(min_prompts=8, seconds_per_rate=2.0, tokenizer="x", input_len=64, output_len=8,
                                 range_ratio=0.5, seed=1)
    row = goodput.bench("http://pd", 4.0, args, str(tmp_path / "pd_4.jsonl"), 12.0)
    assert row == {"skipped": "bench_serving cut after 12 s", "num_prompts": 8}
    assert not goodput.within_slo(row, args)


@pytest.mark.parametrize("flag", [["--deadline-s", "-1"], ["--deadline-s", "inf"], ["--deadline-s", "nan"],
                                  ["--bench-timeout", "0"], ["--deadline-s", "x"]])
def test_bad_deadline_flags_are_refused(goodput, monkeypatch, tmp_path, flag):
    with pytest.raises(SystemExit) as e:
        _main(goodput, monkeypatch, tmp_path, *flag)
    assert e.value.code == 2
