"""benchmarks/pd/trace_timeline.py on a hand-made chrome trace: the busiest stream is the compute
one, its idle stretches are found with the host's waits inside, and a kernel that ran longer
beside another stream's work shows a ratio above 1."""
from __future__ import annotations

import gzip
import json

import pytest


def kernel(name, ts, dur, stream, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": stream, "args": {"stream": stream}}


def trace():
    ev = [
        kernel("gemm", 0, 100, 7), kernel("gemm", 100, 100, 7),
        # compute idle 200 -> 2200 (2 ms) while the host waits in a sync
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 300, "dur": 1500},
        kernel("gemm", 2200, 150, 7), kernel("gemm", 2350, 150, 7),   # beside the pack below: slower
        kernel("pack", 2250, 200, 9),
        kernel("copy", 2600, 50, 0, cat="gpu_memcpy"),
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 10},
    ]
    return ev


def test_summarize_finds_the_gap_and_the_slowed_kernel(load_benchmark):
    mod = load_benchmark("pd/trace_timeline.py")
    s = mod.summarize(trace(), gap_ms=1.0, bin_ms=1.0)
    assert s["compute_stream"] == "7"
    assert s["window_ms"] == pytest.approx(2.65)
    assert s["streams"]["7"]["busy_ms"] == pytest.approx(0.5)
    assert s["streams"]["9"]["busy_ms"] == pytest.approx(0.2)
    (gap,) = s["gaps"]
    assert gap["at_ms"] == pytest.approx(0.2) and gap["ms"] == pytest.approx(2.0)
    assert gap["host_waits_ms"] == {"cudaStreamSynchronize": pytest.approx(1.5)}
    assert gap["others_busy_ms"] == pytest.approx(0.0)
    (gemm,) = s["compute_kernels"]
    assert (gemm["alone_n"], gemm["beside_n"]) == (2, 2)
    assert gemm["beside_over_alone"] == pytest.approx(1.5)
    assert s["overlap_ms"] == pytest.approx(0.2)
    assert len(s["bins"]) == 3 and s["bins"][0]["7"] == 20


def test_copies_pairs_each_large_copy_with_the_call_that_issued_it(load_benchmark):
    mod = load_benchmark("pd/trace_timeline.py")
    mib = 1 << 20
    ev = [
        # a 256 MiB peer copy issued by a synchronous cudaMemcpy on thread 42: 0.7 ms on the GPU
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaMemcpy", "ts": 1000, "dur": 760, "tid": 42,
         "args": {"correlation": 5}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy PtoP (Device -> Device)", "ts": 1040, "dur": 700,
         "tid": 143, "args": {"stream": 143, "correlation": 5, "bytes": 256 * mib}},
        # a small copy (below --copy-mib) and a copy whose call is not in the trace
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 900, "dur": 3, "args": {"stream": 7, "bytes": 64}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD", "ts": 3000, "dur": 100,
         "args": {"stream": 7, "correlation": 9, "bytes": 2 * mib}},
    ]
    first, second = mod.copies(ev)
    assert first["mib"] == 256 and first["gpu_ms"] == pytest.approx(0.7) and first["at_ms"] == 0
    assert first["gbps"] == pytest.approx(256 * mib / 700e3, rel=1e-3)
    assert (first["call"], first["call_tid"]) == ("cudaMemcpy", 42)
    assert first["call_ms"] == pytest.approx(0.76) and first["queued_ms"] == pytest.approx(0.04)
    assert second["at_ms"] == pytest.approx(1.96) and "call" not in second
    assert [c["mib"] for c in mod.copies(ev, min_bytes=4 * mib)] == [256]
    assert "copy at 0.0 ms: 256.0 MiB in 0.700 ms" in mod.text("t", {**mod.summarize(ev), "gaps": []})


def test_main_reads_gzip_and_reports_a_trace_without_gpu_events(load_benchmark, tmp_path, capsys):
    mod = load_benchmark("pd/trace_timeline.py")
    good = tmp_path / "a-TP-0.trace.json.gz"
    with gzip.open(good, "wt") as f:
        json.dump({"traceEvents": trace()}, f)
    cpu_only = tmp_path / "b.json"
    cpu_only.write_text(json.dumps({"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "x", "ts": 0, "dur": 1}]}))
    out = mod.main([str(good), str(cpu_only), "--json", str(tmp_path / "s.json")])
    assert out[str(good)]["compute_stream"] == "7"
    assert "error" in out[str(cpu_only)]
    text = capsys.readouterr().out
    assert "gap at 0.2 ms" in text and "no GPU events" in text
    assert json.loads((tmp_path / "s.json").read_text()).keys() == out.keys()
