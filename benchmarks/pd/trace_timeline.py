"""What a GPU did during one profiled request: a torch.profiler chrome trace (`/start_profile` ...
`/stop_profile`, `<profile_id>-TP-0.trace.json.gz`) read as per-stream busy time, idle gaps and
overlap.

    python benchmarks/pd/trace_timeline.py TRACE [TRACE ...] [--gap-ms 1.0] [--bin-ms 10] [--copy-mib 1]
        [--json OUT]

Per trace (GPU activity only: kernels, memcpy and memset events, keyed by their CUDA stream):

    streams   per stream: events, busy ms (the union of its intervals), first / last event
    window    from the first to the last GPU event; the busiest stream is the "compute" stream
    gaps      stretches over --gap-ms where the compute stream ran nothing, with what ran on the
              other streams meanwhile and the host's CUDA runtime calls inside the gap (a long
              cudaStreamSynchronize / cudaEventSynchronize / cudaMemcpy there: the host waited)
    overlap   ms during which another stream ran beside the compute stream; per kernel name of the
              compute stream (its 8 largest by time): the median duration of instances that ran
              alone vs beside another stream's work (a ratio above 1: the neighbour slowed it)
    bins      per --bin-ms bin, the busy % of each stream (the timeline at a glance)
    copies    each copy of at least --copy-mib MiB (a KV segment's write is one): its bytes, GPU
              time and GB/s, and the host's CUDA runtime call that issued it (matched by CUPTI's
              correlation id: name, thread, host duration). A copy whose GPU time is its bytes'
              time at link rate, inside a longer write, spent the rest on the host.

A trace holds whatever the server ran between start and stop (warm-up included if it was
running): profile one request at a time.
"""
from __future__ import annotations

import argparse
import bisect
import gzip
import json
import statistics
import sys
from collections import defaultdict

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
WAIT_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
              "cudaMemcpyAsync", "cudaStreamWaitEvent", "cudaHostAlloc", "cudaMalloc", "cudaFree")


def load(path: str) -> list[dict]:
    """The trace's events (a .json or .json.gz chrome trace, or a bare list of events)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def _stream(e: dict):
    args = e.get("args") or {}
    return args.get("stream", e.get("tid"))


def union_ms(intervals: list[tuple[float, float]]) -> float:
    """Length (ms) of the union of [start, end) intervals given in microseconds."""
    return sum(e - s for s, e in _merged(intervals)) / 1e3


def _merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def _covered(merged: list[tuple[float, float]], s: float, e: float) -> float:
    """Microseconds of [s, e) covered by the disjoint sorted intervals `merged`."""
    i = max(0, bisect.bisect_right(merged, (s, float("inf"))) - 1)
    got = 0.0
    while i < len(merged) and merged[i][0] < e:
        a, b = merged[i]
        got += max(0.0, min(b, e) - max(a, s))
        i += 1
    return got


def _correlation(e: dict):
    return (e.get("args") or {}).get("correlation")


def copies(events: list[dict], min_bytes: int = 1 << 20) -> list[dict]:
    """GPU copies of at least `min_bytes`, in time order, each with the runtime call that issued
    it. Times are ms from the first such copy; GB/s is bytes over the GPU's own copy time."""
    calls = {_correlation(e): e for e in events
             if e.get("ph") == "X" and e.get("cat") == "cuda_runtime" and _correlation(e) is not None}
    big = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") == "gpu_memcpy" and "dur" in e
                  and int((e.get("args") or {}).get("bytes", 0)) >= min_bytes), key=lambda e: e["ts"])
    out = []
    for e in big:
        nbytes = int(e["args"]["bytes"])
        row = {"at_ms": round((e["ts"] - big[0]["ts"]) / 1e3, 3), "name": e.get("name"), "stream": str(_stream(e)),
               "mib": round(nbytes / (1 << 20), 2), "gpu_ms": round(e["dur"] / 1e3, 4),
               "gbps": round(nbytes / (e["dur"] * 1e3), 1) if e["dur"] else None}
        call = calls.get(_correlation(e))
        if call is not None:
            row.update(call=call.get("name"), call_tid=call.get("tid"), call_ms=round(call.get("dur", 0) / 1e3, 4),
                       queued_ms=round((e["ts"] - call["ts"]) / 1e3, 4))  # call start -> copy start
        out.append(row)
    return out


def summarize(events: list[dict], gap_ms: float = 1.0, bin_ms: float = 10.0, top: int = 8,
              copy_bytes: int = 1 << 20) -> dict:
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATS and "dur" in e]
    if not gpu:
        return {"error": "no GPU events in the trace (a CPU-only profile, or activities without GPU)"}
    by_stream: dict = defaultdict(list)
    for e in gpu:
        by_stream[_stream(e)].append(e)
    t0 = min(e["ts"] for e in gpu)
    t1 = max(e["ts"] + e["dur"] for e in gpu)
    streams = {}
    merged = {}
    for sid, evs in by_stream.items():
        iv = [(e["ts"], e["ts"] + e["dur"]) for e in evs]
        merged[sid] = _merged(iv)
        streams[str(sid)] = {"events": len(evs), "busy_ms": round(union_ms(iv), 3),
                             "first_ms": round((min(s for s, _ in iv) - t0) / 1e3, 3),
                             "last_ms": round((max(e for _, e in iv) - t0) / 1e3, 3),
                             "cats": dict(sorted(_count(e.get("cat") for e in evs).items()))}
    compute = max(by_stream, key=lambda sid: streams[str(sid)]["busy_ms"])
    others = _merged([iv for sid, m in merged.items() if sid != compute for iv in m])
    runtime = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") == "cuda_runtime"
                      and e.get("name") in WAIT_CALLS), key=lambda e: e["ts"])
    gaps = []
    comp = merged[compute]
    edges = [(t0, t0)] + comp + [(t1, t1)]
    for (_, a), (b, _) in zip(edges, edges[1:]):
        if (b - a) / 1e3 < gap_ms:
            continue
        waits = defaultdict(float)
        for e in runtime:
            s, f = max(e["ts"], a), min(e["ts"] + e["dur"], b)
            if f > s:
                waits[e["name"]] += (f - s) / 1e3
        gaps.append({"at_ms": round((a - t0) / 1e3, 3), "ms": round((b - a) / 1e3, 3),
                     "others_busy_ms": round(_covered(others, a, b) / 1e3, 3),
                     "host_waits_ms": {k: round(v, 3) for k, v in sorted(waits.items(), key=lambda kv: -kv[1])}})
    # per kernel name on the compute stream: alone vs beside another stream's work
    names = defaultdict(lambda: {"alone": [], "beside": [], "total": 0.0})
    for e in by_stream[compute]:
        if e.get("cat") != "kernel":
            continue
        s, f = e["ts"], e["ts"] + e["dur"]
        row = names[e["name"][:100]]
        row["total"] += e["dur"] / 1e3
        row["beside" if _covered(others, s, f) > 0 else "alone"].append(e["dur"])
    kernels = []
    for name, row in sorted(names.items(), key=lambda kv: -kv[1]["total"])[:top]:
        alone = statistics.median(row["alone"]) if row["alone"] else None
        beside = statistics.median(row["beside"]) if row["beside"] else None
        kernels.append({"name": name, "total_ms": round(row["total"], 3), "alone_n": len(row["alone"]),
                        "beside_n": len(row["beside"]),
                        "alone_median_us": None if alone is None else round(alone, 2),
                        "beside_median_us": None if beside is None else round(beside, 2),
                        "beside_over_alone": None if not (alone and beside) else round(beside / alone, 3)})
    overlap_ms = sum(_covered(others, s, e) for s, e in comp) / 1e3
    bins = []
    width = bin_ms * 1e3
    start = t0
    while start < t1:
        end = start + width
        bins.append({"at_ms": round((start - t0) / 1e3, 1),
                     **{str(sid): round(100 * _covered(m, start, end) / width) for sid, m in merged.items()}})
        start = end
    return {"window_ms": round((t1 - t0) / 1e3, 3), "compute_stream": str(compute), "streams": streams,
            "compute_idle_ms": round((t1 - t0) / 1e3 - streams[str(compute)]["busy_ms"], 3),
            "gaps": gaps, "overlap_ms": round(overlap_ms, 3), "compute_kernels": kernels, "bins": bins,
            "copies": copies(events, copy_bytes)}


def _count(xs) -> dict:
    out: dict = defaultdict(int)
    for x in xs:
        out[x] += 1
    return out


def text(name: str, s: dict) -> str:
    if "error" in s:
        return f"== {name}: {s['error']}"
    lines = [f"== {name}: window {s['window_ms']:.1f} ms, compute stream {s['compute_stream']} idle "
             f"{s['compute_idle_ms']:.1f} ms, another stream beside it {s['overlap_ms']:.1f} ms"]
    for sid, st in s["streams"].items():
        lines.append(f"  stream {sid}: {st['events']} events {st['cats']}, busy {st['busy_ms']:.1f} ms, "
                     f"{st['first_ms']:.1f} -> {st['last_ms']:.1f} ms")
    for g in s["gaps"]:
        lines.append(f"  gap at {g['at_ms']:.1f} ms: {g['ms']:.2f} ms (others busy {g['others_busy_ms']:.2f}) "
                     f"host waits {g['host_waits_ms']}")
    for k in s["compute_kernels"]:
        lines.append(f"  {k['total_ms']:8.2f} ms alone {k['alone_n']} x {k['alone_median_us']} us, beside "
                     f"{k['beside_n']} x {k['beside_median_us']} us (x{k['beside_over_alone']}) {k['name']}")
    for c in s.get("copies", []):
        call = (f", issued by {c['call']} (thread {c['call_tid']}, {c['call_ms']:.3f} ms, copy began "
                f"{c['queued_ms']:.3f} ms after it)") if "call" in c else ""
        lines.append(f"  copy at {c['at_ms']:.1f} ms: {c['mib']} MiB in {c['gpu_ms']:.3f} ms on the GPU "
                     f"({c['gbps']} GB/s) stream {c['stream']} {c['name']}{call}")
    sids = list(s["streams"])
    lines.append("  bins (busy % per stream " + " ".join(sids) + "):")
    lines.append("   " + " ".join(f"{b['at_ms']:.0f}:" + "/".join(str(b.get(sid, 0)) for sid in sids)
                                  for b in s["bins"]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--gap-ms", type=float, default=1.0, help="report compute-stream idle stretches above this")
    ap.add_argument("--bin-ms", type=float, default=10.0)
    ap.add_argument("--copy-mib", type=float, default=1.0, help="list GPU copies of at least this many MiB")
    ap.add_argument("--json", default=None, help="also write the summaries here")
    a = ap.parse_args(argv)
    if a.gap_ms <= 0 or a.bin_ms <= 0 or a.copy_mib <= 0:
        ap.error("--gap-ms, --bin-ms and --copy-mib must be > 0")
    out = {}
    for path in a.traces:
        try:
            out[path] = summarize(load(path), a.gap_ms, a.bin_ms, copy_bytes=int(a.copy_mib * (1 << 20)))
        except (OSError, ValueError, KeyError) as exc:
            out[path] = {"error": f"{type(exc).__name__}: {exc}"}
        print(text(path, out[path]), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    sys.exit(0 if all("error" not in v for v in main().values()) else 1)
