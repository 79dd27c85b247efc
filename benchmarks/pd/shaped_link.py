"""The shaped link: achieved rate of a paced Mooncake TCP transfer vs the rate it is set to.

    python benchmarks/pd/shaped_link.py [--rates 1 10 25 100] [--mib 256] [--out-dir DIR]

PD experiments run the prefill/decode pair on one machine, where KV moves over loopback at
whatever the host manages. `--kv-transfer-rate-gbps R --kv-transfer-latency-ms L` on the prefill
server wraps its transfer engine in disagg/shaped.py: every write holds a link of rate R for
n*8/R seconds after the previous write released it and completes L ms later. This measures what
that gives over the real engine: a receiver process registers a buffer, a sender process writes
`--mib` MiB into it in segments of `--segment-mib` through the paced engine, and the rate is
bytes / (last write returned - first write started). A Mooncake write returns once the bytes are
in the peer's memory, and the receiver checks the bytes it got (xxh3) so a fast wrong copy
cannot pass. Above the host's own loopback rate the pacing cannot help: the achieved rate is the
engine's, and the JSON says so.

Why a limiter inside the engine, not kernel shaping: shaping `lo` would slow every process on
the machine (tests, the router, the servers' HTTP), and shaping a veth pair needs each server in
its own network namespace with its own address, which the router, the bootstrap server and
Mooncake's P2P handshake all have to reach; `tc netem` (latency) is also missing from many
container kernels. The in-engine limiter paces exactly the KV bytes, the traffic being studied.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common.report import device_name, git_commit, write_json  # noqa: E402

HOST = "127.0.0.1"


def _receiver(nbytes: int, conn) -> None:
    import torch
    import xxhash

    from sgl_kvxfer.disagg import create_transfer_engine

    engine = create_transfer_engine("mooncake", HOST)
    buf = torch.zeros(nbytes, dtype=torch.uint8)
    engine.register(buf.data_ptr(), nbytes)
    conn.send((engine.session_id(), buf.data_ptr()))
    while True:
        msg = conn.recv()
        if msg == "stop":
            break
        conn.send(xxhash.xxh3_64_intdigest(memoryview(buf.numpy())))
        buf.zero_()
    engine.close()


def measure(rates: list[float], latency_ms: float, nbytes: int, segment: int, repeats: int) -> list[dict]:
    import torch
    import xxhash

    from sgl_kvxfer.disagg import create_transfer_engine

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(nbytes, child), daemon=True)
    proc.start()
    try:
        peer, dst = parent.recv()
        src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
        want = xxhash.xxh3_64_intdigest(memoryview(src.numpy()))
        rows = []
        for rate in [0.0, *rates]:  # 0: unpaced, the host's own loopback rate
            engine = create_transfer_engine("mooncake", HOST, rate, latency_ms if rate else 0.0)
            engine.register(src.data_ptr(), nbytes)
            best = None
            for _ in range(repeats):
                start = time.perf_counter()
                for off in range(0, nbytes, segment):
                    engine.write(peer, src.data_ptr() + off, dst + off, min(segment, nbytes - off))
                seconds = time.perf_counter() - start
                parent.send("check")
                if parent.recv() != want:
                    raise RuntimeError(f"receiver's bytes differ from the sender's at rate {rate}")
                best = seconds if best is None else min(best, seconds)
            engine.close()
            achieved = nbytes * 8 / best / 1e9
            row = {"set_gbps": rate or None, "latency_ms": latency_ms if rate else 0.0, "seconds": best,
                   "achieved_gbps": achieved, "ratio": achieved / rate if rate else None}
            rows.append(row)
            label = f"{rate:g} Gbit/s" if rate else "unpaced"
            print(f"{label:>14}: {achieved:7.2f} Gbit/s" + (f" ({100 * achieved / rate:.0f}% of the setting)" if rate else ""))
        return rows
    finally:
        parent.send("stop")
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()


def plot(payload: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in payload["results"] if r["set_gbps"]]
    host = next(r["achieved_gbps"] for r in payload["results"] if not r["set_gbps"])
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [r["set_gbps"] for r in rows]
    ax.plot(xs, xs, "--", color="gray", label="setting")
    ax.plot(xs, [r["achieved_gbps"] for r in rows], "o-", label="achieved (paced Mooncake TCP)")
    ax.axhline(host, color="tab:red", lw=0.8, label=f"unpaced loopback ({host:.1f} Gbit/s)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("link rate setting (Gbit/s)")
    ax.set_ylabel("achieved (Gbit/s)")
    ax.set_title(f"Shaped KV link, {payload['params']['mib']} MiB, {payload['device']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rates", type=float, nargs="+", default=[1, 10, 25, 100], help="link rates to set, Gbit/s")
    ap.add_argument("--latency-ms", type=float, default=0.0, help="one-way latency added to every write")
    ap.add_argument("--mib", type=int, default=256, help="bytes written per measurement, MiB")
    ap.add_argument("--segment-mib", type=float, default=4.0, help="bytes per engine write, MiB")
    ap.add_argument("--repeats", type=int, default=2, help="measurements per rate (the fastest is kept)")
    ap.add_argument("--name", default="shaped_link", help="result file name (without extension)")
    ap.add_argument("--out-dir", default=None, help="where the JSON and PNG go (default benchmarks/results)")
    args = ap.parse_args()
    if args.mib <= 0 or args.segment_mib <= 0 or any(r <= 0 for r in args.rates):
        ap.error("--mib, --segment-mib and --rates must be positive")
    rows = measure(args.rates, args.latency_ms, args.mib << 20, int(args.segment_mib * (1 << 20)), args.repeats)
    payload = {"benchmark": "shaped_link", "device": device_name("cpu"), "commit": git_commit(),
               "params": vars(args), "method": "in-engine pacing (disagg/shaped.py)",
               "results": rows}
    path = write_json(args.name, payload, args.out_dir)
    plot(payload, path[:-5] + ".png")
    print("wrote", path)


if __name__ == "__main__":
    main()
