"""benchmarks/pd/mooncake_write.py: its summary and plot on made-up runs, and on a machine without
two GPUs it says what is missing and writes nothing (the GPU run itself is in the PD docs)."""
from __future__ import annotations

import os

import pytest


def test_summary_reports_rates_of_the_runs(load_benchmark):
    mod = load_benchmark("pd/mooncake_write.py")
    s = mod._summary(2_000_000_000, [0.010, 0.005, 0.008])
    assert s["GBps"] == pytest.approx(250.0) and s["min_GBps"] == pytest.approx(200.0)
    assert s["max_GBps"] == pytest.approx(400.0) and s["ms"] == pytest.approx(8.0)
    assert s["runs_GBps"] == pytest.approx([200.0, 400.0, 250.0])


def test_timed_drops_the_warmups(load_benchmark):
    mod = load_benchmark("pd/mooncake_write.py")
    calls = []
    runs = mod._timed(lambda: calls.append(1), 3)
    assert len(runs) == 3 and len(calls) == 3 + mod.WARMUPS


def test_plot_writes_one_panel_per_load(load_benchmark, tmp_path):
    mod = load_benchmark("pd/mooncake_write.py")
    rows = [{"load": load, "mib": mib, "method": m, "GBps": g}
            for load in ("idle", "gemm") for mib, g in ((16, 100.0), (256, 300.0)) for m in ("mooncake", "torch")]
    path = tmp_path / "w.png"
    mod.plot(rows, str(path), "t")
    assert path.stat().st_size > 0


def test_without_two_gpus_nothing_is_written(load_benchmark, tmp_path, capsys):
    import torch

    if torch.cuda.device_count() >= 2:
        pytest.skip("two GPUs here: the real run is not a unit test")
    mod = load_benchmark("pd/mooncake_write.py")
    assert mod.main(["--out-dir", str(tmp_path)]) == 2
    assert "needs two GPUs" in capsys.readouterr().out
    assert os.listdir(tmp_path) == []


def test_bad_arguments_are_refused(load_benchmark):
    mod = load_benchmark("pd/mooncake_write.py")
    with pytest.raises(SystemExit):
        mod.main(["--repeats", "0"])


def test_a_load_with_a_switch_interval_sets_and_restores_it(load_benchmark):
    import sys

    mod = load_benchmark("pd/mooncake_write.py")
    before = sys.getswitchinterval()
    with mod._Load("idle@300") as load:
        assert load.kind == "idle" and sys.getswitchinterval() == pytest.approx(300e-6)
    assert sys.getswitchinterval() == before
    with pytest.raises(SystemExit):
        mod.main(["--loads", "gil@0"])
