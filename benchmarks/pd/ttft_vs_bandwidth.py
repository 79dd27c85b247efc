"""TTFT and KV transfer time through the real sglang-router vs link rate, prompt length, tier budget
and transfer stream.

    python benchmarks/pd/ttft_vs_bandwidth.py [--prompts 2000 4000 8000] [--budgets 1.0 0.5 0.3]
        [--rates 1 10 25 100] [--streams end chunk-upgrade] [--variant-rates 10] [--repeats 1]
        [--more-prompts 2000] [--more-rates 200] [--more-seconds 60] [--server-args "..."] [--prefill-args "..."] [--decode-args "..."] [--reference single|prefill]
        [--peer-copy] [--trace] [--profile-dir DIR [--profile-rows ...]] [--out-dir DIR]

For each budget b, in the order given, one prefill / decode pair starts behind
`sglang_router.launch_router --pd-disaggregation`. Its points (prompt, link rate R (0: unpaced),
stream: b = 1.0 sends chunks at the model dtype; b < 1 `--streams`, see
sgl_kvxfer/disagg/prefill.py) run prompt by prompt in the order given: first the core grid
(`--prompts` x `--rates`), then the points `--more-prompts` / `--more-rates` add, started only
while the pair has measured for less than `--more-seconds` (so later budgets keep their turn).
At each point POST /kv_transfer_link sets the prefill's pacing and stream, then the prompt
(random token ids, so nothing hits a radix cache) goes through the router `--repeats` times
(`--repeats-long` from `--long-prompt` tokens up), streamed: TTFT is the time to the first
streamed chunk. The decode's `meta_info.kv_transfer` gives the bytes on the wire, `wire_ms` (the link's busy time: summed write times), `tail_ms`
(prompt done -> last write: the transfer the prefill's compute did not hide) and, with
`--trace`, the phase trace (sgl_kvxfer/disagg/trace.py) of `--trace-repeats` more requests sent
after the timed ones with the prefill's trace switched on (POST /kv_transfer_link): a traced
chunk waits for its kernels, so the timed requests run untraced; the traced ones' TTFTs are
kept apart (`traced_ttft_ms`). Streams other than `end` run at `--variant-rates` only (all
rates when it is omitted). With `--profile-dir`, each point (or those `--profile-rows` names)
sends one more untraced request under the prefill server's torch profiler (POST /start_profile,
/stop_profile); the row names its trace file (`profile.file`) and keeps that request's transfer
(`profile.kv_transfer`), and benchmarks/pd/trace_timeline.py reads the trace as per-stream GPU
busy time, idle gaps, overlap and the KV writes' copies.

The reference at each budget is a server computing the prompt alone: `--reference single`
starts a non-disaggregated server (server + prefill args); `--reference prefill` asks the PD
prefill server itself with SGLang's "no peer" host 2.2.2.2 (the same process and GPU, no
transfer; it saves one server start per budget). `--peer-copy` measures a plain GPU0 -> GPU1
copy (torch, `--peer-copy-mib`) in the same run, the bandwidth the KV transfer is held against.

Ratios (same run, `ratios` in the JSON): link efficiency = achieved / set rate; KV transfer rate
unpaced vs the plain peer copy; TTFT at b vs b = 1.0 per stream and rate; each stream vs `end`;
PD TTFT vs the reference; the tiered prefill (reference at b) vs the fp16 one (reference at 1.0);
the largest uncovered stretch of any traced request.

`--server-args` go to every server (default: the embedded SmolLM2 in bf16 on CPU, int4 tier on
without the start-up probe); `--prefill-args` / `--decode-args` to one role (e.g. `--base-gpu-id
0` / `--base-gpu-id 1`: the pair on two GPUs). Each server first serves one prompt of every
length, so kernel compiles stay out of the numbers, and each (prompt length, stream, paced or not)
gets one untimed request before its first timed one (a stream's first use pays for its last
chunk's kernel shapes and the decode's first tiered unpack). The JSON is rewritten after every point (with
`timing`: when each pair was up, warm and stopped); an interrupt (SIGINT) keeps it and plots it.
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
from common.sglang_clients import first_chunk  # noqa: E402

from sgl_kvxfer.testing.servers import free_port, start_router, start_server, stop_all  # noqa: E402

DEFAULT_SERVER_ARGS = "--dtype bfloat16 --max-total-tokens 40000 --kv-int4 on"  # int4 on: no start-up probe
MAX_NEW_TOKENS = 4
NO_PEER = {"bootstrap_host": "2.2.2.2", "bootstrap_room": 0}  # SGLang's fake-prefill host: compute here


def prompt_ids(length: int, seed: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, vocab - 100) for _ in range(length)]


def stream_ttft(url: str, body: dict) -> tuple[float, dict]:
    """Seconds from posting a streamed /generate `body` to its first chunk, and the last chunk's
    meta_info."""
    return first_chunk(url, body, time.perf_counter(), 1800)


def ttft(url: str, ids: list[int], extra: dict | None = None) -> tuple[float, dict]:
    """TTFT of one greedy request for the token ids `ids`."""
    return stream_ttft(url, {"input_ids": ids, "stream": True, **(extra or {}), "sampling_params": {
        "max_new_tokens": MAX_NEW_TOKENS, "temperature": 0, "ignore_eos": True}})


def warm_up(url: str, prompts: list[int], vocab: int, extra: dict | None = None) -> None:
    """One request per prompt length (other token ids): kernel compiles for new shapes and
    first-request costs stay out of the numbers."""
    for n in prompts:
        ttft(url, prompt_ids(n, -n, vocab), extra)


def peer_copy(mib: int, repeats: int) -> dict:
    """A plain copy of `mib` MiB from GPU 0 to GPU 1 (torch, CUDA events), `repeats` timed runs
    after one warm-up: the bandwidth the KV transfer between the two GPUs is held against."""
    import torch

    if torch.cuda.device_count() < 2:
        return {"skipped": f"{torch.cuda.device_count()} GPU(s)"}
    src = torch.empty(mib << 20, dtype=torch.uint8, device="cuda:0").random_(0, 255)
    dst = torch.empty(mib << 20, dtype=torch.uint8, device="cuda:1")
    runs = []
    for i in range(repeats + 1):
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)
        start = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize(1)
        torch.cuda.synchronize(0)
        if i:
            runs.append((mib << 20) / (time.perf_counter() - start) / 1e9)
    same = bool(torch.equal(src.to("cuda:1"), dst))
    p2p = torch.cuda.can_device_access_peer(0, 1)
    del src, dst
    torch.cuda.empty_cache()
    return {"GBps": statistics.median(runs), "runs_GBps": runs, "mib": mib, "bytes_equal": same, "peer_access": p2p}


_PROMPT_SEEDS = itertools.count(1)  # every measured request has its own prompt: no radix-cache hit


def trace_summary(traces: list[dict]) -> dict:
    """Medians over one row's traced requests, and its largest uncovered stretch."""
    kinds = sorted({k for t in traces for k in t["by_phase_ms"]})
    gaps = [g for t in traces for g in t["gaps"]]
    return {"critical_ms": statistics.median(t["critical_ms"] for t in traces),
            "unaccounted_ms": statistics.median(t["unaccounted_ms"] for t in traces),
            "max_gap": max(gaps, key=lambda g: g[2], default=None),
            "by_phase_ms": {k: statistics.median(t["by_phase_ms"].get(k, 0.0) for t in traces) for k in kinds},
            "per_request": [request_host_ms(t) for t in traces],
            "example": traces[len(traces) // 2]}


RETIER_PHASES = ("p.tier", "p.tier_retier", "p.tier_retier_cpu", "p.tier_assign", "p.tier_move")


def request_host_ms(trace: dict) -> dict:
    """One traced request's re-tier (wall and the scheduler thread's CPU time) and collector
    pauses: a slow request among fast ones shows which it spent its time in."""
    phases = trace["by_phase_ms"]
    gc_ms = sum(v for k, v in phases.items() if k[2:].startswith("gc"))
    return {"critical_ms": trace["critical_ms"], **{k: phases[k] for k in RETIER_PHASES if k in phases},
            "gc_ms": round(gc_ms, 3)}


def _prefill_traced(trace: dict) -> bool:
    return any(name.startswith("p.") for name in trace["by_phase_ms"])


def profile_id(label: str, n: int) -> str:
    """A trace file's stem for a row: its label and prompt length, in file-name-safe characters."""
    return "".join(c if c.isalnum() or c in "-." else "_" for c in f"{label}_{n}").strip("_")


def profiled_request(url: str, n: int, vocab: int, extra: dict | None, profile_url: str, out_dir: str,
                     pid: str) -> dict:
    """One more request of n tokens with the torch profiler of the server at `profile_url` running
    (POST /start_profile ... /stop_profile); returns the trace file's name in `out_dir` (`file`)
    and, where KV moved, the request's `kv_transfer` (its wire_ms: the sender's write calls)."""
    # (activities: the server's default, CPU and GPU where it has CUDA)
    r = requests.post(f"{profile_url}/start_profile", json={"output_dir": out_dir, "profile_id": pid}, timeout=60)
    if r.status_code != 200:
        raise RuntimeError(f"/start_profile answered {r.status_code}: {r.text}")
    try:
        _, meta = ttft(url, prompt_ids(n, next(_PROMPT_SEEDS), vocab), extra)
    finally:
        r = requests.post(f"{profile_url}/stop_profile", timeout=300)
    if r.status_code != 200:
        raise RuntimeError(f"/stop_profile answered {r.status_code}: {r.text}")
    # the profiled request's own transfer (its wire_ms against the trace's copies)
    kv = {k: v for k, v in meta.get("kv_transfer", {}).items() if k != "trace"}
    return {"file": f"{pid}-TP-0.trace.json.gz", **({"kv_transfer": kv} if kv else {})}


def measure(url: str, n: int, repeats: int, vocab: int, label: str, extra: dict | None = None,
            trace_repeats: int = 0, prefill_url: str | None = None, link: tuple | None = None,
            profile_dir: str | None = None) -> dict:
    """`repeats` requests of n tokens; their TTFT, and the transfer's medians when KV moved.
    With `trace_repeats` (PD through the router, `link` = (rate, stream, latency)): the timed
    requests run with the prefill's trace off (a traced chunk waits for its kernels), then
    `trace_repeats` traced requests give the row's phase trace and `traced_ttft_ms`. With
    `profile_dir`: then one untraced request under the torch profiler of the server at
    `prefill_url` (the prefill server, or the server itself), its trace file named in `profile`."""
    if trace_repeats:
        set_link(prefill_url, *link, trace=False)
    runs = [ttft(url, prompt_ids(n, next(_PROMPT_SEEDS), vocab), extra) for _ in range(repeats)]
    if trace_repeats:
        set_link(prefill_url, *link, trace=True)
        traced = [ttft(url, prompt_ids(n, next(_PROMPT_SEEDS), vocab), extra) for _ in range(trace_repeats)]
        set_link(prefill_url, *link, trace=False)
    profile = None
    if profile_dir:
        profile = profiled_request(url, n, vocab, extra, prefill_url or url, profile_dir, profile_id(label, n))
    times = [1e3 * t for t, _ in runs]
    row = {"ttft_ms": statistics.median(times), "ttft_min_ms": min(times), "ttft_max_ms": max(times),
           "runs_ms": times}
    transfer = [m.get("kv_transfer", {}) for _, m in runs]
    if any("wire_ms" in t for t in transfer):
        if any(t.get("status") != "ok" for t in transfer):
            raise RuntimeError(f"{label}, {n} tokens: a transfer fell back: {transfer}")
        for key in ("bytes", "bytes_per_token", "wire_ms", "tail_ms", "link_gbps"):
            row[key] = statistics.median(t[key] for t in transfer)
        if trace_repeats:
            if any(_prefill_traced(t["trace"]) for t in transfer if "trace" in t):
                raise RuntimeError(f"{label}: the prefill traced requests sent with its trace off")
            traces = [m.get("kv_transfer", {}).get("trace") for _, m in traced]
            if not all(t and _prefill_traced(t) for t in traces):
                raise RuntimeError(f"{label}: a request sent with the prefill's trace on has no prefill spans")
            row["trace"] = trace_summary(traces)
            row["traced_ttft_ms"] = [1e3 * t for t, _ in traced]
    if profile:
        row["profile"] = profile
    extra_s = "".join(f", {k} {row[k]:.1f}" for k in ("wire_ms", "tail_ms", "link_gbps") if k in row)
    if "trace" in row:
        extra_s += f", unaccounted {row['trace']['unaccounted_ms']:.1f} ms"
    print(f"  {label:<38} {n:>6} tokens: TTFT {row['ttft_ms']:8.1f} ms [{row['ttft_min_ms']:.1f}, "
          f"{row['ttft_max_ms']:.1f}]{extra_s}", flush=True)
    return row


def repeats_for(n: int, args) -> int:
    return args.repeats_long if n >= args.long_prompt else args.repeats


def rate_name(rate: float) -> str:
    return "unpaced" if rate == 0 else f"{rate:g}"


STREAMS = ("end", "int8", "chunk", "chunk-upgrade")
MAX_LAST_CHUNK = 1 << 20


def parse_stream(spec: str) -> tuple[str, int | None]:
    """A `--streams` entry: a --kv-transfer-stream name, or `chunk@N` / `chunk-upgrade@N` (that
    stream with --kv-transfer-last-chunk N, 0: off). ValueError if malformed."""
    name, at, n = spec.partition("@")
    if name not in STREAMS or (at and name not in ("chunk", "chunk-upgrade")):
        raise ValueError(f"a stream is one of {STREAMS}, or chunk@N / chunk-upgrade@N; got {spec!r}")
    if not at:
        return name, None
    if not n.isdigit() or not (int(n) == 0 or 32 <= int(n) <= MAX_LAST_CHUNK):
        raise ValueError(f"{spec!r}: N must be 0 (off) or tokens in [32, {MAX_LAST_CHUNK}]")
    return name, int(n)


def stream_arg(spec: str) -> str:
    try:
        parse_stream(spec)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return spec


def set_link(url: str, rate: float, stream: str, latency_ms: float, last_chunk: int,
             trace: bool | None = None) -> None:
    """Pace the prefill's link and set its stream (a `--streams` entry) for rooms opened from now
    on; `last_chunk` is the --kv-transfer-last-chunk of a stream without `@N`."""
    name, n = parse_stream(stream)
    body = {"rate_gbps": rate, "latency_ms": latency_ms, "stream": name, "last_chunk": last_chunk if n is None else n}
    if trace is not None:
        body["trace"] = trace
    r = requests.post(url + "/kv_transfer_link", json=body, timeout=30)
    if r.status_code != 200:
        raise RuntimeError(f"POST /kv_transfer_link: {r.status_code} {r.text}")


def budget_points(budget: float, args) -> list[tuple[bool, int, float, str]]:
    """The budget's points as (extra, prompt, rate, stream), in measuring order: the core grid
    (`--prompts` x `--rates`) first, prompt by prompt in the order given, then the extra points
    (`--more-prompts` / `--more-rates` widen the grid) the same way. Streams other than `end`
    run at `--variant-rates` only (every rate when it is omitted); b = 1.0 has `end` only."""
    streams = ["end"] if budget >= 1.0 else args.streams
    points, seen = [], set()
    grids = [(False, args.prompts, args.rates),
             (True, args.prompts + args.more_prompts, args.rates + args.more_rates)]
    for extra, prompts, rates in grids:
        for n in dict.fromkeys(prompts):
            for rate in dict.fromkeys(rates):
                for stream in streams:
                    if stream != "end" and args.variant_rates is not None and rate not in args.variant_rates:
                        continue
                    if (n, rate, stream) not in seen:
                        seen.add((n, rate, stream))
                        points.append((extra, n, rate, stream))
    return points


def run_single(server_args: list[str], budget: float, args) -> dict:
    """`--reference single`: a non-disaggregated server computes every prompt length alone."""
    s = start_server(server_args + ["--kv-tier-budget", str(budget)] + args.prefill_args, name="bench_single")
    try:
        prompts = list(dict.fromkeys(args.prompts + args.more_prompts))
        warm_up(s.url, prompts, args.vocab)
        return {str(n): measure(s.url, n, repeats_for(n, args), args.vocab, f"single b={budget}") for n in prompts}
    finally:
        stop_all(s)


def extra_stop(args, clock, pairs_after: int, pairs: dict, measuring_from: float | None) -> str | None:
    """Why the pair's next extra point must not start (None: it may)."""
    if measuring_from is not None and time.time() - measuring_from >= args.more_seconds:
        return f"--more-seconds {args.more_seconds:g} spent"
    if args.deadline_s:
        per_pair = 1.5 * max(t["core_done_s"] - t["start_s"] for t in pairs.values() if "core_done_s" in t)
        margin = 15.0  # a point in progress and the pair's stop
        if clock() + pairs_after * per_pair + margin > args.deadline_s:
            return f"--deadline-s {args.deadline_s:g}: {pairs_after} pairs to come at ~{per_pair:.0f} s each"
    return None


class Clock:
    """Seconds since the benchmark started, for the log and the JSON's `timing`."""

    def __init__(self):
        self.t0 = time.time()

    def __call__(self) -> float:
        return round(time.time() - self.t0, 1)


def run_budget(server_args: list[str], budget: float, args, res: dict, save, clock: Clock, pairs_after: int = 0) -> None:
    """One prefill / decode pair and router for the budget; its reference, then every point
    through the router, re-paced and re-streamed in place (POST /kv_transfer_link). The JSON is
    rewritten after every point. Extra points start only while the pair has measured for less
    than `--more-seconds` and, with `--deadline-s`, while the `pairs_after` budgets still to come
    fit before the deadline (each costed at 1.5x the slowest pair so far up to its core grid's
    end: later pairs run more streams)."""
    key = str(budget)
    timing = res["timing"].setdefault(f"b={budget}", {"start_s": clock()})
    if args.reference == "single":
        res["reference"][key] = run_single(server_args, budget, args)
        save()
    bp = free_port()
    tier = ["--kv-tier-budget", str(budget)] + (["--enable-pd-trace"] if args.trace else [])
    paced = max([r for r in args.rates + args.more_rates if r > 0], default=100.0)  # a shaped engine; 0 unpaces it
    prefill_args = server_args + tier + args.prefill_args + [
        "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(bp),
        "--kv-transfer-rate-gbps", str(paced), "--kv-transfer-latency-ms", str(args.latency_ms)]
    decode_args = server_args + tier + args.decode_args + ["--disaggregation-mode", "decode"]
    handles = []
    try:
        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(start_server, prefill_args, name="bench_prefill"),
                       pool.submit(start_server, decode_args, name="bench_decode")]
            for f in futures:
                handles.append(f.result())
        p, d = handles
        handles.append(start_router([(p.url, bp)], [d.url], name="bench_router"))
        timing["up_s"] = clock()
        print(f"[{clock()} s] b={budget}: prefill, decode and router up", flush=True)
        router = handles[2].url
        warmed: set = set()  # prompt lengths, and (length, stream, paced) seen by an untimed request
        points = budget_points(budget, args)
        measuring_from = None
        for extra, n, rate, stream in points:
            if extra:
                timing.setdefault("core_done_s", clock())
                why = extra_stop(args, clock, pairs_after, res["timing"], measuring_from)
                if why:
                    timing["skipped"] = [[m, rate_name(r), s] for e, m, r, s in points[points.index((extra, n, rate, stream)):]]
                    print(f"[{clock()} s] b={budget}: {why}; {len(timing['skipped'])} extra points skipped", flush=True)
                    break
            if n not in warmed:  # the prompt length's first use: kernel compiles stay out of the numbers
                if args.reference == "prefill":
                    warm_up(p.url, [n], args.vocab, NO_PEER)
                    res["reference"].setdefault(key, {})[str(n)] = measure(
                        p.url, n, repeats_for(n, args), args.vocab, f"reference b={budget} (prefill, no peer)", NO_PEER,
                        profile_dir=args.profile_dir if profiled(args, "reference") else None)
                    save()
                warmed.add(n)
            set_link(p.url, rate, stream, args.latency_ms, args.last_chunk)
            if (n, stream, rate > 0) not in warmed:
                # a length's and a stream's first PD request, paced or not, pays first-use costs
                # (kernel compiles, its last chunk's shapes, the decode's first unpack of a tiered
                # payload, the paced engine): one untimed request at the point's own settings keeps
                # them out of its runs. A new prompt: warm_up's would hit the prefill's cache (the
                # reference sent it), and a cached prompt skips the tiering and packing
                ttft(router, prompt_ids(n, next(_PROMPT_SEEDS), args.vocab))
                warmed.add((n, stream, rate > 0))
                timing.setdefault("warm_s", clock())
            measuring_from = measuring_from or time.time()
            name = f"b={budget} {stream} {rate_name(rate)}"
            res["pd"].setdefault(name, {})[str(n)] = measure(
                router, n, repeats_for(n, args), args.vocab, f"PD {name}", trace_repeats=args.trace_repeats if args.trace else 0,
                prefill_url=p.url, link=(rate, stream, args.latency_ms, args.last_chunk),
                profile_dir=args.profile_dir if profiled(args, name) else None)
            save()
    finally:
        stop_all(*reversed(handles))
        timing["end_s"] = clock()
        save()


def profiled(args, name: str) -> bool:
    """Whether the row `name` ("reference", or "b=<b> <stream> <rate>") gets a profiled request."""
    if not args.profile_dir:
        return False
    return not args.profile_rows or any(part in f"{name}" for part in args.profile_rows)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def summarize(res: dict, args) -> dict:
    """Every ratio the JSON reports, at every prompt length (keys "<row> @<tokens>")."""
    pd, ref = res["pd"], res["reference"]
    out = {"link_efficiency": {}, "kv_transfer_vs_peer_copy": {}, "ttft_vs_b1": {}, "stream_vs_end": {},
           "pd_vs_reference": {}, "tiered_prefill_vs_fp16": {}, "max_unaccounted_gap_ms": None}
    peer = (res.get("peer_copy") or {}).get("GBps")
    gaps = []
    for name, rows in pd.items():
        b, stream, rate = name.split()
        for n, row in rows.items():
            key = f"{name} @{n}"
            if rate != "unpaced" and "link_gbps" in row:
                out["link_efficiency"][key] = row["link_gbps"] / float(rate)
            if rate == "unpaced" and peer and "link_gbps" in row:
                out["kv_transfer_vs_peer_copy"][key] = row["link_gbps"] / 8 / peer
            if b != "b=1.0":
                base = pd.get(f"b=1.0 end {rate}", {}).get(n, {})
                out["ttft_vs_b1"][key] = _ratio(row["ttft_ms"], base.get("ttft_ms"))
                if stream != "end":
                    end = pd.get(f"{b} end {rate}", {}).get(n, {})
                    out["stream_vs_end"][key] = _ratio(row["ttft_ms"], end.get("ttft_ms"))
            r = ref.get(b[2:], {}).get(n, {})
            out["pd_vs_reference"][key] = _ratio(row["ttft_ms"], r.get("ttft_ms"))
            if row.get("trace") and row["trace"]["max_gap"]:
                gaps.append([key, *row["trace"]["max_gap"]])
    for b, rows in ref.items():
        if b != "1.0":
            for n, row in rows.items():
                out["tiered_prefill_vs_fp16"][f"b={b} @{n}"] = _ratio(row["ttft_ms"], ref.get("1.0", {}).get(n, {}).get("ttft_ms"))
    out["max_unaccounted_gap_ms"] = max(gaps, key=lambda g: g[3], default=None)
    return out


def plot(payload: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = sorted({name.split()[2] for name in payload["pd"]}, key=lambda r: float("inf") if r == "unpaced" else float(r))
    x = {r: i for i, r in enumerate(rates)}
    prompts = [str(n) for n in sorted({int(n) for rows in payload["pd"].values() for n in rows})]
    colors = {b: f"C{i}" for i, b in enumerate(sorted({name.split()[0][2:] for name in payload["pd"]}, reverse=True))}
    styles = {"end": "o-", "int8": "s--", "chunk": "^--", "chunk-upgrade": "v--"}
    fig, axes = plt.subplots(len(prompts), 3, figsize=(16, 3.6 * len(prompts)), squeeze=False)
    for row_axes, n in zip(axes, prompts):
        for series in sorted({" ".join(name.split()[:2]) for name in payload["pd"]}):
            names = [name for name in payload["pd"] if name.startswith(series + " ") and n in payload["pd"][name]]
            names.sort(key=lambda name: x[name.split()[2]])
            rows = [payload["pd"][name][n] for name in names]
            xs = [x[name.split()[2]] for name in names]
            b, stream = series.split()
            style = dict(color=colors[b[2:]], label=f"PD {series}")
            mark = styles[stream] if stream in styles else "x:"  # chunk@N
            row_axes[0].plot(xs, [r["ttft_ms"] for r in rows], mark, **style)
            row_axes[1].plot(xs, [r.get("wire_ms", float("nan")) for r in rows], mark, **style)
            row_axes[2].plot(xs, [r.get("link_gbps", float("nan")) for r in rows], mark, **style)
        for b, rows in payload["reference"].items():
            if n in rows:
                row_axes[0].axhline(rows[n]["ttft_ms"], ls=":", lw=1, color=colors.get(b, "gray"),
                                    label=f"reference b={b}")
        titles = (f"TTFT through the router, {n}-token prompt", "KV wire time (link busy)", "achieved link rate")
        for ax, title, yl in zip(row_axes, titles, ("TTFT (ms)", "ms", "Gbit/s")):
            ax.set_xticks(range(len(rates)), [f"{r} Gbit/s" if r != "unpaced" else r for r in rates], fontsize=7)
            ax.set_ylabel(yl)
            ax.set_yscale("log")
            ax.set_title(title, fontsize=9)
            ax.legend(fontsize=6)
    fig.suptitle(f"PD through sglang-router: {payload['model']}, {payload['device']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, nargs="+", default=[2000, 4000, 8000], help="prompt lengths (tokens)")
    ap.add_argument("--budgets", type=float, nargs="+", default=[1.0, 0.5, 0.3], help="--kv-tier-budget values")
    ap.add_argument("--rates", type=float, nargs="+", default=[1, 10, 25, 100], help="link rates, Gbit/s (0: unpaced)")
    ap.add_argument("--streams", nargs="+", default=["end", "int8"], type=stream_arg,
                    help="--kv-transfer-stream values at b < 1 (end, int8, chunk, chunk-upgrade); chunk@N / "
                         "chunk-upgrade@N: that stream with --kv-transfer-last-chunk N (0: off)")
    ap.add_argument("--last-chunk", type=int, default=512,
                    help="--kv-transfer-last-chunk of the chunk streams without @N (0: off; the servers' default 512)")
    ap.add_argument("--variant-rates", type=float, nargs="*", default=[10],
                    help="rates where streams other than end run (omit the values for every rate)")
    ap.add_argument("--more-prompts", type=int, nargs="*", default=[],
                    help="extra prompt lengths, measured after the core grid while --more-seconds lasts")
    ap.add_argument("--more-rates", type=float, nargs="*", default=[], help="extra link rates (likewise)")
    ap.add_argument("--more-seconds", type=float, default=float("inf"),
                    help="per budget: extra points start only while the pair has measured for less than this")
    ap.add_argument("--deadline-s", type=float, default=0.0,
                    help="seconds from the start the whole run must fit (e.g. its timeout): extra points "
                         "start only while the budgets still to come fit before it (0: no deadline)")
    ap.add_argument("--latency-ms", type=float, default=0.0, help="one-way link latency per write")
    ap.add_argument("--repeats", type=int, default=1, help="requests per point (median, min and max reported)")
    ap.add_argument("--repeats-long", type=int, default=None, help="requests per point from --long-prompt tokens up")
    ap.add_argument("--long-prompt", type=int, default=16384, help="where --repeats-long starts")
    ap.add_argument("--server-args", default=DEFAULT_SERVER_ARGS, help="arguments for every server")
    ap.add_argument("--prefill-args", default="", help="extra arguments of the prefill (and single) server")
    ap.add_argument("--decode-args", default="", help="extra arguments of the decode server")
    ap.add_argument("--reference", choices=["single", "prefill"], default="single",
                    help="single: a non-disaggregated server; prefill: the PD prefill server with no peer")
    ap.add_argument("--peer-copy", action="store_true", help="also time a plain GPU0 -> GPU1 copy")
    ap.add_argument("--peer-copy-mib", type=int, default=512)
    ap.add_argument("--trace", action="store_true",
                    help="PD servers with --enable-pd-trace: the timed requests run untraced, then "
                         "--trace-repeats traced ones give each row its phase trace")
    ap.add_argument("--trace-repeats", type=int, default=1, help="traced requests per point (with --trace)")
    ap.add_argument("--profile-dir", default=None,
                    help="after each point, one more request under the prefill server's torch profiler "
                         "(/start_profile, /stop_profile): its trace goes here (benchmarks/pd/trace_timeline.py reads it)")
    ap.add_argument("--profile-rows", nargs="*", default=[],
                    help="profile only rows whose name contains one of these (e.g. 'reference' 'b=0.3 chunk@1024 10')")
    ap.add_argument("--vocab", type=int, default=49152, help="token ids are drawn below this")
    ap.add_argument("--name", default="ttft_vs_bandwidth", help="result file name (without extension)")
    ap.add_argument("--out-dir", default=None, help="where the JSON and PNG go (default benchmarks/results)")
    args = ap.parse_args()
    if 1.0 not in args.budgets:
        ap.error("--budgets must include 1.0 (the raw baseline every ratio is taken against)")
    rates, prompts = args.rates + args.more_rates, args.prompts + args.more_prompts
    if not all(0 <= r < 1e6 for r in rates) or min(prompts) < 1 or args.repeats < 1 or (args.repeats_long or 1) < 1:
        ap.error("--rates must be in [0, 1e6) Gbit/s (0: unpaced); --prompts and --repeats positive")
    if not (args.last_chunk == 0 or 32 <= args.last_chunk <= MAX_LAST_CHUNK):
        ap.error(f"--last-chunk must be 0 (off) or tokens in [32, {MAX_LAST_CHUNK}]")
    if not 1 <= args.trace_repeats <= 100:
        ap.error("--trace-repeats must be in [1, 100]")
    if not args.more_seconds >= 0 or not 0 <= args.deadline_s < float("inf"):
        ap.error("--more-seconds and --deadline-s must be >= 0 (--deadline-s finite)")
    if not all(0 < b <= 1 for b in args.budgets):
        ap.error("--budgets must be in (0, 1]")
    args.repeats_long = args.repeats_long or args.repeats
    args.variant_rates = args.variant_rates or None  # `--variant-rates` with no values: every rate
    server_args = shlex.split(args.server_args)
    args.prefill_args, args.decode_args = shlex.split(args.prefill_args), shlex.split(args.decode_args)
    model = next((server_args[i + 1] for i, a in enumerate(server_args) if a == "--model-path"), "smollm2-135m-instruct")
    device = "cuda" if "cuda" in args.server_args else "cpu"
    res = {"reference": {}, "pd": {}, "timing": {}}
    clock = Clock()
    start = clock.t0
    payload = {"benchmark": "ttft_vs_bandwidth", "device": device_name(device), "commit": git_commit(),
               "model": model, "params": vars(args), "reference_kind": args.reference,
               "link": "Mooncake transfer engine between the two servers, paced in the engine at each set rate "
                       "(unpaced: the transport Mooncake picked; see the servers' /server_info)"}
    if args.peer_copy:
        payload["peer_copy"] = res["peer_copy"] = peer_copy(args.peer_copy_mib, 5)
        print("peer copy GPU0 -> GPU1:", payload["peer_copy"], flush=True)

    def save() -> str:
        payload.update(res, seconds=time.time() - start, complete=False)
        payload["ratios"] = summarize(res, args)
        return write_json(args.name, payload, args.out_dir)

    try:
        for i, b in enumerate(args.budgets):  # in the order given (1.0 first: every ratio's base)
            run_budget(server_args, b, args, res, save, clock, pairs_after=len(args.budgets) - 1 - i)
            plot(payload, save()[:-5] + ".png")
    except KeyboardInterrupt:  # `timeout -s INT`: what was measured stays, plotted
        print(f"[{clock()} s] interrupted; the JSON keeps every point measured", flush=True)
        if res["pd"]:
            plot(payload, save()[:-5] + ".png")
        print(json.dumps(payload["ratios"], indent=1, default=str))
        sys.exit(130)
    payload["complete"] = True
    path = write_json(args.name, {**payload, "seconds": time.time() - start}, args.out_dir)
    print(json.dumps(payload["ratios"], indent=1, default=str))
    print("wrote", path)


if __name__ == "__main__":
    main()
