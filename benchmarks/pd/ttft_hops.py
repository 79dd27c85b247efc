"""Where a PD request's time to first token goes outside the decode's phase trace.

    python benchmarks/pd/ttft_hops.py [--prompt 512] [--repeats 7] [--server-args "..."] [--out-dir DIR]

Starts a prefill P and a decode D (both `--enable-pd-trace`), a single server S and the real
`sglang_router` in front of P and D, then for `--repeats` streamed requests of one prompt length:

    router    client TTFT through the router, the trace's critical_ms (earlier arrival -> the
              decode queuing the first token) and the decode's d.emit (first token queued -> its
              first chunk written on the HTTP stream); `gap_ms` = TTFT - critical_ms
    direct    the router's body sent to P and D at once by this client: D's first chunk and the
              end of P's reply, each from the send (the router relays D's stream only after
              P's reply has ended, so max(d_first, p_end) is the TTFT it can give)
    single    S's client TTFT

Medians with [min, max], printed; with `--out-dir`, ttft_hops.json there keeps every request. CPU numbers show fixed costs
(loop wake-ups, hops, the order of the prefill's reply), not GPU speeds.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import statistics
import sys
import threading
import time

import requests

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common.report import device_name, write_json  # noqa: E402
from common.sglang_clients import first_chunk  # noqa: E402

from sgl_kvxfer.testing.servers import free_port, start_router, start_server, stop_all  # noqa: E402

DEFAULT_SERVER_ARGS = ("--max-total-tokens 8192 --chunked-prefill-size 256 --max-running-requests 8 "
                       "--context-length 4096 --log-level warning")


def body(n: int, seed: int) -> dict:
    rng = random.Random(seed)
    return {"input_ids": [rng.randrange(100, 40000) for _ in range(n)], "stream": True,
            "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}


def reply_end(url: str, req: dict, t0: float, out: dict) -> None:
    """Seconds from t0 to the end of POST url/generate's body (as the router reads the prefill's)."""
    with requests.post(url + "/generate", json=req, stream=True, timeout=600) as r:
        for _ in r.iter_content(None):
            pass
    out["p_end"] = time.perf_counter() - t0


def direct(p_url: str, d_url: str, req: dict, room: int, bp: int) -> dict:
    req = {**req, "bootstrap_host": "127.0.0.1", "bootstrap_port": bp, "bootstrap_room": room}
    got: dict = {}
    t0 = time.perf_counter()
    th = threading.Thread(target=reply_end, args=(p_url, req, t0, got))
    th.start()
    d_first, meta = first_chunk(d_url, req, t0, 600)
    th.join()
    trace = meta.get("kv_transfer", {}).get("trace", {})
    return {"d_first_ms": 1e3 * d_first, "p_end_ms": 1e3 * got["p_end"], "critical_ms": trace.get("critical_ms"),
            "emit_ms": _span(trace, "d.emit")}


def _span(trace: dict, name: str) -> float | None:
    return next((d for n, _, d in trace.get("phases", []) if n == name), None)


def summary(rows: list[dict]) -> dict:
    out = {}
    for k in rows[0]:
        vals = [r[k] for r in rows if r.get(k) is not None]
        if vals:
            out[k] = {"median": round(statistics.median(vals), 2), "min": round(min(vals), 2),
                      "max": round(max(vals), 2)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--server-args", default=DEFAULT_SERVER_ARGS)
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args()
    if args.prompt < 1 or args.repeats < 1:
        ap.error("--prompt and --repeats must be positive")
    common = shlex.split(args.server_args)
    bp = free_port()
    handles = []
    try:
        p = start_server([*common, "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(bp),
                          "--enable-pd-trace"], name="hops_prefill")
        handles.append(p)
        d = start_server([*common, "--disaggregation-mode", "decode", "--enable-pd-trace"], name="hops_decode")
        handles.append(d)
        s = start_server(common, name="hops_single")
        handles.append(s)
        router = start_router([(p.url, bp)], [d.url])
        handles.append(router)
        seed = iter(range(1, 10**6))
        for url in (router.url, s.url):  # warm-up: first-request costs stay out
            for _ in range(2):
                first_chunk(url, body(args.prompt, next(seed)), time.perf_counter(), 600)
        rows: dict[str, list] = {"router": [], "direct": [], "single": []}
        for i in range(args.repeats):
            t, meta = first_chunk(router.url, body(args.prompt, next(seed)), time.perf_counter(), 600)
            trace = meta.get("kv_transfer", {}).get("trace", {})
            crit = trace.get("critical_ms")
            rows["router"].append({"ttft_ms": 1e3 * t, "critical_ms": crit, "emit_ms": _span(trace, "d.emit"),
                                   "first_step_ms": _span(trace, "d.first_step"),
                                   "gap_ms": None if crit is None else 1e3 * t - crit})
            rows["direct"].append(direct(p.url, d.url, body(args.prompt, next(seed)), 50_000 + i, bp))
            t, _ = first_chunk(s.url, body(args.prompt, next(seed)), time.perf_counter(), 600)
            rows["single"].append({"ttft_ms": 1e3 * t})
        device = common[common.index("--device") + 1] if "--device" in common else "cpu"
        result = {"device": device_name(device), "prompt": args.prompt, "repeats": args.repeats,
                  "server_args": args.server_args, "summary": {k: summary(v) for k, v in rows.items()}, "rows": rows}
        print(json.dumps(result["summary"], indent=1))
        if args.out_dir:
            print("wrote", write_json("ttft_hops", result, args.out_dir))
    finally:
        stop_all(*reversed(handles))


if __name__ == "__main__":
    main()
