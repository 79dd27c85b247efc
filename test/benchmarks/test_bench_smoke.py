"""Every benchmark script under benchmarks/{kernels,throughput,quality,pd} runs end to end on CPU.

Each test runs one script as a subprocess, the way its command line runs it
(`python benchmarks/.../script.py ARGS --out-dir DIR`), at tiny shapes: Triton kernels in
Triton's interpreter, dummy-weight presets (`tiny`) or the embedded SmolLM2. It checks the exit
status, that the result JSON records device, commit and command plus the script's own keys, and
the PNG where the script draws one. The numbers are not checked: these runs only show that the
scripts still work. Every temp file of a script goes under the test's tmp_path, and a script
must remove the temp folders it makes. The runs that take over 5 s on 2 cores are marked
`heavy` (CI's default run leaves them out; `-m heavy` runs them).
"""
from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from common.report import command_line, write_json  # noqa: E402

from sgl_kvxfer.testing.servers import Deadline, scaled  # noqa: E402

TINY_WORKLOAD = ["--model-preset", "tiny", "--device", "cpu", "--num-prompts", "4", "--input-len-min", "16",
                 "--input-len-max", "32", "--output-len", "4"]
PROSE_DOCS = ("README.md", "docs/structures.md", "docs/http_api.md", "sgl_kvxfer/mem_cache/README.md",
              "benchmarks/README.md", "benchmarks/quality/README.md")


def run_bench(script: str, args: list[str], tmp_path, timeout: float = 600) -> str:
    """Run benchmarks/SCRIPT with ARGS and --out-dir tmp_path/out; returns that folder."""
    out, tmp = tmp_path / "out", tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp), "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, os.path.join("benchmarks", script), *args, "--out-dir", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=scaled(timeout))
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-6000:]}"
    # temp model dirs, probe caches, bench_serving's files: removed by the script (server logs
    # of sgl_kvxfer.testing.servers and torch's inductor folder stay, as they do for the tests)
    left = [n for n in os.listdir(tmp) if not n.endswith(".log") and not n.startswith("torchinductor_")]
    assert not left, f"{script} left {left} in its temp folder"
    return str(out)


def result(out_dir: str, prefix: str, keys: tuple[str, ...], png: bool) -> dict:
    """The one JSON OUT_DIR/PREFIX*.json: device, commit, command and `keys` recorded; its PNG
    beside it when `png`."""
    names = sorted(n for n in os.listdir(out_dir) if n.startswith(prefix) and n.endswith(".json"))
    assert len(names) == 1, os.listdir(out_dir)
    path = os.path.join(out_dir, names[0])
    with open(path) as f:
        data = json.load(f)
    assert data["device"] and data["commit"]
    script = data["command"].split()[1]
    assert data["command"].startswith("python benchmarks/") and os.path.exists(os.path.join(ROOT, script))
    assert f"--out-dir {out_dir}" in data["command"]
    missing = [k for k in keys if k not in data]
    assert not missing, f"{names[0]} lacks {missing}"
    assert os.path.exists(path[: -len(".json")] + ".png") == png, os.listdir(out_dir)
    return data


@pytest.fixture(scope="module")
def prose(tmp_path_factory) -> str:
    """A small eval-prose file ({"text": ...} rows) from this repo's docs, for the quality scripts."""
    path = tmp_path_factory.mktemp("prose") / "prose.jsonl"
    with open(path, "w") as f:
        for name in PROSE_DOCS:
            with open(os.path.join(ROOT, name)) as doc:
                f.write(json.dumps({"source": name, "text": doc.read()}) + "\n")
    return str(path)


# ---------------------------------------------------------------------------- common/report.py
def test_write_json_records_device_commit_and_command(tmp_path):
    with pytest.raises(ValueError, match="device"):
        write_json("x", {"value": 1}, str(tmp_path))
    path = write_json("x", {"device": "cpu", "value": 1}, str(tmp_path))
    with open(path) as f:
        data = json.load(f)
    assert data["commit"] and data["value"] == 1 and data["command"] == command_line()
    kept = write_json("y", {"device": "cpu", "commit": "abc", "command": "python x.py"}, str(tmp_path))
    with open(kept) as f:
        assert {k: v for k, v in json.load(f).items() if k != "timestamp"} == {
            "device": "cpu", "commit": "abc", "command": "python x.py"}
    script = os.path.join(ROOT, "benchmarks", "pd", "shaped_link.py")
    assert command_line([script, "--rates", "1", "--server-args", "--a b"]) == \
        "python benchmarks/pd/shaped_link.py --rates 1 --server-args '--a b'"


# ---------------------------------------------------------------------------- kernels
@pytest.mark.heavy  # a benchmark's smoke run of over 10 s on 2 cores: CI leaves it out (README, Tests)
def test_attention(tmp_path):
    out = run_bench("kernels/attention.py", ["--device", "cpu", "--points", "smollm2:1:128", "--iters", "1"], tmp_path)
    data = result(out, "attention_", ("results", "copy_bandwidth_Bps", "params", "served_configs"), png=True)
    row, = data["results"]
    for v in ("sdpa", "fp16_pool", "tiered_fp16", "tiered_int8", "tiered_int4", "tiered_mix_b0.5"):
        assert {"ms", "ms_min", "ms_max", "bytes", "GBps", "speed_vs_sdpa", "pct_sdpa_bw"} <= set(row[v]), v
    assert row["tiered_int8"]["counts"] == [0, 128, 0] and row["tiered_int8"]["tiers"] == [1]
    assert row["tiered_int8"]["max_abs_diff_vs_reference"] < 2e-2
    assert "skipped" in row["flashinfer_fp16"] and "skipped" in row["flashinfer_fp8"]  # CUDA only


@pytest.mark.heavy  # a benchmark's smoke run of over 5 s on 2 cores: CI leaves it out (README, Tests)
def test_decode_plan(tmp_path):
    out = run_bench("kernels/decode_plan.py", ["--device", "cpu", "--batch", "2", "--ctx-min", "16", "--ctx-max",
                                               "64", "--max-seq", "128", "--splits", "1", "2",
                                               "--configs", "4:1", "--iters", "1"], tmp_path)
    data = result(out, "decode_plan_", ("rows", "best", "default_plan", "params"), png=True)
    assert len(data["rows"]) == 2 and all(r["max_abs_diff"] == 0 for r in data["rows"])


@pytest.mark.heavy  # a benchmark's smoke run of over 10 s on 2 cores: CI leaves it out (README, Tests)
def test_launch_overhead(tmp_path):
    out = run_bench("kernels/launch_overhead.py", ["--device", "cpu", "--tokens", "64", "--calls", "1",
                                                   "--repeats", "1"], tmp_path)
    data = result(out, "launch_overhead_", ("us_per_call", "params"), png=False)
    assert "extend_attention_tiered (wrapper)" in data["us_per_call"]


@pytest.mark.heavy  # a benchmark's smoke run of over 10 s on 2 cores: CI leaves it out (README, Tests)
def test_fusedkv_tiered_launches(tmp_path):
    out = run_bench("kernels/fusedkv_tiered.py", ["--device", "cpu", "--batch", "2", "--context", "80", "--layers", "2",
                                                  "--sources", "0,1", "--page", "16", "--recent", "8", "--mix",
                                                  "0.2:0.4:0.4", "--repeats", "1", "--calls", "1", "--configs",
                                                  "32:4:2", "64:2:1:4"], tmp_path)
    data = result(out, "fusedkv_tiered_cpu", ("rows", "params", "bytes_per_launch", "best"), png=True)
    assert [r["config"] for r in data["rows"]] == ["32:4:2", "64:2:1:4"] and data["rows"][0]["default"]
    assert all(r["us"] > 0 and r["max_abs_err_vs_default"] < 2e-2 for r in data["rows"])
    assert sum(data["tokens_per_store"].values()) == 2 * 80 and min(data["tokens_per_store"].values()) > 0


# ---------------------------------------------------------------------------- throughput
@pytest.mark.heavy  # a benchmark's smoke run of over 5 s on 2 cores: CI leaves it out (README, Tests)
def test_offline(tmp_path):
    out = run_bench("throughput/offline.py", [*TINY_WORKLOAD, "--dtype", "float32", "--hf-batch-size", "4"], tmp_path)
    data = result(out, "offline_tiny_cpu", ("sgl_kvxfer", "hf_generate", "ratio_output_tok_s", "params"), png=True)
    assert data["sgl_kvxfer"]["output_tokens"] == data["hf_generate"]["output_tokens"] == 16


@pytest.mark.heavy  # a benchmark's smoke run of over 5 s on 2 cores: CI leaves it out (README, Tests)
def test_phase_profile(tmp_path):
    out = run_bench("throughput/phase_profile.py", [*TINY_WORKLOAD, "--host-breakdown"], tmp_path)
    data = result(out, "phase_profile_tiny_cpu", ("unsynced", "synced", "host_breakdown", "params"), png=False)
    assert data["synced"]["phases"]["decode"]["steps"] > 0


@pytest.mark.heavy  # a benchmark's smoke run of over 5 s on 2 cores: CI leaves it out (README, Tests)
def test_host_breakdown(tmp_path):
    out = run_bench("throughput/host_breakdown.py", TINY_WORKLOAD, tmp_path)
    data = result(out, "host_breakdown_tiny_cpu", ("phases", "wall_s", "output_tokens", "params"), png=False)
    assert {"extend", "decode"} <= set(data["phases"]) and data["output_tokens"] == 16
    assert any(r["name"] == "Scheduler.step" for r in data["phases"]["decode"])


@pytest.mark.heavy  # a benchmark's smoke run of over 10 s on 2 cores: CI leaves it out (README, Tests)
def test_host_overhead(tmp_path, smollm2_path):
    out = run_bench("throughput/host_overhead.py", ["--model-path", smollm2_path, "--num-prompts", "4",
                                                    "--input-len-min", "16", "--input-len-max", "32",
                                                    "--output-len", "4", "--repeats", "1"], tmp_path)
    data = result(out, "host_overhead_cpu", ("median", "runs", "params"), png=True)
    assert data["median"]["decode_steps"] > 0


@pytest.mark.heavy  # a benchmark's smoke run of over 5 s on 2 cores: CI leaves it out (README, Tests)
def test_decode_step(tmp_path):
    out = run_bench("throughput/decode_step.py", ["--device", "cpu", "--presets", "tiny", "--batches", "2",
                                                  "--context", "32", "--steps", "2", "--warmup", "1"], tmp_path)
    data = result(out, "decode_step_", ("rows", "params"), png=False)
    row, = data["rows"]
    assert row["batch"] == 2 and row["timed_steps"] >= 2 and not row["cuda_graph"]


@pytest.mark.heavy  # a benchmark's smoke run of over 10 s on 2 cores: CI leaves it out (README, Tests)
def test_e2e_decode(tmp_path):
    out = run_bench("throughput/e2e_decode.py", ["--device", "cpu", "--preset", "tiny", "--context", "64", "--batch",
                                                 "2", "--n1", "1", "--n2", "2", "--repeats", "1",
                                                 "--kv-tier-budgets", "1.0", "0.5", "--kernel-breakdown"], tmp_path)
    data = result(out, "e2e_decode_tiny", ("rows", "params", "copy_bandwidth_Bps", "sdpa_read_bandwidth"), png=True)
    assert [r["kv_tier_budget"] for r in data["rows"]] == [1.0, 0.5] and not data["partial"]
    full, half = data["rows"]
    assert half["kv_fraction_of_fp16"] < 0.75 and half["pool_plan"]["stores"]["n8"] > 0
    assert half["engine_kwargs"]["max_total_tokens"] == half["pool_plan"]["pool_tokens"]
    # the tiered engine's row names the decode config it served (the interpreter's, on the CPU)
    served = half["attention_config"]
    assert served["source"] == "interpreter" and served["int_page_source"] == "EngineConfig default"
    assert "attention_config" not in full
    for r in data["rows"]:
        assert {"decode_tok_s", "fraction_of_roofline_copy", "fraction_of_roofline_sdpa", "bytes_needed"} <= set(r)
        k = r["kernels"]  # --kernel-breakdown: per-step time by operator on the CPU, groups summing to it
        assert k["unit"] == "cpu_op" and k["busy_s"] > 0 and k["top_s"] and k["launches_per_step"] > 0
        assert abs(sum(k["groups_s"].values()) - k["busy_s"]) < 1e-9 * max(1.0, k["busy_s"]) + 1e-12


@pytest.mark.heavy  # a benchmark's smoke run of over 10 s on 2 cores: CI leaves it out (README, Tests)
def test_e2e_decode_keeps_a_point_interrupted_in_its_kernel_profile(tmp_path, monkeypatch):
    """SIGINT during --kernel-breakdown (the last, optional part of a point): the point's timing is
    kept, its profile marked interrupted, and the run stops there with a partial JSON."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks", "throughput"))
    import e2e_decode

    def interrupted(*_a, **_k):
        raise KeyboardInterrupt
    monkeypatch.setattr(e2e_decode, "kernel_breakdown", interrupted)
    path = e2e_decode.main(["--device", "cpu", "--preset", "tiny", "--context", "64", "--batch", "2", "--n1", "1",
                            "--n2", "2", "--repeats", "1", "--kv-tier-budgets", "1.0", "0.5", "--kernel-breakdown",
                            "--out-dir", str(tmp_path)])
    with open(path) as f:
        data = json.load(f)
    row, = data["rows"]  # b = 0.5 never started
    assert data["partial"] and row["interrupted"] and row["decode_step_s"] > 0 and "error" in row["kernels"]


def test_dense_linear(tmp_path):
    out = run_bench("kernels/dense_linear.py", ["--device", "cpu", "--preset", "tiny", "--batches", "2", "--iters", "5",
                                                "--name", "dense_linear_tiny"], tmp_path)
    data = result(out, "dense_linear_tiny", ("rows", "params", "copy_bandwidth_Bps", "dense_step"), png=True)
    assert {(r["variant"], r["matmul"]) for r in data["rows"]} == {
        (v, m) for v in ("linear", "kn") for m in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head")}
    for r in data["rows"]:  # both storages compute x W^T (fp32 reference)
        assert r["rel_err"] < 2e-2 and r["bytes"] >= r["n"] * r["k"] * 2
    for s in data["dense_step"]:  # the step sums layers x the four projections + lm_head
        rows = [r for r in data["rows"] if r["variant"] == s["variant"] and r["m"] == s["m"]]
        want = sum(r["ms"] * 1e-3 * (1 if r["matmul"] == "lm_head" else 2) for r in rows)  # tiny: 2 layers
        assert abs(s["dense_s"] - want) < 1e-9


def test_dense_linear_copy_floor(tmp_path):
    """The copy variant moves each projection's weight bytes with no arithmetic (the floor a
    kernel of that size sets); it is timed like the matmuls and summed into its own dense step."""
    out = run_bench("kernels/dense_linear.py", ["--device", "cpu", "--preset", "tiny", "--batches", "2", "--iters", "5",
                                                "--variants", "copy", "--name", "dense_linear_copy"], tmp_path)
    data = result(out, "dense_linear_copy", ("rows", "params", "dense_step"), png=True)
    assert {r["matmul"] for r in data["rows"]} == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"}
    for r in data["rows"]:
        assert r["variant"] == "copy" and r["bytes"] == r["n"] * r["k"] * 2 and r["ms"] > 0


def test_block_tables(tmp_path):
    out = run_bench("kernels/block_tables.py", ["--device", "cpu", "--points", "2:300", "--iters", "5",
                                                "--name", "block_tables_cpu"], tmp_path)
    data = result(out, "block_tables_cpu", ("rows", "params"), png=True)
    row, = data["rows"]
    assert row["tables_equal"] and row["torch_over_kernel"] > 0  # the kernel's tables are the reference's
    assert all(row[k]["iters"] == 5 for k in ("sort", "kernel", "torch"))


@pytest.mark.heavy  # a benchmark's smoke run of over 10 s on 2 cores: CI leaves it out (README, Tests)
def test_backend_agreement(tmp_path):
    # float16: the triton backend's bfloat16 path in Triton's CPU interpreter does not match torch
    out = run_bench("throughput/backend_agreement.py", ["--device", "cpu", "--preset", "tiny", "--num-prompts", "2",
                                                        "--output-len", "4", "--min-len", "16", "--max-len", "40",
                                                        "--dtypes", "float16"], tmp_path)
    data = result(out, "backend_agreement_tiny", ("results", "params"), png=False)
    assert data["results"]["float16"]["sequences"] == 2


@pytest.mark.heavy  # a benchmark's smoke run of over 10 s on 2 cores: CI leaves it out (README, Tests)
@pytest.mark.slow
def test_serving(tmp_path, smollm2_path):
    if importlib.util.find_spec("sglang") is None:  # bench_serving imports only with common/torchvision_stub
        pytest.skip("sglang (its bench_serving client) is not installed")
    out = run_bench("throughput/serving.py", [
        "--rates", "inf", "--num-prompts", "4", "--input-len", "16", "--output-len", "4", "--max-concurrency", "4",
        "--server-args", f"--model-path {smollm2_path} --device cpu --dtype float32 --max-total-tokens 2048"],
        tmp_path)
    data = result(out, "serving_cpu_", ("results", "parameters", "server"), png=True)
    row, = data["results"]
    assert row["completed"] == 4 and row["failed"] == 0


# ---------------------------------------------------------------------------- quality
@pytest.mark.heavy  # a benchmark's smoke run of over 10 s on 2 cores: CI leaves it out (README, Tests)
def test_ppl_sweep(tmp_path, smollm2_path, prose):
    out = run_bench("quality/ppl_sweep.py", ["--device", "cpu", "--model", smollm2_path, "--prose", prose,
                                             "--context", "64", "--chunk", "16", "--windows", "1", "--budgets", "0.5",
                                             "--methods", "greedy", "--max-total-tokens", "2048"], tmp_path)
    data = result(out, "ppl_sweep_", ("fp16_ppl", "results", "params"), png=True)
    assert data["complete"] and [r["method"] for r in data["results"]] == ["greedy"]


@pytest.mark.heavy  # a benchmark's smoke run of over 10 s on 2 cores: CI leaves it out (README, Tests)
def test_niah(tmp_path, smollm2_path, prose):
    out = run_bench("quality/niah.py", ["--device", "cpu", "--model", smollm2_path, "--prose", prose, "--quick",
                                        "--tokens", "256", "--budgets", "0.5", "--methods", "pdtrim",
                                        "--kv-int4", "on", "--max-total-tokens", "4096"], tmp_path)
    data = result(out, "niah_", ("probe", "fp16_accuracy", "results", "grid", "kv_cosine"), png=True)
    assert data["probe"]["int4_enabled"] and data["probe"]["outcomes"] is None  # --kv-int4 on: no probe
    assert len(data["grid"]["pdtrim"]["0.5"]) == 3  # --quick: 3 depths x 1 trial


@pytest.mark.heavy  # a benchmark's smoke run of over 10 s on 2 cores: CI leaves it out (README, Tests)
def test_decode_rule(tmp_path, smollm2_path, prose):
    out = run_bench("quality/decode_rule.py", ["--device", "cpu", "--model", smollm2_path, "--prose", prose,
                                               "--prompts", "1", "--prompt-tokens", "64", "--new-tokens", "8",
                                               "--max-total-tokens", "2048"], tmp_path)
    data = result(out, "decode_rule_", ("reference_nll", "results", "params"), png=False)
    assert [r["variant"] for r in data["results"]] == ["no demotion", "demote R=64", "demote R=16"]


# ---------------------------------------------------------------------------- pd
@pytest.mark.heavy  # a benchmark's smoke run of over 5 s on 2 cores: CI leaves it out (README, Tests)
def test_shaped_link(tmp_path):
    pytest.importorskip("mooncake")
    out = run_bench("pd/shaped_link.py", ["--mib", "1", "--segment-mib", "0.25", "--rates", "10", "--repeats", "1"],
                    tmp_path)
    data = result(out, "shaped_link", ("results", "params"), png=True)
    assert [r["set_gbps"] for r in data["results"]] == [None, 10.0]


@pytest.mark.heavy  # a benchmark's smoke run of over 10 s on 2 cores: CI leaves it out (README, Tests)
@pytest.mark.slow
def test_ttft_vs_bandwidth(tmp_path, smollm2_path):
    pytest.importorskip("sglang_router")
    pytest.importorskip("mooncake")
    out = run_bench("pd/ttft_vs_bandwidth.py", [
        "--prompts", "64", "--budgets", "1.0", "--rates", "10", "--variant-rates",
        "--profile-dir", str(tmp_path / "profiles"), "--profile-rows", "b=1.0 end 10",
        "--server-args", f"--model-path {smollm2_path} --device cpu --dtype float32 --max-total-tokens 4096 "
                         "--kv-int4 on"], tmp_path)
    data = result(out, "ttft_vs_bandwidth", ("reference", "pd", "ratios", "params"), png=True)
    pd_row = data["pd"]["b=1.0 end 10"]["64"]
    assert pd_row["ttft_ms"] > 0 and pd_row["bytes"] > 0
    # the profiled row: its trace on disk, and the profiled request's own transfer beside it
    assert (tmp_path / "profiles" / pd_row["profile"]["file"]).is_file()
    assert pd_row["profile"]["kv_transfer"]["status"] == "ok" and pd_row["profile"]["kv_transfer"]["wire_ms"] > 0


@pytest.mark.heavy  # a benchmark's smoke run of over 10 s on 2 cores: CI leaves it out (README, Tests)
def test_fusedkv_serve_bench(tmp_path):
    out = run_bench("fusedkv/serve_bench.py", ["--smoke"], tmp_path)
    data = result(out, "fusedkv_serve_tiny_cpu", ("rows", "params", "targets", "vs_vanilla", "copy_bandwidth_Bps"),
                  png=True)
    assert sorted(data["rows"]) == ["fusedkv", "lite", "vanilla"]
    assert not data["partial"] and all(r["complete"] for r in data["rows"].values())
    assert data["vs_vanilla"]["fusedkv"]["pool_bytes_per_token"] == data["vs_vanilla"]["lite"]["pool_bytes_per_token"] == 0.5
    assert "ttft_no_skip" in data["rows"]["fusedkv"]
    for row in data["rows"].values():
        assert [(p["batch"], p["context"]) for p in row["tpot"]] == [(1, 32), (2, 32)]
        for p in row["tpot"]:  # warm, >= 5 pairs, a spread, never a negative time, the bytes check
            assert p["step_spread_s"]["n"] >= 5 and len(p["n1_s"]) == len(p["n2_s"]) >= 5
            assert p["tpot_s"] is None or p["tpot_s"] > 0
            assert p["min_step_s"] > 0 and isinstance(p["faster_than_bytes_allow"], bool)


@pytest.mark.slow
def test_fusedkv_serve_interrupted_keeps_the_finished_variants(tmp_path, monkeypatch, capsys):
    """A SIGINT (the stage's `timeout -s INT`) that lands while the second variant runs: the script
    returns normally with the first variant complete in a JSON marked partial, the second one not
    complete. The signal is raised from inside lite's run, so it always lands there (a signal sent
    from outside can arrive after a fast machine has finished both variants). --smoke without
    --out-dir writes into a fresh temp dir, never into benchmarks/results."""
    def results():
        return set(os.listdir(os.path.join(ROOT, "benchmarks", "results")))

    spec = importlib.util.spec_from_file_location(
        "serve_bench_under_test", os.path.join(ROOT, "benchmarks", "fusedkv", "serve_bench.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    real_run_variant = bench.run_variant

    def run_variant(args, variant, *rest):
        if variant == "lite":  # vanilla's JSON is on disk by now (saved after every variant)
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)  # the handler raises KeyboardInterrupt here, at the next bytecode
            raise AssertionError("SIGINT was not delivered")
        return real_run_variant(args, variant, *rest)

    monkeypatch.setattr(bench, "run_variant", run_variant)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    before = results()
    # the script relies on Python's default SIGINT handler; an earlier test in this process (a
    # server's shutdown hook) may have installed another one
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        bench.main(["--smoke", "--variants", "vanilla", "lite"])
    finally:
        signal.signal(signal.SIGINT, previous)
    text = capsys.readouterr().out
    assert "interrupted: writing" in text, text[-4000:]
    wrote = [line.split(" ", 1)[1] for line in text.splitlines() if line.startswith("wrote ")]
    assert wrote and all(w.startswith(str(tmp_path)) for w in wrote) and results() == before
    data = json.load(open(next(w for w in wrote if w.endswith(".json"))))
    assert all(w.rsplit(".", 1)[0].endswith("fusedkv_serve_tiny_cpu_vanilla_lite") for w in wrote)
    assert data["partial"] and data["rows"]["vanilla"]["complete"] and not data["rows"].get("lite", {}).get("complete")
    assert data["vs_vanilla"] == {}


@pytest.mark.heavy  # a benchmark's smoke run of over 10 s on 2 cores: CI leaves it out (README, Tests)
def test_fusedkv_tiers(tmp_path):
    out = run_bench("fusedkv/tiers.py", ["--smoke"], tmp_path)
    data = result(out, "fusedkv_tiers_tiny_cpu", ("rows", "params", "vanilla_fp16_bytes_per_token"), png=True)
    assert not data["partial"] and all(r["row_s"] > 0 for r in data["rows"])
    got = {(r["model"], r["kv_tier_budget"]): r for r in data["rows"]}
    assert sorted(got) == [("fusedkv", 0.5), ("fusedkv", 1.0), ("vanilla", 0.5), ("vanilla", 1.0)]
    assert all(r["full_prefix_hits"] for r in data["rows"])
    assert got[("fusedkv", 1.0)]["resident_vs_vanilla_fp16"] == 0.5
    assert got[("fusedkv", 0.5)]["resident_vs_vanilla_fp16"] < got[("fusedkv", 1.0)]["resident_vs_vanilla_fp16"]
    for r in data["rows"]:  # decode timing in the same engine: warm, >= 5 pairs, never negative
        d = r["decode"]
        assert d["step_spread_s"]["n"] >= 5 and (d["tpot_s"] is None or d["tpot_s"] > 0)
        k = d["kernels"]  # --kernel-breakdown (in --smoke): per-step time by operator on the CPU
        assert k["unit"] == "cpu_op" and k["busy_s"] > 0 and k["top_s"]
        assert abs(sum(k["groups_s"].values()) - k["busy_s"]) < 1e-9 * max(1.0, k["busy_s"]) + 1e-12


def test_kernel_groups():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from common.kernel_profile import kernel_group

    assert kernel_group("fusedkv_tiered_decode_kernel") == "fusedkv attention"
    assert kernel_group("_tiered_decode_splits") == "tiered attention"
    assert kernel_group("nvjet_hsh_128x64_64x4_1x2_h_bz_coopA_NNT") == "matmul"
    assert kernel_group("void at::native::(anonymous namespace)::cunn_SoftMaxForward") == "sampling / sort"
    assert kernel_group("triton_poi_fused_rms_norm_0") == "norm / rope / activation"
    assert kernel_group("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add>") == "elementwise"
    assert kernel_group("_one_launch_kernel") == "tiered attention"
    assert kernel_group("_tier_counts_kernel") == kernel_group("_tier_write_kernel") == "block tables"
    assert kernel_group("some_unknown_kernel") == "other"


@pytest.mark.heavy  # a benchmark's smoke run of over 10 s on 2 cores: CI leaves it out (README, Tests)
def test_fusedkv_capacity(tmp_path):
    out = run_bench("fusedkv/capacity.py", ["--smoke"], tmp_path)
    data = result(out, "fusedkv_capacity_tiny_cpu", ("rows", "params", "vs_vanilla", "copy_bandwidth_Bps"), png=True)
    rows = data["rows"]
    # equal pool bytes: the halved KV holds twice the tokens, and the scheduler admitted them all at once
    assert rows["fusedkv"]["pool_tokens"] == rows["lite"]["pool_tokens"] == 2 * rows["vanilla"]["pool_tokens"]
    assert all(r["held"] == r["planned"] for r in rows.values())
    assert data["vs_vanilla"]["fusedkv"]["held"] == data["vs_vanilla"]["lite"]["held"] == 2.0
    assert all(r["tpot_s"] is None or r["tpot_s"] > 0 for r in rows.values())


@pytest.mark.heavy  # a benchmark's smoke run of over 10 s on 2 cores: CI leaves it out (README, Tests)
@pytest.mark.slow
def test_scd_ttft(tmp_path):
    pytest.importorskip("sglang_router")
    pytest.importorskip("mooncake")
    from sgl_kvxfer.models.presets import write_dummy_tokenizer, write_preset_config

    model = write_dummy_tokenizer(write_preset_config("tiny", str(tmp_path / "tiny")), 512)
    out = run_bench("pd/scd_ttft.py", [
        "--prompts", "24", "--rates", "10", "--modes", "scd", "--vocab", "256",
        "--server-args", f"--model-path {model} --load-format dummy --device cpu --max-total-tokens 1024 "
                         "--log-level warning",
        "--producer-args", "--random-seed 1", "--consumer-args", "--random-seed 2"], tmp_path)
    data = result(out, "scd_ttft", ("oracle", "modes", "summary", "artifacts", "params"), png=True)
    row = data["modes"]["scd"]["10"]["24"]
    assert data["complete"] and row["consumer_ms"] > 0 and row["e2e_ms"] > 0
    # codes of 23 of the 24 positions: the manifest's bytes per token x 23 / 24
    assert row["bytes_per_token"] == pytest.approx(data["artifacts"]["bytes_per_token"] * 23 / 24)


@pytest.mark.slow
@pytest.mark.heavy  # minutes on 2 cores; CI runs -m "not heavy" (README, Tests)
def test_scd_e2e(tmp_path):
    pytest.importorskip("mooncake")
    from sgl_kvxfer.models.presets import write_dummy_tokenizer, write_preset_config

    model = write_dummy_tokenizer(write_preset_config("tiny", str(tmp_path / "tiny")), 512)
    out = run_bench("pd/scd_e2e.py", [
        "--prompt-tokens", "40", "--question-tokens", "8", "--fanouts", "1", "2", "--rates", "0", "25",
        "--repeats", "1", "--vocab", "256", "--rank-modes", "auto", "4:8", "--rank-repeats", "1",
        # the GPU run's pool family (head-major pages of 64) and a producer pool of 4 pages: its
        # radix cache evicts and its last page (slots past the pool's size) gets handed out
        "--producer-args", "--max-total-tokens 256", "--rank-producer-args", "--max-total-tokens 512",
        "--server-args", f"--model-path {model} --load-format dummy --device cpu --attention-backend torch "
                         "--page-size 64 --max-total-tokens 1024 --log-level warning"], tmp_path, timeout=1800)
    data = result(out, "scd_e2e", ("fanout", "shared", "summary", "artifacts", "params"), png=True)
    assert data["complete"]
    for n_fan in ("1", "2"):
        r = data["fanout"][n_fan]["40"]
        assert r["oracle"]["max_ms"] > 0 and r["scd@0"]["max_ms"] > 0 and r["scd@25"]["max_ms"] > 0
        # codes of 39 of the 40 positions
        assert r["scd@25"]["bytes_per_token"] == pytest.approx(data["artifacts"]["bytes_per_token"] * 39 / 40)
    assert data["shared"]["40"]["oracle"]["mean_ms"] > 0 and data["shared"]["40"]["scd@25"]["mean_ms"] > 0
    ranks = data["ranks"]["40"]
    assert ranks["auto"]["scd@25"]["mean_ms"] > 0 and ranks["4:8"]["scd@0"]["mean_ms"] > 0
    # the fixed 4:8 level sends fewer bytes than the top level the fan-outs used
    assert ranks["4:8"]["scd@25"]["bytes_per_token"] < data["fanout"]["1"]["40"]["scd@25"]["bytes_per_token"]
    assert sum(ranks["auto"]["level_counts"].values()) == 2 + 2  # warm-up and one request per rate
# ---------------------------------------------------------------------------- SpectrumKV retrieval test bed
@pytest.mark.heavy  # a benchmark's smoke run of over 5 s on 2 cores: CI leaves it out (README, Tests)
def test_cold_tier_decode(tmp_path):
    out = run_bench("throughput/cold_tier_decode.py", ["--preset", "tiny", "--context", "96", "--batch", "2",
                                                        "--n1", "2", "--n2", "4", "--repeats", "1", "--device", "cpu",
                                                        "--backend", "torch", "--intervals", "1",
                                                        "--forced-threshold", "0.001", "--score-only", "--uncapped",
                                                        "--kv-promote-max-tokens", "8"], tmp_path)
    data = result(out, "cold_tier_decode_tiny", ("modes", "pool_plan", "params", "server_info_cold_tier"), png=False)
    assert set(data["modes"]) == {"off", "on@1", "forced", "score@1", "uncapped@1"} and not data["partial"]
    assert data["params"]["kv_promote_max_tokens"] == 8 and data["engine_kwargs"]["kv_promote_max_tokens"] == 8
    assert data["modes"]["forced"]["counters"]["capped_tokens"] > 0  # a low bar: more than 8 a pass, cut
    assert data["modes"]["uncapped@1"]["counters"]["capped_tokens"] == 0
    score = data["modes"]["score@1"]["counters"]  # scoring without promotions
    assert score["scoring_passes"] > 0 and score["promotions"] == 0
    assert data["modes"]["off"]["counters"]["scoring_passes"] == 0
    assert data["modes"]["on@1"]["counters"]["scoring_passes"] > 0
    assert data["modes"]["forced"]["counters"]["promoted_tokens"] > 0  # dummy weights: a low bar fires
    assert "slowdown_min_over_min" in data["modes"]["on@1"]
    assert set(data["phases"]) == {"engine_start_s", "prefill_s", "warmup_s", "breakdown_s", "repeat_0_s"}
    assert data["reached"] == "done" and "stopped" not in data
    # one repeat of five asked for would be partial; here one of one ran, still under 5: flagged
    assert data["repeats_requested"] == 1 and data["repeats_ran"] == 1 and "1 of 1 repeats" in data["ratio_note"]
    assert data["modes"]["off"]["cached_tokens_min"] and len(data["modes"]["off"]["cached_tokens_min"][0]) == 2
    for mode in ("off", "on@1", "forced"):  # the synchronized breakdown: every decode step a forward
        row = data["breakdown"][mode]
        assert row["decode_steps"] >= 2 and row["calls"]["forward_decode"] == row["decode_steps"]
        assert row["retractions"] == 0 and "other" in row["seconds"]
        assert len(row["forward_decode_ms"]) == row["decode_steps"] <= len(row["scheduler_step_ms"])
    assert "cold_score" not in data["breakdown"]["off"]["seconds"]  # scoring is off in `off`
    assert data["breakdown"]["on@1"]["calls"]["cold_score"] >= 1
    pieces = data["breakdown"]["forced"]["cold_parts"]  # the pass's pieces, inside its time
    assert pieces["cold_score.rows"] > 0 and pieces["cold_score.mass"] > 0 and pieces["cold_score.select"] > 0
    assert sum(v for k, v in pieces.items() if k.startswith("cold_score.")) <= data["breakdown"]["forced"]["seconds"]["cold_score"]
    assert not data["breakdown"]["off"]["cold_parts"]
    assert pieces["copy_worker.job"] >= pieces["copy_worker.gather"] > 0  # the promotions' copy jobs, timed apart


@pytest.mark.heavy  # a benchmark's smoke run of over 10 s on 2 cores: CI leaves it out (README, Tests)
def test_cold_tier_decode_time_budget(tmp_path):
    """A budget the first repeat already overruns: that repeat is kept, the rest not started."""
    out = run_bench("throughput/cold_tier_decode.py", ["--preset", "tiny", "--context", "64", "--batch", "2",
                                                        "--n1", "2", "--n2", "4", "--repeats", "3", "--device", "cpu",
                                                        "--backend", "torch", "--intervals", "1",
                                                        "--time-budget-s", "0.001"], tmp_path)
    data = result(out, "cold_tier_decode_tiny", ("modes", "phases"), png=False)
    assert data["partial"] and data["stopped"] == "time budget" and data["reached"] == "done"
    assert set(data["modes"]) == {"off", "on@1"} and all(r["repeats"] == 1 for r in data["modes"].values())
    assert data["repeats_requested"] == 3 and data["repeats_ran"] == 1 and "1 of 3 repeats" in data["ratio_note"]
    assert data["breakdown_stopped"] == "time budget" and data["breakdown"] == {}


def test_cold_tier_decode_interrupted_keeps_the_phases(tmp_path, monkeypatch, capsys):
    """A SIGINT (the stage's `timeout -s INT`) in the warm-up, before any repeat: the script returns
    with a JSON holding the phases it finished (engine start, prefill), marked partial."""
    spec = importlib.util.spec_from_file_location(
        "cold_tier_decode_under_test", os.path.join(ROOT, "benchmarks", "throughput", "cold_tier_decode.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    real = bench.timed_generate
    calls = []

    def timed_generate(engine, prompts, n):
        calls.append(n)
        if len(calls) == 2:  # the first warm-up call; the prefill (n = 1) has finished
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)  # the handler raises KeyboardInterrupt here, at the next bytecode
            raise AssertionError("SIGINT was not delivered")
        return real(engine, prompts, n)

    monkeypatch.setattr(bench, "timed_generate", timed_generate)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        path = bench.main(["--preset", "tiny", "--context", "64", "--batch", "2", "--n1", "2", "--n2", "4",
                           "--device", "cpu", "--backend", "torch", "--intervals", "1", "--out-dir",
                           str(tmp_path / "out")])
    finally:
        signal.signal(signal.SIGINT, previous)
    assert "interrupted in warm-up" in capsys.readouterr().out
    data = json.load(open(path))
    assert data["partial"] and data["reached"] == "warm-up" and data["modes"] == {}
    assert set(data["phases"]) == {"engine_start_s", "prefill_s"} and data["prefill_s"] > 0


@pytest.mark.slow
@pytest.mark.heavy  # minutes on 2 cores; CI runs -m "not heavy" (README, Tests)
def test_retrieval_tiers(tmp_path):
    from tiny_models import tiny_task_model

    model = tiny_task_model(tmp_path)
    out = run_bench("quality/retrieval_tiers.py", ["--quick", "--model", model, "--device", "cpu", "--dtype",
                                                    "float32", "--context", "160", "--long-context", "0",
                                                    "--budgets", "0.3", "--val-budgets", "0.3",
                                                    "--methods", "greedy", "per-layer", "kivi", "cold-tier",
                                                    "spectrumkv-torch", "--promote-drop-run", "4",
                                                    "--promote-max-tokens", "64", "--ppl-context", "96", "--ppl-chunk", "16", "--profile-batch", "2"],
                    tmp_path, timeout=1800)
    data = result(out, "retrieval_tiers_", ("fp16", "rows", "lambda_sweep", "threshold_sweep", "layer_profile",
                                            "summary", "chosen_lambda", "chosen_threshold"), png=True)
    assert data["complete"] and {r["method"] for r in data["rows"]} == {"greedy", "per-layer", "kivi", "cold-tier",
                                                                        "spectrumkv-torch"}
    cold = [r for r in data["rows"] if r["method"] == "cold-tier"][0]["cold"]
    assert cold["restored_dropped"] >= 0 and cold["restored_dropped_bytes_h2d"] >= 0
    for row in data["rows"]:
        assert len(row["by_depth"]) == len(data["params"]["depths"]) and row["byte_ratio"] <= 0.3 + 1e-6
        assert row["backend"] == "torch" and row["trials"] == len(data["params"]["depths"])
    # every accuracy ties at this size, so lambda 0 is chosen: spectrumkv-torch's settings are greedy's
    assert data["chosen_lambda"] == 0
    same = [r for r in data["rows"] if r["method"] == "spectrumkv-torch"][0]
    assert same["same_as"] == "greedy" and same["by_depth"] == [r for r in data["rows"] if r["method"] == "greedy"][0][
        "by_depth"]
    assert all("same_as" not in r and r["trials_s"] >= 0 for r in data["rows"] if r["method"] != "spectrumkv-torch")
    assert any(n.startswith("layer_profile_") for n in os.listdir(out))
    for row in data["rows"]:  # kv items: every trial's asked line found and its tier read
        assert sum(row["needle_tier_counts"]) == row["trials"] and row["ci95"][0] <= row["accuracy"] <= row["ci95"][1]
    # a second call continues the JSON: only the new points run, the same trials, lambda and profile
    first = [n for n in os.listdir(out) if n.startswith("retrieval_tiers_") and n.endswith(".json")][0]
    (tmp_path / "resumed").mkdir()
    out2 = run_bench("quality/retrieval_tiers.py", ["--quick", "--model", model, "--device", "cpu", "--dtype",
                                                    "float32", "--context", "160", "--long-context", "0",
                                                    "--budgets", "0.3", "0.2", "--val-budgets", "0.3",
                                                    "--methods", "greedy", "random-tier",
                                                    "--ppl-context", "96", "--ppl-chunk", "16", "--profile-batch", "2",
                                                    "--resume", os.path.join(out, first)],
                     tmp_path / "resumed", timeout=1800)
    data2 = result(out2, "retrieval_tiers_", ("fp16", "rows", "summary", "earlier_calls"), png=True)
    got = [(r["method"], r["budget"]) for r in data2["rows"]]
    assert sorted(got) == sorted({(m, 0.3) for m in ("greedy", "per-layer", "kivi", "cold-tier", "spectrumkv-torch")}
                                 | {("greedy", 0.2), ("random-tier", 0.3), ("random-tier", 0.2)})
    assert data2["fp16"] == data["fp16"] and data2["chosen_lambda"] == data["chosen_lambda"]
    assert set(data2["summary"]) >= {"0.3", "0.2"} and "best_vs_random_discordant" in data2["summary"]["0.3"]


@pytest.mark.heavy  # a benchmark's smoke run of over 5 s on 2 cores: CI leaves it out (README, Tests)
def test_fusedkv_distill_step(tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "test", "fusedkv"))
    from fkv_tiny import tiny_model_dir

    model = tiny_model_dir(tmp_path / "tiny", vocab=512)
    out = run_bench("fusedkv/distill_step.py", ["--device", "cpu", "--model", model, "--batches", "1", "2", "--seq", "16",
                                                "--modes", "eager", "--steps-per-repeat", "1", "--matmul-n", "128"],
                    tmp_path)
    data = result(out, "fusedkv_distill_step_tiny_cpu", ("rows", "params", "matmul_tflops", "best"), png=True)
    rows = data["rows"]
    assert [(r["mode"], r["batch"]) for r in rows] == [("eager", 1), ("eager", 2)]
    for r in rows:  # warm repeats >= 5 with their spread; the roofline never exceeds 1
        assert len(r["step_ms"]) == 5 and r["min_ms"] <= r["median_ms"] <= r["max_ms"]
        assert r["tokens_per_step"] == r["batch"] * 16 and 0 < r["fraction_of_matmul_rate"] <= 1


@pytest.mark.heavy  # a benchmark's smoke run of over 5 s on 2 cores: CI leaves it out (README, Tests)
def test_sampler(tmp_path):
    out = run_bench("throughput/sampler.py", ["--device", "cpu", "--vocab", "512", "--batches", "1", "8",
                                               "--calls", "2"], tmp_path)
    data = result(out, "sampler_cpu", ("rows", "params", "copy_gbps"), png=True)
    rows = data["rows"]
    assert [(r["method"], r["batch"]) for r in rows] == [("batched", 1), ("per_row", 1), ("batched", 8), ("per_row", 8)]
    for r in rows:  # warm repeats >= 5 with their spread, never under the byte floor
        assert len(r["samples_ms"]) == 5 and r["min_ms"] <= r["median_ms"] <= r["max_ms"]
        assert r["min_ms"] >= r["byte_floor_ms"] > 0
    assert all(r["per_row_over_batched"] > 0 for r in rows if r["method"] == "batched")
