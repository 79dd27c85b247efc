"""Online serving benchmark: start an sgl_kvxfer server, drive it with SGLang's own
`python -m sglang.bench_serving --backend sglang --dataset-name random-ids` at several request
rates, and record TTFT / ITL / throughput per rate.

    python benchmarks/throughput/serving.py                       # embedded SmolLM2, CPU-sized
    python benchmarks/throughput/serving.py --num-prompts 200 --input-len 512 --output-len 128 \
        --server-args "--model-path /models/llama-8b"

    python benchmarks/throughput/serving.py --rates inf --num-prompts 4 --input-len 16 --output-len 4 \
        --server-args "--device cpu --dtype float32 --max-total-tokens 2048" --out-dir /tmp/x   # smoke run

Writes OUT_DIR/serving_<device-tag>_<utc>.json (default benchmarks/results; `--out PATH` names
the file instead) and a .png beside it when matplotlib is present, with the device, commit,
command and every parameter. The server runs as sgl_kvxfer.testing.servers starts it (log in
the temp folder, removed after a clean run; on exit every process of the server is stopped).
bench_serving runs in this environment (benchmarks/common/sglang_clients.py).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import subprocess
import sys
import tempfile
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common.report import RESULTS_DIR, device_name, git_commit, write_json  # noqa: E402
from common.sglang_clients import bench_serving_command, bench_serving_env  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
METRICS = ("completed", "duration", "request_throughput", "output_throughput", "total_throughput",
           "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_itl_ms", "median_itl_ms", "p99_itl_ms",
           "mean_tpot_ms", "mean_e2e_latency_ms", "max_output_tokens_per_s", "concurrency")


def get_json(url: str):
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


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
    p.add_argument("--out-dir", default=RESULTS_DIR, help="where the JSON and PNG go")
    p.add_argument("--out", default=None, help="the JSON's path (overrides --out-dir)")
    args = p.parse_args()

    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    server = None
    with tempfile.TemporaryDirectory(prefix="serving_") as workdir:
        try:
            if args.base_url is None:
                from sgl_kvxfer.testing.servers import start_server

                server = start_server(["--log-level", "warning", *shlex.split(args.server_args)], name="serving",
                                      cwd=ROOT)
                base_url = server.url
            else:
                base_url = args.base_url.rstrip("/")
            info = get_json(base_url + "/server_info")
            rows = [run_rate(args, base_url, info["model_path"], rate, workdir) for rate in args.rates.split(",")]
        except BaseException:
            if server is not None:
                print(f"server log ({server.log_path}):\n{server.log()}", file=sys.stderr)
            raise
        finally:
            if server is not None:
                left = server.stop()
                if left:
                    print(f"killed server processes that outlived SIGTERM: {left}", file=sys.stderr)
    gpu = on_gpu(info)
    device = device_name("cuda" if gpu else "cpu")
    tag = device.split()[-1].lower() if gpu else "cpu"
    result = {
        "benchmark": "serving", "tool": "sglang.bench_serving 0.5.23 --backend sglang --dataset-name random-ids",
        "device": device, "commit": git_commit(), "utc": stamp, "model_path": info.get("model_path"),
        "parameters": {k: getattr(args, k) for k in ("num_prompts", "input_len", "output_len", "max_concurrency",
                                                      "server_args", "rates", "base_url")},
        "server": {k: info.get(k) for k in ("max_total_num_tokens", "chunked_prefill_size", "max_running_requests",
                                            "context_length", "attention_backend", "dtype", "page_size")},
        "results": rows,
    }
    if args.out:
        out_dir, name = os.path.dirname(os.path.abspath(args.out)), os.path.basename(args.out)
        name = name[: -len(".json")] if name.endswith(".json") else name
    else:
        out_dir, name = args.out_dir, f"serving_{tag}_{stamp}"
    out = write_json(name, result, out_dir)
    png = out[: -len(".json")] + ".png"
    if plot(rows, png, f"sgl_kvxfer serving | {device} | {os.path.basename(str(info.get('model_path')))}"):
        print("wrote", png)
    print("wrote", out)


if __name__ == "__main__":
    main()
