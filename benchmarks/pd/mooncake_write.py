"""Mooncake's GPU-to-GPU write against a plain peer copy, by size and by what else the writer runs.

    python benchmarks/pd/mooncake_write.py [--sizes-mib 16 64 256 512 1024] [--repeats 10]
        [--loads idle gemm gil gil@200] [--threads 1 2 4] [--out-dir DIR]

PD on one host moves KV with Mooncake's CUDA build over NVLink (MC_INTRANODE_NVLINK): the
prefill's sender thread calls `MooncakeTransferEngine.write` once per packed segment. This
measures that call outside the servers, so what a PD trace's `p.wire` spans show can be held
against the bytes: a receiver process on GPU 1 registers a transfer buffer, a writer process on
GPU 0 registers its own and, for each size, times

    mooncake      one `MooncakeTransferEngine.write` of the size (the servers' call, its lock
                  included), wall clock around the call (it returns once the bytes are there)
    mooncake xN   the same bytes as N equal writes issued at once from N threads through the raw
                  engine (`transfer_sync_write`), wall clock from the first start to the last end
    torch         `dst.copy_(src)` GPU 0 -> GPU 1 in the writer (the peer copy ttft_vs_bandwidth
                  holds the KV rate against), its streams synchronized on both GPUs

under each load in the writer process:

    idle          nothing else
    gemm          a thread keeps bf16 8192^3 matmuls queued on a side stream of GPU 0 (a prefill
                  forward's share of the GPU beside the write)
    gil           a thread runs pure Python without pause (the scheduler's host work; a write
                  releases the GIL inside Mooncake and must take it back to return)
    gil@US        the same with the GIL switch interval at US microseconds during the load
                  (sys.setswitchinterval; the servers' SGL_KVXFER_GIL_SWITCH_US)

`repeats` timed runs after two warm-ups; the JSON keeps the median, min, max and every run in
GB/s (1e9 bytes per second). The receiver checks the last write's bytes by their device checksum,
so a fast wrong copy cannot pass. Needs two GPUs and Mooncake's CUDA build; on anything else it
says what is missing and writes nothing.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common.report import device_name, git_commit, write_json  # noqa: E402

HOST = "127.0.0.1"
WARMUPS = 2


def _engine_and_buffer(rank: int, nbytes: int):
    os.environ["MC_INTRANODE_NVLINK"] = "true"
    import torch

    torch.cuda.set_device(rank)
    from sgl_kvxfer.disagg.buffers import TransferBuffer
    from sgl_kvxfer.disagg.mooncake import MooncakeTransferEngine

    engine = MooncakeTransferEngine(HOST, gpu_id=rank)
    buf = TransferBuffer(nbytes, f"cuda:{rank}", engine.gpu_memory)
    if not buf.on_device:
        raise RuntimeError(f"rank {rank}: the transfer buffer is in {buf.location}, not GPU memory")
    engine.register(buf.data_ptr(), buf.numel())
    return engine, buf


def _receiver(nbytes: int, conn) -> None:
    from sgl_kvxfer.disagg.buffers import wsum64

    engine, buf = _engine_and_buffer(1, nbytes)
    conn.send((engine.session_id(), buf.data_ptr()))
    while True:
        msg = conn.recv()
        if msg is None:
            return
        n = msg
        conn.send(wsum64(buf[:n]))


class _Load:
    """A background load in the writer process, started and stopped around one measurement."""

    def __init__(self, spec: str):
        self.kind, _, switch_us = spec.partition("@")
        self.switch_s = int(switch_us) / 1e6 if switch_us else None
        self._stop, self._thread, self._switch_before = threading.Event(), None, None

    def __enter__(self):
        if self.switch_s is not None:
            self._switch_before = sys.getswitchinterval()
            sys.setswitchinterval(self.switch_s)
        if self.kind == "idle":
            return self
        target = {"gemm": self._gemm, "gil": self._gil}[self.kind]
        self._thread = threading.Thread(target=target, daemon=True)
        self._thread.start()
        time.sleep(0.2)  # the load is running before the first timed write
        return self

    def __exit__(self, *exc):
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
        if self._switch_before is not None:
            sys.setswitchinterval(self._switch_before)

    def _gemm(self) -> None:
        import torch

        torch.cuda.set_device(0)
        a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda:0")
        stream = torch.cuda.Stream(device=0)
        with torch.cuda.stream(stream):
            while not self._stop.is_set():
                for _ in range(4):
                    a @ a
                stream.synchronize()  # a bounded queue: the load stops soon after it is told

    def _gil(self) -> None:
        x = 0
        while not self._stop.is_set():
            for i in range(10000):
                x += i * i


def _timed(fn, repeats: int) -> list[float]:
    runs = []
    for i in range(WARMUPS + repeats):
        start = time.perf_counter()
        fn()
        if i >= WARMUPS:
            runs.append(time.perf_counter() - start)
    return runs


def _summary(nbytes: int, runs: list[float]) -> dict:
    rates = [nbytes / s / 1e9 for s in runs]
    return {"GBps": statistics.median(rates), "min_GBps": min(rates), "max_GBps": max(rates),
            "ms": 1e3 * statistics.median(runs), "runs_GBps": rates}


def _writer(args, conn, results) -> None:
    import torch

    max_bytes = max(args.sizes_mib) << 20
    engine, buf = _engine_and_buffer(0, max_bytes)
    peer_session, peer_addr = conn.recv()
    buf.tensor.random_(0, 255)
    peer_dst = torch.empty(max_bytes, dtype=torch.uint8, device="cuda:1")
    torch.cuda.synchronize(0)
    raw = engine._engine  # the N-thread variant bypasses the wrapper's lock on purpose

    def split_write(nbytes: int, n: int) -> None:
        part = nbytes // n
        errors = []

        def one(k: int) -> None:
            ret = raw.transfer_sync_write(peer_session, buf.data_ptr() + k * part, peer_addr + k * part,
                                          part if k < n - 1 else nbytes - k * part)
            if ret != 0:
                errors.append(ret)

        threads = [threading.Thread(target=one, args=(k,)) for k in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise RuntimeError(f"a split write failed: {errors}")

    def peer_copy(nbytes: int) -> None:
        # the copy's own streams, not the whole devices: the gemm load's side stream is not waited for
        peer_dst[:nbytes].copy_(buf.tensor[:nbytes])
        torch.cuda.current_stream(1).synchronize()
        torch.cuda.current_stream(0).synchronize()

    rows = []
    for load in args.loads:
        with _Load(load):
            for mib in args.sizes_mib:
                nbytes = mib << 20
                methods = {"mooncake": lambda: engine.write(peer_session, buf.data_ptr(), peer_addr, nbytes)}
                for n in args.threads:
                    if n > 1:
                        methods[f"mooncake x{n}"] = lambda n=n: split_write(nbytes, n)
                methods["torch"] = lambda: peer_copy(nbytes)
                for method, fn in methods.items():
                    row = {"load": load, "mib": mib, "method": method, **_summary(nbytes, _timed(fn, args.repeats))}
                    rows.append(row)
                    print(f"{load:8s} {mib:5d} MiB {method:12s} {row['GBps']:7.1f} GB/s "
                          f"[{row['min_GBps']:.1f}, {row['max_GBps']:.1f}] {row['ms']:.3f} ms", flush=True)
    # the last write's bytes, checked where they landed
    n = max_bytes
    engine.write(peer_session, buf.data_ptr(), peer_addr, n)
    from sgl_kvxfer.disagg.buffers import wsum64

    conn.send(n)
    bytes_equal = conn.recv() == wsum64(buf[:n])
    conn.send(None)
    results.put({"rows": rows, "bytes_equal": bytes_equal, "describe": engine.describe(),
                 "peer_access": torch.cuda.can_device_access_peer(0, 1)})


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loads = sorted({r["load"] for r in rows}, key=[r["load"] for r in rows].index)
    fig, axes = plt.subplots(1, len(loads), figsize=(5 * len(loads), 4), sharey=True, squeeze=False)
    for ax, load in zip(axes[0], loads):
        mine = [r for r in rows if r["load"] == load]
        for method in sorted({r["method"] for r in mine}, key=[r["method"] for r in mine].index):
            pts = [r for r in mine if r["method"] == method]
            ax.plot([r["mib"] for r in pts], [r["GBps"] for r in pts], "o-", label=method)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("write size (MiB)")
        ax.set_title(f"load: {load}")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("GB/s (median)")
    axes[0][0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes-mib", type=int, nargs="+", default=[16, 64, 256, 512, 1024])
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--loads", nargs="+", default=["idle", "gemm", "gil", "gil@200"],
                   help="idle, gemm, gil, or gil@US (the GIL switch interval at US microseconds)")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--out-dir", default=None)
    p.add_argument("--timeout-s", type=float, default=240.0)
    args = p.parse_args(argv)
    if args.repeats < 1 or min(args.sizes_mib) < 1 or min(args.threads) < 1:
        p.error("--repeats, --sizes-mib and --threads take positive integers")
    for load in args.loads:
        kind, at, us = load.partition("@")
        if kind not in ("idle", "gemm", "gil") or (at and not (us.isdigit() and int(us) > 0)):
            p.error(f"--loads: {load!r} is not idle, gemm, gil or KIND@US with US > 0 microseconds")

    import torch

    if torch.cuda.device_count() < 2:
        print(f"mooncake_write needs two GPUs; this machine has {torch.cuda.device_count()}: nothing written")
        return 2
    from sgl_kvxfer.disagg.mooncake import build_has_cuda, gpu_build_missing

    if not build_has_cuda():
        print(gpu_build_missing("benchmarks/pd/mooncake_write.py") + ": nothing written")
        return 2

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    writer_end, receiver_end = ctx.Pipe()
    receiver = ctx.Process(target=_receiver, args=(max(args.sizes_mib) << 20, receiver_end), daemon=True)
    receiver.start()
    writer = ctx.Process(target=_writer, args=(args, writer_end, results), daemon=True)
    writer.start()
    try:
        got = results.get(timeout=args.timeout_s)
    finally:
        for proc in (writer, receiver):
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    if not got["bytes_equal"]:
        raise RuntimeError("the receiver's checksum of the last write differs from the writer's")
    dev = device_name("cuda")
    n_gpu = torch.cuda.device_count()
    tag = f"{dev.replace(' ', '_')}_x{n_gpu}"
    payload = {"benchmark": "mooncake_write", "device": f"{n_gpu}x {dev}", "commit": git_commit(),
               "params": vars(args), "engine": got["describe"], "peer_access": got["peer_access"],
               "bytes_equal": got["bytes_equal"], "rows": got["rows"]}
    path = write_json(f"mooncake_write_{tag}", payload, args.out_dir)
    plot(got["rows"], path[:-5] + ".png", f"Mooncake write vs peer copy, GPU0 -> GPU1 ({n_gpu}x {dev})")
    print("wrote", path, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
