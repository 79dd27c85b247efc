"""Timing memory-bound kernels the way graphed decode runs them, and the bandwidths to hold them to.

    rotation_copies(nbytes, device)      how many copies of a call's inputs keep it out of L2
    time_rotating(calls, device, iters)  ms of ONE call: `calls` (one closure per input copy) are
                                         captured back to back in one CUDA graph and replayed;
                                         median replay time / len(calls)
    copy_bandwidth_Bps(device)           read + write bytes/s of a device-to-device copy
    sdpa_decode(...)                     torch SDPA (default backend, enable_gqa) on one decode
                                         step over dense KV: its ms and effective read bandwidth

L2: the copies together span >= L2_FACTOR x the L2 cache (capped at MAX_COPIES), and each is read
once per replay, so a call finds its inputs in DRAM, as a decode layer does in the engine (the
layer's weights pass through L2 between two attention calls). No flush kernel runs inside the
timed region. CPU (`device.type == "cpu"`): eager calls timed with perf_counter, two copies; that
checks that the code runs and says nothing about any kernel.
"""
from __future__ import annotations

import math
import statistics
import time
from typing import Callable, Sequence

import torch

L2_FACTOR = 3
MAX_COPIES = 256


def rotation_copies(nbytes: int, device: torch.device, max_bytes: int | None = None,
                    max_copies: int = MAX_COPIES) -> int:
    """Copies of an `nbytes` input set that together span L2_FACTOR x L2 (>= 1, <= max_copies,
    and at most max_bytes of them in total when given)."""
    if device.type != "cuda":
        return 2
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20)
    n = min(max_copies, max(1, math.ceil(L2_FACTOR * l2 / max(nbytes, 1))))
    if max_bytes is not None:
        n = min(n, max(1, max_bytes // max(nbytes, 1)))
    return n


def _capture(calls: Sequence[Callable]):
    """One CUDA graph running every call in order; (replay, True), or (eager loop, False) where
    capture fails (a launcher that syncs with the host)."""
    def eager():
        for c in calls:
            c()

    try:
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            eager()
        torch.cuda.synchronize()
        return g.replay, True
    except Exception as exc:  # noqa: BLE001
        print("graph capture failed, timing eager:", repr(exc)[:200], flush=True)
        torch.cuda.synchronize()
        return eager, False


def time_rotating(calls: Sequence[Callable], device: torch.device, iters: int = 10, warmup: int = 2,
                  graph: bool = True) -> dict:
    """{"ms": median ms per call, "ms_min", "ms_max" (the spread over the `iters` replays), "copies",
    "graphed", "iters"}; every call is run once eagerly first (JIT, autotune and library plans
    happen outside the capture)."""
    for c in calls:
        c()
    cuda = device.type == "cuda"
    if cuda:
        run, graphed = _capture(calls) if graph else (lambda: [c() for c in calls], False)
    else:
        run, graphed = (lambda: [c() for c in calls]), False
    for _ in range(warmup):
        run()
    ts = []
    for _ in range(iters):
        if cuda:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            run()
            e.record()
            e.synchronize()
            ts.append(s.elapsed_time(e))
        else:
            t = time.perf_counter()
            run()
            ts.append(1e3 * (time.perf_counter() - t))
    n = len(calls)
    return {"ms": statistics.median(ts) / n, "ms_min": min(ts) / n, "ms_max": max(ts) / n, "copies": n,
            "graphed": graphed, "iters": iters}


def copy_bandwidth_Bps(device: torch.device, nbytes: int | None = None, iters: int = 10) -> float:
    """Device-to-device copy of nbytes (1 GiB on CUDA, 64 MiB on CPU): (read + write) bytes / s."""
    nbytes = nbytes or ((1 << 30) if device.type == "cuda" else (64 << 20))
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    ms = time_rotating([lambda: b.copy_(a)], device, iters, graph=False)["ms"]
    del a, b
    return 2 * nbytes / (ms * 1e-3)


def sdpa_backend_name(q, k, v) -> str:
    """The backend torch's default SDPA dispatch picks for these inputs (enable_gqa=True)."""
    try:
        from torch.nn.attention import SDPBackend

        choice = torch._fused_sdp_choice(q, k, v, enable_gqa=True)
        return SDPBackend(choice).name
    except Exception as exc:  # noqa: BLE001 - private API: record what is known
        return f"unknown ({type(exc).__name__})"


SDPA_BACKENDS = ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION")


def sdpa_decode(batch: int, hq: int, hkv: int, ctx: int, d: int, dtype: torch.dtype, device: torch.device,
                iters: int = 10, max_bytes: int | None = None, seed: int = 0, backend: str | None = None) -> dict:
    """torch SDPA, enable_gqa=True, on one decode step: q [B, Hq, 1, D] over dense K/V
    [B, Hkv, ctx, D], rotated over batch slices of one [copies * B, ...] allocation. backend: one
    of SDPA_BACKENDS forced (torch.nn.attention.sdpa_kernel), None: torch's default dispatch.
    -> {"ms", "bytes" (K + V + q read, o written), "Bps" (bytes / time: SDPA's effective read
    bandwidth), "backend", "copies", ...}."""
    import contextlib

    import torch.nn.functional as F

    g = torch.Generator(device=device).manual_seed(seed)
    kv_bytes = 2 * batch * hkv * ctx * d * torch.finfo(dtype).bits // 8
    copies = rotation_copies(kv_bytes, device, max_bytes)
    q = torch.randn(batch, hq, 1, d, dtype=dtype, device=device, generator=g)
    k = torch.randn(copies * batch, hkv, ctx, d, dtype=dtype, device=device, generator=g)
    v = torch.randn(copies * batch, hkv, ctx, d, dtype=dtype, device=device, generator=g)
    kvs = [(k[i * batch:(i + 1) * batch], v[i * batch:(i + 1) * batch]) for i in range(copies)]  # views
    if backend is None:
        forced = contextlib.nullcontext
    else:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        forced = lambda: sdpa_kernel(getattr(SDPBackend, backend))  # noqa: E731

    def call(kk, vv):
        with forced():
            return F.scaled_dot_product_attention(q, kk, vv, enable_gqa=True)

    calls = [lambda kk=kk, vv=vv: call(kk, vv) for kk, vv in kvs]
    res = time_rotating(calls, device, iters)
    nbytes = kv_bytes + 2 * q.numel() * q.element_size()
    res.update(bytes=nbytes, Bps=nbytes / (res["ms"] * 1e-3), backend=backend or sdpa_backend_name(q, *kvs[0]),
               shape={"batch": batch, "hq": hq, "hkv": hkv, "ctx": ctx, "d": d, "dtype": str(dtype)})
    del k, v, kvs, calls
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return res
