"""TTFT of a specialist decode server over the PD path: its own prefill (oracle) vs SCD codes vs
raw producer KV vs 4-bit producer KV, by link rate and prompt length, with the bytes per token.

    python benchmarks/pd/scd_ttft.py [--prompts 1024 2048 4096] [--rates 10 25 100 200]
        [--modes scd raw int4] [--repeats 1] [--server-args "..."] [--producer-args "..."]
        [--consumer-args "..."] [--artifacts DIR | --ranks R_K R_V R_H --patch-count K] [--interleave]
        [--out-dir DIR]

For each mode a producer P (prefill role, shaped link: `--kv-transfer-rate-gbps`, re-paced per
rate with POST /kv_transfer_link) and a consumer D (decode role) start behind sglang-router:

    scd     P and D with --scd-artifacts: P ships codes of the first n - 1 positions, D rebuilds its
            KV from them and computes the last position itself (its first token is its own)
    raw     plain P and D: the producer's KV in the model dtype, reused by D as it is
    int4    P and D at --kv-tier-budget 0.3 with the uniform-int4 tier policy: the producer's KV
            in int4 (+ one fp16 scale/zero pair per token and kv head)
    oracle  D computes the whole prompt itself (bootstrap_host 2.2.2.2): the consumer's prefill,
            measured on the first mode's D

One pair runs at a time (a GPU holds one pair of large models); with --interleave every pair
starts at once and the modes (and the oracle) alternate at each (rate, prompt) point, so a
shared CPU whose load drifts weighs on all of them alike.

Two TTFTs per request (streamed; time to the first chunk; every request a new random prompt):

    e2e       through the router: P's prefill + the transfer + D's first token
    consumer  P has prefilled the prompt already (the request went to P first, with the router's
              bootstrap fields); then the same request goes to D, timed from there. This is the
              shared-prefill case (one prefill, many specialists: SCD's fan-out consumers), and
              the TTFT the SCD paper compares with the oracle: transfer + rebuild + first step.

Without --artifacts, random artifacts of the producer's architecture are made (timing only:
quality needs calibrated ones, sgl_kvxfer/scd/README.md). `--producer-args` / `--consumer-args`
set each side's weights (e.g. --random-seed for dummy weights). On one GPU, the Llama-3-8B shape
(scripts/gpu/scd_ttft.sh): `--server-args "--model-path DIR --load-format dummy --dtype bfloat16
--device cuda --mem-fraction-static 0.4 --max-total-tokens 20000 --disable-cuda-graph"`.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import requests

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common.report import device_name, git_commit, write_json  # noqa: E402
from ttft_vs_bandwidth import prompt_ids, stream_ttft  # noqa: E402

from sgl_kvxfer.testing.servers import free_port, start_router, start_server, stop_all  # noqa: E402

DEFAULT_SERVER_ARGS = "--dtype bfloat16 --max-total-tokens 20000 --chunked-prefill-size 2048"
MODES = ("scd", "raw", "int4")
INT4_ARGS = ["--kv-tier-budget", "0.3", "--kv-tier-policy", "uniform-int4", "--kv-int4", "on",
             "--kv-transfer-stream", "end"]
MAX_NEW_TOKENS = 2
# The router probes /health every second; SGLang's /health runs a 1-token generation unless this
# is "false". Without it, the idle pairs of --interleave would load the CPU the others measure on.
QUIET_HEALTH = {"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "false"}
_SEEDS = itertools.count(1)
_ROOMS = itertools.count(1 << 40)


def gen_body(ids: list[int], **extra) -> dict:
    return {"input_ids": ids, "stream": True, **extra,
            "sampling_params": {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0, "ignore_eos": True}}


def prefilled(p_url: str) -> bool:
    states = requests.get(p_url + "/server_info", timeout=30).json().get("internal_states") or [{}]
    return states[0].get("kv_transfer", {}).get("rooms_prefilled", 0) > 0  # (none while the scheduler is busy)


def consumer_ttft(pair: dict, ids: list[int]) -> tuple[float, dict]:
    """P prefills first; D's TTFT is timed from when P is done: an SCD producer replies once its
    codes are encoded; a KV producer holds its reply until a decode claims the room, so its
    server info is polled for the prefilled room (the only one open)."""
    fields = {"bootstrap_host": "127.0.0.1", "bootstrap_port": pair["bp"], "bootstrap_room": next(_ROOMS)}
    body = gen_body(ids, **fields)
    with ThreadPoolExecutor(1) as pool:
        fp = pool.submit(requests.post, pair["P"].url + "/generate", json={**body, "stream": False}, timeout=1800)
        deadline = time.time() + 1800
        while not fp.done() and (pair["mode"] == "scd" or not prefilled(pair["P"].url)):
            if time.time() > deadline:
                raise RuntimeError("the producer never finished its prefill")
            time.sleep(0.01)
        out = stream_ttft(pair["D"].url, body)
        r = fp.result()
        if r.status_code != 200:
            raise RuntimeError(f"producer: {r.status_code} {r.text[:300]}")
    return out


def oracle_ttft(d_url: str, ids: list[int]) -> float:
    return stream_ttft(d_url, gen_body(ids, bootstrap_host="2.2.2.2", bootstrap_room=0))[0]


def make_artifacts(args, server_args: list[str], out_dir: str) -> str:
    """Random artifacts of the producer model's architecture (timing only)."""
    from sgl_kvxfer.models.arch_config import ModelArchConfig
    from sgl_kvxfer.models.loader import resolve_model_path
    from sgl_kvxfer.scd.artifacts import make_random_artifacts

    path = next((server_args[i + 1] for i, a in enumerate(server_args) if a == "--model-path"), None)
    arch = ModelArchConfig.from_dir(resolve_model_path(path))
    n, k = arch.num_hidden_layers, min(args.patch_count, arch.num_hidden_layers)
    patch = sorted({round(1 + i * (n - 2) / max(k - 1, 1)) for i in range(k)}) if k else []
    r_k, r_v = (min(r, arch.head_dim) for r in args.ranks[:2])  # a small model caps the ranks
    r_h = min(args.ranks[2], arch.hidden_size)
    make_random_artifacts(arch, ["c0"], r_k, r_v, r_h, patch, seed=0).save(out_dir)
    return out_dir


def start_pair(mode: str, args, server_args: list[str], arts: str | None) -> dict:
    bp = free_port()
    extra = {"scd": ["--scd-artifacts", arts] if arts else [], "raw": [], "int4": INT4_ARGS}[mode]
    # a long room deadline: a slow prefill (CPU) must not time a claimed room out (a fallback
    # would time a local prefill); --server-args may set another
    server_args = ["--kv-transfer-timeout", "600", *server_args]
    p_args = [*server_args, *extra, *shlex.split(args.producer_args), "--disaggregation-mode", "prefill",
              "--disaggregation-bootstrap-port", str(bp), "--kv-transfer-rate-gbps", str(max(args.rates))]
    d_args = [*server_args, *extra, *shlex.split(args.consumer_args), "--disaggregation-mode", "decode"]
    with ThreadPoolExecutor(2) as pool:
        fp, fd = (pool.submit(start_server, a, env=QUIET_HEALTH, name=f"scd_ttft_{mode}_{r}")
                  for a, r in ((p_args, "p"), (d_args, "d")))
        handles = [f.result() if f.exception() is None else None for f in (fp, fd)]
        failed = next((f.exception() for f in (fp, fd) if f.exception() is not None), None)
    if failed is not None:
        stop_all(*handles)
        raise failed
    p, d = handles
    try:
        router = start_router([(p.url, bp)], [d.url], name=f"scd_ttft_{mode}_router")
    except Exception:
        stop_all(p, d)
        raise
    return {"P": p, "D": d, "router": router, "bp": bp, "mode": mode}


def warm_up(pair: dict, args, with_oracle: bool) -> None:
    """Kernel compiles for new shapes and first-request costs stay out of the numbers."""
    for n in args.prompts:
        stream_ttft(pair["router"].url, gen_body(prompt_ids(n, -n, args.vocab)))
        consumer_ttft(pair, prompt_ids(n, -n - 1, args.vocab))
        if with_oracle:
            oracle_ttft(pair["D"].url, prompt_ids(n, -n - 2, args.vocab))


def measure_oracle(pair: dict, n: int, args) -> list[float]:
    return [oracle_ttft(pair["D"].url, prompt_ids(n, next(_SEEDS), args.vocab)) for _ in range(args.repeats)]


def measure_point(pair: dict, rate: float, n: int, args) -> dict:
    mode = pair["mode"]
    e2e = [stream_ttft(pair["router"].url, gen_body(prompt_ids(n, next(_SEEDS), args.vocab))) for _ in range(args.repeats)]
    cons = [consumer_ttft(pair, prompt_ids(n, next(_SEEDS), args.vocab)) for _ in range(args.repeats)]
    kv = [m.get("kv_transfer", {}) for _, m in e2e + cons]
    bad = [t.get("status") for t in kv if t.get("status") != "ok"]
    if bad:
        raise RuntimeError(f"{mode}, {rate:g} Gbit/s, {n} tokens: transfers did not succeed: {bad}")
    row = {"e2e_ms": 1e3 * statistics.median(t for t, _ in e2e), "consumer_ms": 1e3 * statistics.median(t for t, _ in cons)}
    for key in ("bytes", "bytes_per_token", "wire_ms", "link_gbps"):
        row[key] = statistics.median(t[key] for t in kv)
    print(f"  {mode:<5} {rate:>5g} Gbit/s {n:>6} tokens: e2e {row['e2e_ms']:8.1f} ms, consumer {row['consumer_ms']:8.1f} ms, "
          f"{row['bytes_per_token']:.0f} B/token, wire {row['wire_ms']:.1f} ms, {row['link_gbps']:.1f} Gbit/s", flush=True)
    return row


def set_rate(pair: dict, rate: float) -> None:
    requests.post(pair["P"].url + "/kv_transfer_link", json={"rate_gbps": rate}, timeout=30).raise_for_status()


def record_oracle(oracle: dict, n: int, times: list[float]) -> None:
    runs = oracle.setdefault(str(n), {"runs_ms": []})["runs_ms"]
    runs.extend(1e3 * t for t in times)
    oracle[str(n)]["ttft_ms"] = statistics.median(runs)
    print(f"  oracle {n:>6} tokens: TTFT {1e3 * statistics.median(times):8.1f} ms", flush=True)


def run_mode(mode: str, args, server_args: list[str], arts: str | None, oracle: dict | None) -> dict:
    """One pair at a time (a GPU holds one pair of large models)."""
    pair = start_pair(mode, args, server_args, arts)
    try:
        warm_up(pair, args, oracle is not None)
        if oracle is not None:
            for n in args.prompts:
                record_oracle(oracle, n, measure_oracle(pair, n, args))
        out = {}
        for rate in args.rates:
            set_rate(pair, rate)
            out[f"{rate:g}"] = {str(n): measure_point(pair, rate, n, args) for n in args.prompts}
        return out
    finally:
        stop_all(pair["router"], pair["P"], pair["D"])


def run_interleaved(args, server_args: list[str], arts: str | None, res: dict) -> None:
    """Every pair up at once; at each (rate, prompt) the modes and the oracle run one after
    another, so a machine whose load drifts (a shared CPU) weighs on all of them alike."""
    pairs = []
    try:
        for mode in args.modes:
            pairs.append(start_pair(mode, args, server_args, arts))
        for i, pair in enumerate(pairs):
            warm_up(pair, args, i == 0)
        for rate in args.rates:
            for pair in pairs:
                set_rate(pair, rate)
            for n in args.prompts:
                record_oracle(res["oracle"], n, measure_oracle(pairs[0], n, args))
                for pair in pairs:
                    res["modes"].setdefault(pair["mode"], {}).setdefault(f"{rate:g}", {})[str(n)] = \
                        measure_point(pair, rate, n, args)
    finally:
        for pair in pairs:
            stop_all(pair["router"], pair["P"], pair["D"])


def summarize(res: dict, args) -> dict:
    modes, oracle = res["modes"], res["oracle"]
    out = {"bytes_per_token": {}, "bytes_vs_raw": {}, "consumer_speedup_vs_oracle": {}, "e2e_vs_oracle": {}}
    for mode, rates in modes.items():
        rows = [r for by_n in rates.values() for r in by_n.values()]
        out["bytes_per_token"][mode] = statistics.median(r["bytes_per_token"] for r in rows)
        speed, e2e = {}, {}
        for rate, by_n in rates.items():
            for n, r in by_n.items():
                if n in oracle:
                    speed[f"{rate} {n}"] = oracle[n]["ttft_ms"] / r["consumer_ms"]
                    e2e[f"{rate} {n}"] = r["e2e_ms"] / oracle[n]["ttft_ms"]
        out["consumer_speedup_vs_oracle"][mode], out["e2e_vs_oracle"][mode] = speed, e2e
    if "raw" in out["bytes_per_token"]:
        raw = out["bytes_per_token"]["raw"]
        out["bytes_vs_raw"] = {m: b / raw for m, b in out["bytes_per_token"].items()}
    return out


def plot(payload: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    longest = str(max(payload["params"]["prompts"]))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for mode, rates in payload["modes"].items():
        xs = [float(r) for r in rates]
        for ax, key in ((axes[0], "consumer_ms"), (axes[1], "e2e_ms")):
            ax.plot(xs, [rates[r][longest][key] for r in rates], "o-", label=mode)
    if longest in payload["oracle"]:
        for ax in axes[:2]:
            ax.axhline(payload["oracle"][longest]["ttft_ms"], ls=":", color="black", label="oracle (own prefill)")
    bpt = payload["summary"]["bytes_per_token"]
    axes[2].bar(list(bpt), list(bpt.values()), color=["C0", "C1", "C2", "C3"][:len(bpt)])
    titles = (f"consumer TTFT, producer prefilled ({longest} tokens)", f"TTFT through the router ({longest} tokens)",
              "bytes on the wire per prompt token")
    for ax, title in zip(axes, titles):
        ax.set_title(title, fontsize=9)
    for ax in axes[:2]:
        ax.set_xscale("log")
        ax.set_xlabel("link rate (Gbit/s)")
        ax.set_ylabel("ms")
        ax.legend(fontsize=7)
    axes[2].set_yscale("log")
    fig.suptitle(f"SCD over PD through sglang-router: {payload['model']}, {payload['device']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, nargs="+", default=[1024, 2048, 4096], help="prompt lengths (tokens)")
    ap.add_argument("--rates", type=float, nargs="+", default=[10, 25, 100, 200], help="link rates, Gbit/s")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES, help="transfer modes (oracle: always)")
    ap.add_argument("--repeats", type=int, default=1, help="requests per point (median)")
    ap.add_argument("--server-args", default=DEFAULT_SERVER_ARGS, help="arguments for every server")
    ap.add_argument("--producer-args", default="", help="the prefill servers' own arguments (its weights)")
    ap.add_argument("--consumer-args", default="", help="the decode servers' own arguments (the specialist)")
    ap.add_argument("--artifacts", default=None, help="SCD artifacts dir (default: random ones, timing only)")
    ap.add_argument("--ranks", type=int, nargs=3, default=[12, 20, 128], metavar=("R_K", "R_V", "R_H"),
                    help="random artifacts' ranks (default: r_K + r_V = 32, the size of the paper's Reuse artifacts)")
    ap.add_argument("--patch-count", type=int, default=6, help="random artifacts' Patch layers (the paper's k = 6)")
    ap.add_argument("--interleave", action="store_true",
                    help="start every mode's pair at once and alternate the modes at each point (a shared CPU "
                         "whose load drifts); default: one pair at a time (a GPU holds one pair of large models)")
    ap.add_argument("--vocab", type=int, default=49152, help="token ids are drawn below this")
    ap.add_argument("--name", default="scd_ttft", help="result file name (without extension)")
    ap.add_argument("--out-dir", default=None, help="where the JSON and PNG go (default benchmarks/results)")
    args = ap.parse_args()
    if min(args.rates) <= 0 or min(args.prompts) < 2 or args.repeats < 1:
        ap.error("--rates must be positive, --prompts >= 2, --repeats >= 1")
    server_args = shlex.split(args.server_args)
    start = time.time()
    res = {"oracle": {}, "modes": {}}
    model = next((server_args[i + 1] for i, a in enumerate(server_args) if a == "--model-path"), "smollm2-135m-instruct")
    device = "cuda" if "cuda" in args.server_args else "cpu"

    def emit(manifest: dict | None, done: bool) -> str:
        """The JSON + PNG of what ran so far (rewritten after every mode: a run cut short keeps
        the modes it finished; "complete" says whether all did)."""
        payload = {"benchmark": "scd_ttft", "device": device_name(device), "commit": git_commit(), "model": model,
                   "params": vars(args), "link": "in-engine pacing over Mooncake TCP (loopback)", "complete": done,
                   "artifacts": None if manifest is None else {
                       "random": args.artifacts is None, "ranks": [manifest["r_k"], manifest["r_v"], manifest["r_h"]],
                       "patch_layers": manifest["patch_layers"], "dtype": manifest["dtype"],
                       "bytes_per_token": manifest["bytes_per_token"]},
                   "seconds": time.time() - start, **res}
        payload["summary"] = summarize(res, args)
        path = write_json(args.name, payload, args.out_dir)
        plot(payload, path[:-5] + ".png")
        if done:
            print(json.dumps(payload["summary"], indent=1))
        return path

    with tempfile.TemporaryDirectory(prefix="scd_ttft_") as tmp:
        arts = args.artifacts
        if "scd" in args.modes and arts is None:
            arts = make_artifacts(args, server_args + shlex.split(args.producer_args), os.path.join(tmp, "arts"))
        manifest = None
        if arts:
            with open(os.path.join(arts, "manifest.json")) as f:
                manifest = json.load(f)
        if args.interleave:
            run_interleaved(args, server_args, arts, res)
            path = emit(manifest, done=True)
        for i, mode in enumerate([] if args.interleave else args.modes):
            res["modes"][mode] = run_mode(mode, args, server_args, arts, res["oracle"] if i == 0 else None)
            path = emit(manifest, done=i == len(args.modes) - 1)
    print("wrote", path)


if __name__ == "__main__":
    main()
