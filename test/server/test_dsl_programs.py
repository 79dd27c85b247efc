"""Real SGLang clients against a real server: every `python/` frontend-DSL program, and
`python -m sglang.bench_serving --backend sglang --dataset-name random-ids`
(benchmarks/common/sglang_clients.py says how it runs)."""
import importlib
import os
import re
import subprocess
import sys

import pytest
import requests
from servers import ROOT

pytestmark = pytest.mark.slow
sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from common.sglang_clients import bench_serving_command, bench_serving_env  # noqa: E402


def run_program(name, url):
    return importlib.import_module(name).main(url)


def test_qa_gen_honours_max_tokens_and_stop(live_server):
    out = run_program("qa_gen", live_server.url)
    assert out["answer"].strip() and "\n" not in out["answer"]
    assert out["landmark_tokens"] <= 6


def test_select_picks_a_choice(live_server):
    out = run_program("select_choice", live_server.url)
    assert out["city"] in out["choices"]
    assert out["city"] == "Paris"


def test_multi_turn_chat(live_server):
    out = run_program("multi_turn_chat", live_server.url)
    assert len(out["answers"]) == 2 and all(a.strip() for a in out["answers"])
    assert out["num_messages"] == 5


def test_fork_parallel(live_server):
    out = run_program("fork_parallel", live_server.url)
    assert set(out["examples"]) == {"fruit", "animal", "color"}
    assert all("." not in v and "\n" not in v for v in out["examples"].values())


def test_shared_prefix_fanout(live_server):
    out = run_program("shared_prefix_fanout", live_server.url)
    assert len(out["answers"]) == out["num_prompts"] and all("\n" not in a for a in out["answers"])
    assert max(out["cached_tokens"]) > 0, "the shared prefix should be served from the prefix cache"


def test_stream_gen(live_server):
    out = run_program("stream_gen", live_server.url)
    assert out["pieces"] > 1 and out["streamed"] == out["final"] and out["final"].strip()


def test_bench_serving_random_ids(live_server, tmp_path):
    model_dir = requests.get(live_server.url + "/get_model_info").json()["model_path"]
    out_file = tmp_path / "bench.jsonl"
    cmd = bench_serving_command(
        "--backend", "sglang", "--base-url", live_server.url, "--tokenizer", model_dir, "--model", model_dir,
        "--dataset-name", "random-ids", "--random-input-len", "32", "--random-output-len", "8",
        "--random-range-ratio", "1.0", "--num-prompts", "50", "--request-rate", "inf", "--max-concurrency", "16",
        "--disable-tqdm", "--output-file", str(out_file))
    proc = subprocess.run(cmd, cwd=str(tmp_path), env=bench_serving_env(), capture_output=True, text=True,
                          timeout=1200)
    report = proc.stdout + proc.stderr
    print(report[-3000:])
    assert proc.returncode == 0, report[-3000:]
    assert re.search(r"Successful requests:\s+50\b", report), report[-3000:]
    throughput = float(re.search(r"Output token throughput \(tok/s\):\s+([\d.]+)", report).group(1))
    assert throughput > 0
