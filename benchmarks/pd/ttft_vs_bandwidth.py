"""TTFT and KV transfer time through the real sglang-router vs link rate, prompt length and tier budget.

    python benchmarks/pd/ttft_vs_bandwidth.py [--prompts 2000 4000 8000] [--budgets 1.0 0.5 0.3]
        [--rates 1 10 25 100] [--variant-rates 10] [--repeats 1] [--server-args "..."] [--out-dir DIR]

For each budget b, a single non-disaggregated server at b is the baseline. Then a prefill server
with a shaped link (`--kv-transfer-rate-gbps`, see shaped_link.py), a decode server and
`sglang_router.launch_router --pd-disaggregation` start, and for each link rate R (set on the
prefill with POST /kv_transfer_link) each prompt (random token ids, so nothing hits a radix
cache) goes through the router once per repeat, streamed: TTFT is the time to the first
streamed chunk. The decode's `meta_info.kv_transfer` gives the bytes on the
wire, `wire_ms` (the link's busy time: summed write times) and `tail_ms` (prompt done -> last
write: the transfer the prefill's compute did not hide). At b < 1 the default stream variant
("end": tiers assigned at prefill end, everything sent then) runs at every rate, and the "int8"
variant (chunks sent at int8 as they finish, the kept-fp16/int8 tokens re-sent at the end) at
`--variant-rates`.

Ratios (same run): link efficiency = achieved / set rate at the longest prompt; transfer time at
b vs b=1.0 (wire_ms); TTFT at b vs b=1.0 through PD; PD TTFT vs the single server.

`--server-args` is passed to every server (default: the embedded SmolLM2 in bf16 on CPU, int4
tier on without the start-up probe). Each server first serves one prompt of every length, so
kernel compiles stay out of the numbers. On one GPU, with a Llama-3-8B-shaped dummy model dir
(`models/presets.py`: write_preset_config + write_dummy_tokenizer):
`--server-args "--model-path DIR --load-format dummy --dtype bfloat16 --device cuda
--mem-fraction-static 0.6 --max-total-tokens 40000 --disable-cuda-graph --kv-int4 on"` runs
both PD servers (and the baseline) on it; KV moves over Mooncake TCP through host memory.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import shlex
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import requests

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common.report import device_name, git_commit, write_json  # noqa: E402

from sgl_kvxfer.testing.servers import free_port, start_router, start_server, stop_all  # noqa: E402

DEFAULT_SERVER_ARGS = "--dtype bfloat16 --max-total-tokens 40000 --kv-int4 on"  # int4 on: no start-up probe
MAX_NEW_TOKENS = 4


def prompt_ids(length: int, seed: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, vocab - 100) for _ in range(length)]


def stream_ttft(url: str, body: dict) -> tuple[float, dict]:
    """Seconds from posting a streamed /generate `body` to its first chunk, and the last chunk's
    meta_info."""
    start = time.perf_counter()
    first, meta = None, {}
    with requests.post(url + "/generate", json=body, stream=True, timeout=1800) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: {r.status_code} {r.text[:500]}")
        for line in r.iter_lines():
            if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                continue
            first = first or time.perf_counter() - start
            chunk = json.loads(line[5:])
            if "error" in chunk:
                raise RuntimeError(f"request failed: {chunk['error']}")
            meta = chunk.get("meta_info", meta)
    if first is None:
        raise RuntimeError("no streamed chunk came back")
    return first, meta


def ttft(url: str, ids: list[int]) -> tuple[float, dict]:
    """TTFT of one greedy request for the token ids `ids`."""
    return stream_ttft(url, {"input_ids": ids, "stream": True, "sampling_params": {
        "max_new_tokens": MAX_NEW_TOKENS, "temperature": 0, "ignore_eos": True}})


def warm_up(url: str, prompts: list[int], vocab: int) -> None:
    """One request per prompt length (other token ids): kernel compiles for new shapes and
    first-request costs stay out of the numbers."""
    for n in prompts:
        ttft(url, prompt_ids(n, -n, vocab))


_PROMPT_SEEDS = itertools.count(1)  # every measured request has its own prompt: no radix-cache hit


def measure(url: str, prompts: list[int], repeats: int, vocab: int, label: str) -> dict:
    out = {}
    for n in prompts:
        runs = [ttft(url, prompt_ids(n, next(_PROMPT_SEEDS), vocab)) for _ in range(repeats)]
        transfer = [m.get("kv_transfer", {}) for _, m in runs]
        row = {"ttft_ms": 1e3 * statistics.median(t for t, _ in runs)}
        if any(transfer):
            if any(t.get("status") != "ok" for t in transfer):
                raise RuntimeError(f"{label}, {n} tokens: a transfer fell back: {transfer}")
            for key in ("bytes", "bytes_per_token", "wire_ms", "tail_ms", "link_gbps"):
                row[key] = statistics.median(t[key] for t in transfer)
        out[str(n)] = row
        extra = "".join(f", {k} {row[k]:.1f}" for k in ("wire_ms", "tail_ms", "link_gbps") if k in row)
        print(f"  {label:<34} {n:>6} tokens: TTFT {row['ttft_ms']:8.1f} ms{extra}", flush=True)
    return out


def run_single(server_args: list[str], budget: float, args) -> dict:
    s = start_server(server_args + ["--kv-tier-budget", str(budget)], name="bench_single")
    try:
        warm_up(s.url, args.prompts, args.vocab)
        return measure(s.url, args.prompts, args.repeats, args.vocab, f"single b={budget}")
    finally:
        stop_all(s)


def run_pd(server_args: list[str], budget: float, stream: str, rates: list[float], args) -> dict:
    """One prefill/decode pair and router per (budget, stream); the prefill's link is re-paced
    for each rate (POST /kv_transfer_link) between measurements."""
    bp = free_port()
    tier = ["--kv-tier-budget", str(budget), "--kv-transfer-stream", stream]
    prefill_args = server_args + tier + ["--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(bp),
                                         "--kv-transfer-rate-gbps", str(rates[0]), "--kv-transfer-latency-ms", str(args.latency_ms)]
    handles = []
    try:
        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(start_server, prefill_args, name="bench_prefill"),
                       pool.submit(start_server, server_args + tier + ["--disaggregation-mode", "decode"], name="bench_decode")]
            for f in futures:
                handles.append(f.result())
        p, d = handles
        handles.append(start_router([(p.url, bp)], [d.url], name="bench_router"))
        requests.post(p.url + "/kv_transfer_link", json={"rate_gbps": max(rates)}, timeout=30).raise_for_status()
        warm_up(handles[2].url, args.prompts, args.vocab)
        out = {}
        for rate in rates:
            r = requests.post(p.url + "/kv_transfer_link", json={"rate_gbps": rate, "latency_ms": args.latency_ms}, timeout=30)
            r.raise_for_status()
            out[f"b={budget} {stream} {rate:g}"] = measure(handles[2].url, args.prompts, args.repeats, args.vocab,
                                                          f"PD b={budget} {stream} {rate:g} Gbit/s")
        return out
    finally:
        stop_all(*reversed(handles))


def summarize(res: dict, args) -> dict:
    longest, pd, single = str(max(args.prompts)), res["pd"], res["single"]
    key = lambda b, s, r: f"b={b} {s} {r:g}"  # noqa: E731
    base = lambda r: pd.get(key(1.0, "end", r)) or {}  # noqa: E731
    out = {"link_efficiency_longest_prompt": {}, "wire_time_vs_b1": {}, "ttft_vs_b1": {}, "pd_ttft_vs_single_b1": {}}
    for name, rows in pd.items():
        b, stream, rate = name.split()
        row = rows[longest]
        if "link_gbps" in row:
            out["link_efficiency_longest_prompt"][name] = row["link_gbps"] / float(rate)
        ref = base(float(rate)).get(longest)
        if ref and b != "b=1.0":
            out["wire_time_vs_b1"][name] = row["wire_ms"] / ref["wire_ms"]
            out["ttft_vs_b1"][name] = row["ttft_ms"] / ref["ttft_ms"]
        if "1.0" in single:
            out["pd_ttft_vs_single_b1"][name] = row["ttft_ms"] / single["1.0"][longest]["ttft_ms"]
    return out


def plot(payload: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p = payload["params"]
    longest = str(max(p["prompts"]))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for b in p["budgets"]:
        names = [n for n in payload["pd"] if n.startswith(f"b={b} end ")]
        rates = [float(n.split()[2]) for n in names]
        rows = [payload["pd"][n][longest] for n in names]
        axes[0].plot(rates, [r["ttft_ms"] for r in rows], "o-", label=f"PD b={b}")
        axes[1].plot(rates, [r["wire_ms"] for r in rows], "o-", label=f"b={b}")
        axes[2].plot(rates, [r["link_gbps"] for r in rows], "o-", label=f"b={b}")
        if str(b) in payload["single"]:
            axes[0].axhline(payload["single"][str(b)][longest]["ttft_ms"], ls=":", lw=1, color=axes[0].lines[-1].get_color(),
                            label=f"single server b={b}")
    all_rates = sorted({float(n.split()[2]) for n in payload["pd"]})
    axes[2].plot(all_rates, all_rates, "--", color="gray", label="set rate")
    titles = (f"TTFT through the router, {longest}-token prompt", "KV wire time (link busy)", "achieved link rate")
    ylabels = ("TTFT (ms)", "ms", "Gbit/s")
    for ax, title, yl in zip(axes, titles, ylabels):
        ax.set_xscale("log")
        ax.set_xlabel("link rate (Gbit/s)")
        ax.set_ylabel(yl)
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)
    axes[1].set_yscale("log")
    axes[2].set_yscale("log")
    fig.suptitle(f"PD through sglang-router: {payload['model']}, {payload['device']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, nargs="+", default=[2000, 4000, 8000], help="prompt lengths (tokens)")
    ap.add_argument("--budgets", type=float, nargs="+", default=[1.0, 0.5, 0.3], help="--kv-tier-budget values")
    ap.add_argument("--rates", type=float, nargs="+", default=[1, 10, 25, 100], help="link rates, Gbit/s")
    ap.add_argument("--variant-rates", type=float, nargs="*", default=[10],
                    help="rates where b<1 also runs the int8 stream variant")
    ap.add_argument("--latency-ms", type=float, default=0.0, help="one-way link latency per write")
    ap.add_argument("--repeats", type=int, default=1, help="requests per prompt length (median)")
    ap.add_argument("--server-args", default=DEFAULT_SERVER_ARGS, help="arguments for every server")
    ap.add_argument("--vocab", type=int, default=49152, help="token ids are drawn below this")
    ap.add_argument("--name", default="ttft_vs_bandwidth", help="result file name (without extension)")
    ap.add_argument("--out-dir", default=None, help="where the JSON and PNG go (default benchmarks/results)")
    args = ap.parse_args()
    if 1.0 not in args.budgets:
        ap.error("--budgets must include 1.0 (the raw baseline every ratio is taken against)")
    if min(args.rates) <= 0 or min(args.prompts) < 1 or args.repeats < 1:
        ap.error("--rates, --prompts and --repeats must be positive")
    server_args = shlex.split(args.server_args)
    res = {"single": {}, "pd": {}}
    start = time.time()
    for b in args.budgets:
        res["single"][str(b)] = run_single(server_args, b, args)
        res["pd"].update(run_pd(server_args, b, "end", args.rates, args))
        if b < 1 and args.variant_rates:
            res["pd"].update(run_pd(server_args, b, "int8", args.variant_rates, args))
    model = next((server_args[i + 1] for i, a in enumerate(server_args) if a == "--model-path"), "smollm2-135m-instruct")
    device = "cuda" if "cuda" in args.server_args else "cpu"
    payload = {"benchmark": "ttft_vs_bandwidth", "device": device_name(device), "commit": git_commit(),
               "model": model, "params": vars(args),
               "link": "in-engine pacing over Mooncake TCP (loopback)", "seconds": time.time() - start, **res}
    payload["ratios"] = summarize(res, args)
    path = write_json(args.name, payload, args.out_dir)
    plot(payload, path[:-5] + ".png")
    print(json.dumps(payload["ratios"], indent=1))
    print("wrote", path)


if __name__ == "__main__":
    main()
