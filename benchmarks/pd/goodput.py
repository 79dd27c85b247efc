"""Goodput under load: one prefill + one decode server against two co-located servers, the same
two devices, `sglang.bench_serving` through the real sglang-router at a sweep of request rates.

    python benchmarks/pd/goodput.py --tokenizer DIR [--rates 2 4 8] [--input-len 4096]
        [--output-len 256] [--range-ratio 0.5] [--seconds-per-rate 5] [--min-prompts 8]
        [--slo-ttft-p99-ms 2000] [--slo-itl-p99-ms 60] [--server-args "..."]
        [--gpu-args "--base-gpu-id 0" "--base-gpu-id 1"] [--deadline-s S] [--out-dir DIR]

Setups, all started at once (each device holds one server of each) and swept over the rates in
turn (Poisson arrivals, `--request-rate R`; one setup serves at a time, the other idles):

    pd          a prefill server on the first device and a decode server on the second, behind
                `launch_router --pd-disaggregation`
    colocated   a plain server on each device, behind `launch_router --worker-urls A B
                --policy round_robin`

The workload is bench_serving's `random-ids`: prompts of `--input-len` tokens and outputs of
`--output-len`, each uniform in [ratio * len, len] (`--range-ratio`), so long prompts arrive
among requests still generating long outputs; `ignore_eos` keeps every output at its length.
Each rate sends max(`--min-prompts`, rate * `--seconds-per-rate`) requests after one warm-up.

Reported per setup and rate: completed requests, request throughput, TTFT and ITL p50 / p99.
The SLO (stated in the JSON): TTFT p99 <= `--slo-ttft-p99-ms` and ITL p99 <= `--slo-itl-p99-ms`
with every request completed. `max_rate_within_slo` is the highest swept rate a setup holds.
On one device pair the two setups get the same hardware; PD spends one device on prefill only.

`--deadline-s S` ends the run by S seconds after it starts (a stage limit, less the time to stop
the servers): each bench_serving run gets at most the time left, a rate starts only while the time
left covers the longest run so far (every rate spans about `--seconds-per-rate` of arrivals), and
the JSON keeps every finished rate with the rest marked `skipped` (`complete` stays false).
An interrupt (SIGINT from `timeout -s INT`) ends the same way: finished rates kept, servers stopped.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common.report import device_name, git_commit, write_json  # noqa: E402
from common.sglang_clients import bench_serving_command, bench_serving_env  # noqa: E402

from sgl_kvxfer.testing.servers import free_port, start_router, start_server, stop_all  # noqa: E402

METRICS = ("completed", "request_throughput", "median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms",
           "mean_e2e_latency_ms", "output_throughput", "duration")


def start_setup(setup: str, args) -> list:
    """The setup's servers and router (router last); every handle is stopped on failure."""
    base = shlex.split(args.server_args)
    gpu = [shlex.split(g) for g in args.gpu_args]
    handles = []
    try:
        with ThreadPoolExecutor(2) as pool:
            if setup == "pd":
                bp = free_port()
                futures = [pool.submit(start_server, base + gpu[0] + ["--disaggregation-mode", "prefill",
                                                                      "--disaggregation-bootstrap-port", str(bp)],
                                       name="goodput_prefill"),
                           pool.submit(start_server, base + gpu[1] + ["--disaggregation-mode", "decode"],
                                       name="goodput_decode")]
            else:
                futures = [pool.submit(start_server, base + g, name=f"goodput_colocated{i}") for i, g in enumerate(gpu)]
            for f in futures:
                handles.append(f.result())
        if setup == "pd":
            handles.append(start_router([(handles[0].url, bp)], [handles[1].url], policy="round_robin",
                                        name="goodput_router"))
        else:
            handles.append(start_router([], [], policy="round_robin", name="goodput_router",
                                        workers=[h.url for h in handles]))
        return handles
    except BaseException:
        stop_all(*reversed(handles))
        raise


def bench(router_url: str, rate: float, args, out_file: str, timeout: float) -> dict:
    """One bench_serving run at `rate` cut after `timeout` s; its result line (the metrics above),
    an error, or `skipped` (cut at the timeout)."""
    n = max(args.min_prompts, round(rate * args.seconds_per_rate))
    cmd = bench_serving_command(
        "--backend", "sglang", "--base-url", router_url, "--tokenizer", args.tokenizer, "--model", args.tokenizer,
        "--dataset-name", "random-ids", "--random-input-len", str(args.input_len),
        "--random-output-len", str(args.output_len), "--random-range-ratio", str(args.range_ratio),
        "--num-prompts", str(n), "--request-rate", str(rate), "--warmup-requests", "1", "--seed", str(args.seed),
        "--output-file", out_file, "--disable-tqdm")
    if os.path.exists(out_file):
        os.unlink(out_file)
    try:
        proc = subprocess.run(cmd, env=bench_serving_env(), capture_output=True, text=True, timeout=timeout,
                              cwd=os.path.dirname(out_file))
    except subprocess.TimeoutExpired:  # run() killed bench_serving: the rate did not finish
        return {"skipped": f"bench_serving cut after {timeout:.0f} s", "num_prompts": n}
    if proc.returncode != 0 or not os.path.exists(out_file):
        return {"error": f"bench_serving exit {proc.returncode}: {(proc.stdout + proc.stderr)[-1500:]}"}
    with open(out_file) as f:
        line = f.read().strip().splitlines()[-1]
    result = json.loads(line)
    row = {k: result.get(k) for k in METRICS}
    row["num_prompts"] = n
    return row


def measured(row: dict) -> bool:
    return "error" not in row and "skipped" not in row


def within_slo(row: dict, args) -> bool:
    return (measured(row) and row["completed"] == row["num_prompts"]
            and row["p99_ttft_ms"] <= args.slo_ttft_p99_ms and row["p99_itl_ms"] <= args.slo_itl_p99_ms)


def plot(payload: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    slo = payload["slo"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for setup, rows in payload["setups"].items():
        pts = sorted((float(r), row) for r, row in rows.items() if measured(row))
        if not pts:
            continue
        xs = [r for r, _ in pts]
        line = axes[0].plot(xs, [row["p99_ttft_ms"] for _, row in pts], "o-", label=f"{setup} p99")[0]
        axes[0].plot(xs, [row["median_ttft_ms"] for _, row in pts], "x--", color=line.get_color(), label=f"{setup} p50")
        axes[1].plot(xs, [row["p99_itl_ms"] for _, row in pts], "o-", color=line.get_color(), label=f"{setup} p99")
        axes[1].plot(xs, [row["median_itl_ms"] for _, row in pts], "x--", color=line.get_color(), label=f"{setup} p50")
        axes[2].plot(xs, [row["request_throughput"] for _, row in pts], "o-", color=line.get_color(), label=setup)
    axes[0].axhline(slo["ttft_p99_ms"], ls=":", color="gray", label="SLO")
    axes[1].axhline(slo["itl_p99_ms"], ls=":", color="gray", label="SLO")
    for ax, title, yl in zip(axes, ("TTFT", "inter-token latency", "completed requests / s"), ("ms", "ms", "req/s")):
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(yl)
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)
    axes[0].set_yscale("log")
    fig.suptitle(f"PD (1 prefill + 1 decode) vs co-located (2 servers), {payload['device']}: "
                 f"max rate within SLO {payload['max_rate_within_slo']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokenizer", required=True, help="tokenizer dir for bench_serving (the served model's)")
    ap.add_argument("--server-args", default="--dtype bfloat16 --max-total-tokens 40000", help="every server's arguments")
    ap.add_argument("--gpu-args", nargs=2, default=["", ""], metavar=("FIRST", "SECOND"),
                    help="per-device arguments: PD's prefill / decode, the co-located servers")
    ap.add_argument("--setups", nargs="+", default=["pd", "colocated"], choices=["pd", "colocated"])
    ap.add_argument("--rates", type=float, nargs="+", default=[2, 4, 8], help="request rates (req/s)")
    ap.add_argument("--input-len", type=int, default=4096)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--range-ratio", type=float, default=0.5, help="lengths uniform in [ratio * len, len]")
    ap.add_argument("--seconds-per-rate", type=float, default=5.0, help="arrivals per rate: rate * this many seconds")
    ap.add_argument("--min-prompts", type=int, default=8)
    ap.add_argument("--slo-ttft-p99-ms", type=float, default=2000.0)
    ap.add_argument("--slo-itl-p99-ms", type=float, default=60.0)
    ap.add_argument("--bench-timeout", type=float, default=600.0, help="seconds one bench_serving run may take")
    ap.add_argument("--deadline-s", type=float, default=0.0,
                    help="end by this many seconds after start: later rates are skipped (0: no deadline)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--name", default="goodput")
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args()
    if min(args.rates) <= 0 or args.input_len < 1 or args.output_len < 1 or not 0 <= args.range_ratio <= 1:
        ap.error("--rates, --input-len and --output-len must be positive, --range-ratio in [0, 1]")
    if args.min_prompts < 1 or args.seconds_per_rate <= 0 or args.slo_ttft_p99_ms <= 0 or args.slo_itl_p99_ms <= 0:
        ap.error("--min-prompts, --seconds-per-rate and the SLOs must be positive")
    if not 0 < args.bench_timeout < float("inf") or not 0 <= args.deadline_s < float("inf"):
        ap.error("--bench-timeout must be positive and --deadline-s >= 0 (both finite)")
    device = "cuda" if "cuda" in args.server_args else "cpu"
    start = time.time()
    payload = {"benchmark": "goodput", "device": device_name(device), "commit": git_commit(), "params": vars(args),
               "slo": {"ttft_p99_ms": args.slo_ttft_p99_ms, "itl_p99_ms": args.slo_itl_p99_ms,
                       "all_completed": True},
               "setups": {}, "max_rate_within_slo": {}, "complete": False}

    def save() -> str:
        for setup, rows in payload["setups"].items():
            held = [float(r) for r, row in rows.items() if within_slo(row, args)]
            payload["max_rate_within_slo"][setup] = max(held, default=None)
        payload["seconds"] = time.time() - start
        path = write_json(args.name, payload, args.out_dir)
        plot(payload, path[:-5] + ".png")  # rewritten after every rate: a run cut short keeps both
        return path

    def time_left() -> float:
        return args.deadline_s - (time.time() - start) if args.deadline_s else float("inf")

    def skip_rest(reason: str) -> None:
        for rate in args.rates:
            for setup in args.setups:
                payload["setups"].setdefault(setup, {}).setdefault(f"{rate:g}", {"skipped": reason})

    handles: dict[str, list] = {}
    longest = 0.0  # the longest bench_serving run so far (s)
    try:
        with ThreadPoolExecutor(len(args.setups)) as pool:  # both setups load at once; one runs at a time
            futures = {setup: pool.submit(start_setup, setup, args) for setup in args.setups}
            errors = []
            for setup, f in futures.items():
                try:
                    handles[setup] = f.result()
                except Exception as e:  # noqa: BLE001 (the others still get stopped below)
                    errors.append(e)
            if errors:
                raise errors[0]
        with tempfile.TemporaryDirectory(prefix="goodput_") as tmp:
            for rate in args.rates:  # rates outside: a run cut short keeps both setups' low rates
                for setup in args.setups:
                    left = time_left()
                    if left < max(longest, 1.0):
                        row = {"skipped": f"--deadline-s {args.deadline_s:g}: {max(left, 0):.0f} s left, "
                                          f"the longest run so far took {longest:.0f} s"}
                    else:
                        t0 = time.time()
                        row = bench(handles[setup][-1].url, rate, args, os.path.join(tmp, f"{setup}_{rate:g}.jsonl"),
                                    min(args.bench_timeout, left))
                        longest = max(longest, time.time() - t0)
                    payload["setups"].setdefault(setup, {})[f"{rate:g}"] = row
                    print(f"{setup:>10} rate {rate:g}: {json.dumps(row)[:400]}", flush=True)
                    save()
    except KeyboardInterrupt:  # the stage's limit: keep what finished, stop the servers below
        print("interrupted: the rates not finished are marked skipped", flush=True)
        skip_rest("interrupted")
    finally:
        for hs in handles.values():
            stop_all(*reversed(hs))
    skip_rest("not run")  # no-op unless a rate was left out above
    payload["complete"] = not any("skipped" in row for rows in payload["setups"].values() for row in rows.values())
    path = save()
    print("max rate within SLO:", payload["max_rate_within_slo"])
    print("wrote", path)


if __name__ == "__main__":
    main()
