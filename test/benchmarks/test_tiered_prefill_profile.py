"""benchmarks/pd/tiered_prefill_profile.py at toy size on CPU: main() runs every view per budget
and writes the JSON the GPU call's summary reads; the warning capture groups by our frames."""
from __future__ import annotations

import json
import os
import warnings

import traceback


def test_main_tiny_cpu(load_benchmark, tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    mod = load_benchmark("pd/tiered_prefill_profile.py")
    out = tmp_path / "out"
    args = ["--device", "cpu", "--preset", "tiny", "--prompt", "96", "--chunk", "32", "--max-total-tokens", "4096",
            "--warmup", "1", "--repeats", "1", "--budgets", "1.0", "0.3", "--out-dir", str(out)]
    mod.main(args)
    names = os.listdir(out)
    assert len(names) == 1 and names[0].startswith("tiered_prefill_profile_") and names[0].endswith(".json")
    data = json.loads((out / names[0]).read_text())
    assert {"device", "commit", "command", "params", "budgets"} <= set(data)
    assert set(data["budgets"]) == {"1.0", "0.3"}
    for b, row in data["budgets"].items():
        assert {"engine_kwargs", "plain_ms", "timed", "synced", "sync_debug", "cprofile", "torch_profiler"} <= set(row)
        for view in ("timed", "synced", "cprofile", "torch_profiler"):
            assert "error" not in row[view], row[view]
            assert row[view]["wall_ms"] > 0
        assert row["sync_debug"] == {"skipped": "sync debug mode needs CUDA"}
        assert "tottime" in row["cprofile"] and "cumulative" in row["cprofile"]
        assert {"top_kernels", "runtime_calls", "top_cpu_self"} <= set(row["torch_profiler"])
    tiered = data["budgets"]["0.3"]
    assert tiered["tiering"] and not data["budgets"]["1.0"]["tiering"]
    for view in ("timed", "synced"):
        funcs = tiered[view]["functions"]
        assert funcs["EngineTiering._tier_prefill"]["calls"] == 1
        assert funcs["TieredKVPool.move"]["calls"] >= 1
        (spans,) = tiered[view]["spans_ms"]
        assert {"tier_scores", "tier_assign", "tier_move", "tier_row", "tier_retier_cpu"} <= {s[0] for s in spans}
        # the re-tier's host facts (wall vs CPU, context switches, collections) and the prompt's collections
        (host,) = tiered[view]["retier_host"]
        assert {"wall_ms", "cpu_ms", "vcsw", "ivcsw", "gc_collections", "gc_ms", "minor_faults"} <= set(host)
        assert host["wall_ms"] >= 0 and host["cpu_ms"] >= 0
        assert len(tiered[view]["gc"]["collections"]) == 3
    (detail,) = tiered["plain_detail"]
    assert len(detail["retier_host"]) == 1 and "gc" in detail
    assert tiered["host_runtime"]["cpus"] >= 1 and "torch_threads" in tiered["host_runtime"]
    assert not data["budgets"]["1.0"]["timed"]["functions"]  # no tiering: nothing wrapped


def test_rank_chunks_ranks_every_chunk_but_the_last(load_benchmark, tmp_path, monkeypatch):
    """--rank-chunks: each ranked prompt's chunks are launched in order and every chunk but the
    last is tiered on its own; a budget without tiering records no ranking."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    mod = load_benchmark("pd/tiered_prefill_profile.py")
    out = tmp_path / "out"
    args = ["--device", "cpu", "--preset", "tiny", "--prompt", "96", "--chunk", "32", "--max-total-tokens", "4096",
            "--warmup", "1", "--repeats", "2", "--budgets", "1.0", "0.3", "--views", "timed", "--rank-chunks",
            "--out-dir", str(out)]
    data = mod.main(args)
    tiered = data["budgets"]["0.3"]
    assert len(tiered["ranked_ms"]) == 2 and all(ms > 0 for ms in tiered["ranked_ms"])
    for detail in tiered["ranked_detail"]:
        launched, ranked = detail["chunk_launch_ms"], detail["chunk_tiered_ms"]
        assert len(launched) == 3 and launched == sorted(launched)  # 96 tokens in chunks of 32
        assert len(ranked) == 2 and ranked == sorted(ranked)
    assert "ranked_ms" not in data["budgets"]["1.0"]
    assert "error" not in tiered["timed"]


def test_capture_warnings_counts_each_warning(load_benchmark):
    mod = load_benchmark("pd/tiered_prefill_profile.py")

    def fn():
        for i in range(3):
            warnings.warn(f"sync {i}")
        return 7

    value, sites = mod.capture_warnings(fn)
    assert value == 7
    assert sum(s["count"] for s in sites) == 3  # "always": repeats from one line are not swallowed
    assert all(s["message"].startswith("sync") for s in sites)


def test_frames_keep_the_innermost_package_frames(load_benchmark):
    mod = load_benchmark("pd/tiered_prefill_profile.py")
    pkg = mod.PKG
    stack = [traceback.FrameSummary("/usr/lib/python3/runpy.py", 1, "run"),
             traceback.FrameSummary(os.path.join(pkg, "scheduler", "tiering.py"), 10, "_retier"),
             traceback.FrameSummary(os.path.join(pkg, "mem_cache", "tiered_pool.py"), 20, "move"),
             traceback.FrameSummary("/site/torch/cuda/__init__.py", 30, "synchronize")]
    assert mod._frames(stack, depth=1) == "sgl_kvxfer/mem_cache/tiered_pool.py:20:move"
    assert mod._frames(stack) == ("sgl_kvxfer/mem_cache/tiered_pool.py:20:move <- "
                                  "sgl_kvxfer/scheduler/tiering.py:10:_retier")
    outside = stack[-1:]
    assert mod._frames(outside).endswith("torch/cuda/__init__.py:30:synchronize")
