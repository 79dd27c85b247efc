"""A link of a chosen rate and latency, paced inside the transfer engine.

Used where kernel traffic shaping is unavailable (benchmarks/pd/shaped_link.py shapes a veth
pair with tc when it can; that covers every byte on the wire, this covers only KV writes). Writes
are serialized at the link rate: a write of n bytes holds the link for n * 8 / rate seconds after
the previous write released it, and completes `latency_ms` after that (one-way propagation).
"""
from __future__ import annotations

import threading
import time

from sgl_kvxfer.disagg.base import TransferEngine


class ShapedTransferEngine(TransferEngine):
    def __init__(self, inner: TransferEngine, rate_gbps: float, latency_ms: float = 0.0):
        self.inner = inner
        self.name = f"{inner.name}+shaped"
        self.gpu_memory = inner.gpu_memory
        self._free_at = 0.0  # monotonic time the link is free again
        self._lock = threading.Lock()
        self.set_link(rate_gbps, latency_ms)

    def set_link(self, rate_gbps: float, latency_ms: float = 0.0) -> None:
        """Change the pacing; writes that start afterwards see it (any thread)."""
        with self._lock:
            self.rate_bps = rate_gbps * 1e9 if rate_gbps > 0 else float("inf")
            self.latency_s = latency_ms / 1e3

    @property
    def paced(self) -> bool:
        """Whether writes are held to a rate or a latency (rate 0 and latency 0: not)."""
        return self.rate_bps != float("inf") or self.latency_s > 0

    def session_id(self) -> str:
        return self.inner.session_id()

    def register(self, addr: int, nbytes: int) -> None:
        self.inner.register(addr, nbytes)

    def write(self, peer: str, src_addr: int, dst_addr: int, nbytes: int) -> None:
        with self._lock:
            start = max(time.monotonic(), self._free_at)
            self._free_at = start + nbytes * 8 / self.rate_bps
            done_at = self._free_at + self.latency_s
        self.inner.write(peer, src_addr, dst_addr, nbytes)
        delay = done_at - time.monotonic()
        if delay > 0:
            time.sleep(delay)

    def describe(self) -> dict:
        return {**self.inner.describe(), "paced_gbps": self.rate_bps / 1e9, "paced_latency_ms": 1e3 * self.latency_s}

    def close(self) -> None:
        self.inner.close()
