"""benchmarks/pd/ttft_vs_bandwidth.py: a row's trace summary keeps each traced request's re-tier
(wall and CPU) and collector pauses, so one slow request among fast ones stays visible."""
from __future__ import annotations


def _trace(critical, phases):
    return {"critical_ms": critical, "unaccounted_ms": 1.0, "gaps": [], "by_phase_ms": phases}


def test_per_request_keeps_retier_and_gc(load_benchmark):
    mod = load_benchmark("pd/ttft_vs_bandwidth.py")
    fast = _trace(460.0, {"p.tier": 8.0, "p.tier_retier": 5.0, "p.tier_retier_cpu": 4.8, "p.wire[0]": 64.0})
    slow = _trace(520.0, {"p.tier": 66.0, "p.tier_retier": 62.0, "p.tier_retier_cpu": 9.0, "p.gc2": 3.5,
                          "p.gc0": 1.5, "d.admit": 1.0})
    out = mod.trace_summary([fast, slow, fast])
    per = out["per_request"]
    assert [r["critical_ms"] for r in per] == [460.0, 520.0, 460.0]
    assert per[1]["p.tier_retier"] == 62.0 and per[1]["p.tier_retier_cpu"] == 9.0 and per[1]["gc_ms"] == 5.0
    assert per[0]["gc_ms"] == 0 and "p.tier_move" not in per[0]  # phases a trace lacks stay out
    assert out["by_phase_ms"]["p.tier_retier"] == 5.0  # the median hides the slow one


def test_profile_rows_pick_rows_by_name_and_ids_are_file_safe(load_benchmark):
    import argparse

    mod = load_benchmark("pd/ttft_vs_bandwidth.py")
    assert mod.profile_id("PD b=0.3 chunk@1024 10", 8192) == "PD_b_0.3_chunk_1024_10_8192"
    off = argparse.Namespace(profile_dir=None, profile_rows=["b=0.3"])
    assert not mod.profiled(off, "b=0.3 end 10")
    some = argparse.Namespace(profile_dir="/x", profile_rows=["reference", "chunk@1024 10"])
    assert mod.profiled(some, "reference") and mod.profiled(some, "b=0.3 chunk@1024 10")
    assert not mod.profiled(some, "b=0.3 end 10")
    every = argparse.Namespace(profile_dir="/x", profile_rows=[])
    assert mod.profiled(every, "b=1.0 end unpaced")
