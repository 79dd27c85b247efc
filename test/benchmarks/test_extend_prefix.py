"""benchmarks/kernels/extend_prefix.py at toy sizes under Triton's interpreter: both layouts hold
the same prefix, every config runs and agrees, and the summary keeps the first chunk's pick."""
from __future__ import annotations

import json

import pytest


@pytest.mark.heavy  # a benchmark's smoke run of about 30 s on 2 cores: CI leaves it out (README, Tests)
def test_toy_run_writes_rows_for_both_layouts(load_benchmark, tmp_path):
    mod = load_benchmark("kernels/extend_prefix.py")
    assert mod.main(["--device", "cpu", "--prefixes", "0", "40", "--chunk", "16", "--heads", "4", "2", "16",
                     "--iters", "1", "--layouts", "pages", "rows", "scattered", "rows_dense", "--int-pass",
                     "--grid-orders", "blocks", "requests", "--out-dir", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("extend_prefix_*.json")
    d = json.loads(path.read_text())
    layouts = [l + i + o for l in ("rows", "scattered", "rows_dense") for i in ("", "+int") for o in ("", "@req")]
    layouts += ["pages", "pages@req"]
    assert {(r["layout"], r["prefix"]) for r in d["rows"]} == {(l, p) for l in layouts for p in (0, 40)}
    assert all(r["max_abs_diff_vs_first_config"] <= 0.05 for r in d["rows"])
    for name in ("rows", "scattered", "rows_int", "scattered_int", "rows_dense", "rows_int_req", "pages_req"):
        assert set(d["summary"][f"{name}_vs_pages"]) == {"@0", "@40"}
    assert (tmp_path / (path.stem + ".png")).exists()


def test_summary_measures_the_first_chunk_pick_at_long_prefixes(load_benchmark):
    mod = load_benchmark("kernels/extend_prefix.py")
    rows = [{"layout": "rows", "prefix": p, "config": c, "ms": ms}
            for p, c, ms in ((0, "a", 1.0), (0, "b", 2.0), (100, "a", 9.0), (100, "b", 6.0))]
    s = mod.summarize(rows)
    assert s["best"]["rows @100"] == {"config": "b", "ms": 6.0}
    assert s["first_chunk_pick"]["rows @100"] == {"config": "a", "ms": 9.0, "vs_best": pytest.approx(1.5)}


def test_bad_heads_are_refused(load_benchmark):
    mod = load_benchmark("kernels/extend_prefix.py")
    with pytest.raises(SystemExit):
        mod.main(["--device", "cpu", "--heads", "5", "2", "16"])
