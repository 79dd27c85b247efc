"""Online serving benchmark: start an sgl_kvxfer server, drive it with SGLang's own
`python -m sglang.bench_serving --backend sglang --dataset-name random-ids` at several request
rates, and record TTFT / ITL / throughput per rate.

    python benchmarks/throughput/serving.py                       # embedded SmolLM2, CPU-sized
    python benchmarks/throughput/serving.py --num-prompts 200 --input-len 512 --output-len 128 \
        --server-args "--model-path /models/llama-8b"

Writes benchmarks/results/serving_<device-tag>_<utc>.json (+ .png when matplotlib is present)
with the device, commit and every parameter. bench_serving runs in this environment
(benchmarks/common/sglang_clients.py).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common.report import device_name, git_commit  # noqa: E402
from common.sglang_clients import bench_serving_command, bench_serving_env  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
METRICS = ("completed", "duration", "request_throughput", "output_throughput", "total_throughput",
           "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_itl_ms", "median_itl_ms", "p99_itl_ms",
           "mean_tpot_ms", "mean_e2e_latency_ms", "max_output_tokens_per_s", "concurrency")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str):
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def start_server(port: int, server_args: list[str], log_path: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "sgl_kvxfer.launch_server", "--port", str(port), "--log-level", "warning", *server_args]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=open(log_path, "w"), stderr=subprocess.STDOUT,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    deadline = time.time() + 900
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited ({proc.returncode}); see {log_path}")
        try:
            get_json(f"http://127.0.0.1:{port}/v1/models")
            return proc
        except OSError:
            time.sleep(1)
    proc.send_signal(signal.SIGTERM)
    raise RuntimeError(f"server did not start; see {log_path}")


def on_gpu(server_info: dict) -> bool:
    if str(server_info.get("device", "auto")) == "cpu":
        return False
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def run_rate(args, base_url: str, model_dir: str, rate: str, workdir: str) -> dict:
    out_file = os.path.join(workdir, f"rate_{rate}.jsonl")
    cmd = bench_serving_command(
        "--backend", "sglang", "--base-url", base_url, "--tokenizer", model_dir, "--model", model_dir,
        "--dataset-name", "random-ids", "--random-input-len", str(args.input_len),
        "--random-output-len", str(args.output_len), "--random-range-ratio", "1.0",
        "--num-prompts", str(args.num_prompts), "--request-rate", rate, "--max-concurrency", str(args.max_concurrency),
        "--seed", "1", "--disable-tqdm", "--output-file", out_file)
    proc = subprocess.run(cmd, cwd=workdir, env=bench_serving_env(), capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"bench_serving failed at rate {rate}:\n{(proc.stdout + proc.stderr)[-3000:]}")
    with open(out_file) as f:
        raw = json.loads(f.readlines()[-1])
    row = {"request_rate": rate, **{k: raw.get(k) for k in METRICS}}
    row["failed"] = args.num_prompts - (raw.get("completed") or 0)
    print(f"rate={rate:>4}  ok={row['completed']}/{args.num_prompts}  out_tok/s={row['output_throughput']:.2f}  "
          f"ttft={row['mean_ttft_ms']:.0f}ms  itl={row['mean_itl_ms']:.0f}ms", flush=True)
    return row


def plot(rows: list[dict], path: str, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    labels = [r["request_rate"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, key, name in zip(axes, ("output_throughput", "mean_ttft_ms", "mean_itl_ms"),
                             ("output tokens/s", "mean TTFT (ms)", "mean ITL (ms)")):
        ax.bar(labels, [r[key] or 0 for r in rows], color="#4477aa")
        ax.set_xlabel("request rate (req/s)")
        ax.set_title(name)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", default="1,4,16,inf")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--max-concurrency", type=int, default=16)
    p.add_argument("--server-args", default="--max-total-tokens 16384 --chunked-prefill-size 512")
    p.add_argument("--base-url", default=None, help="use a running server instead of starting one")
    p.add_argument("--out", default=None)
    args = p.parse_args()

    os.makedirs(RESULTS, exist_ok=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    workdir = os.path.join(RESULTS, f".serving_{stamp}.tmp")
    os.makedirs(workdir, exist_ok=True)
    proc = None
    if args.base_url is None:
        port = free_port()
        proc = start_server(port, shlex.split(args.server_args), os.path.join(RESULTS, f"serving_{stamp}.log"))
        base_url = f"http://127.0.0.1:{port}"
    else:
        base_url = args.base_url.rstrip("/")
    try:
        info = get_json(base_url + "/server_info")
        rows = [run_rate(args, base_url, info["model_path"], rate, workdir) for rate in args.rates.split(",")]
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    gpu = on_gpu(info)
    device = device_name("cuda" if gpu else "cpu")
    tag = device.split()[-1].lower() if gpu else "cpu"
    result = {
        "benchmark": "serving", "tool": "sglang.bench_serving 0.5.23 --backend sglang --dataset-name random-ids",
        "device": device, "commit": git_commit(), "utc": stamp, "model_path": info.get("model_path"),
        "parameters": {k: getattr(args, k) for k in ("num_prompts", "input_len", "output_len", "max_concurrency",
                                                      "server_args", "rates")},
        "server": {k: info.get(k) for k in ("max_total_num_tokens", "chunked_prefill_size", "max_running_requests",
                                            "context_length", "attention_backend", "dtype", "page_size")},
        "results": rows,
    }
    out = args.out or os.path.join(RESULTS, f"serving_{tag}_{stamp}.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
    png = out[:-5] + ".png"
    if plot(rows, png, f"sgl_kvxfer serving | {device} | {os.path.basename(str(info.get('model_path')))}"):
        print("wrote", png)
    print("wrote", out)
    for name in os.listdir(workdir):
        os.remove(os.path.join(workdir, name))
    os.rmdir(workdir)


if __name__ == "__main__":
    main()
