"""Mooncake's Transfer Engine (PyPI `mooncake-transfer-engine-non-cuda`), SGLang's default PD
backend, over its TCP transport with peer-to-peer handshakes (no metadata server).

Each process runs one engine, reached by peers at the session id "host:rpc_port". A write copies
bytes from this process's registered memory into a peer's registered memory
(`transfer_sync_write`); on a CPU host the TCP transport moves them, on GPU hosts the same path
runs over host memory (our buffers are host buffers; RDMA would need the CUDA build and an IB
device). A write to a peer that is gone returns an error code, which becomes TransferError.
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
import threading

from sgl_kvxfer.disagg.base import TransferEngine, TransferError

logger = logging.getLogger(__name__)


# What Mooncake's glog writes on every engine start, none of it the user's concern: glog's notice
# that it logs before InitGoogleLogging, and an ERROR line from the P2P handshake's metadata
# lookup of this engine's own segment before it is published. Dropped from stderr during
# `initialize` only; everything else it writes there passes through.
_START_NOISE = ("Logging before InitGoogleLogging() is written to STDERR", "Local segment descriptor not found")


@contextlib.contextmanager
def _stderr_without(noise: tuple[str, ...]):
    """Capture file descriptor 2 (glog writes there from C++) and write back every line that
    contains none of `noise`."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            for line in capture.read().splitlines(keepends=True):
                if not any(n.encode() in line for n in noise):
                    os.write(2, line)


def load_engine_class():
    """mooncake.engine.TransferEngine, or ImportError with what is missing and how to get it."""
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # glog; read when the library loads
    try:
        from mooncake.engine import TransferEngine as MooncakeEngine
    except ImportError as e:
        hint = (" (the engine links libibverbs.so.1 even for TCP: install rdma-core's libibverbs1, e.g. "
                "`apt-get install libibverbs1`)") if "libibverbs" in str(e) else ""
        raise ImportError(f"Mooncake's transfer engine is unavailable: {e}{hint}") from e
    return MooncakeEngine


class MooncakeTransferEngine(TransferEngine):
    name = "mooncake"

    def __init__(self, host: str):
        self._engine = load_engine_class()()
        self._lock = threading.Lock()
        with _stderr_without(_START_NOISE):
            ret = self._engine.initialize(host, "P2PHANDSHAKE", "tcp", "")
        if ret != 0:
            raise RuntimeError(f"Mooncake transfer engine failed to initialize on {host} (code {ret})")
        self._session = f"{host}:{self._engine.get_rpc_port()}"

    def session_id(self) -> str:
        return self._session

    def register(self, addr: int, nbytes: int) -> None:
        ret = self._engine.register_memory(addr, nbytes)
        if ret != 0:
            raise RuntimeError(f"Mooncake could not register {nbytes} bytes at {addr:#x} (code {ret})")

    def write(self, peer: str, src_addr: int, dst_addr: int, nbytes: int) -> None:
        with self._lock:
            ret = self._engine.transfer_sync_write(peer, src_addr, dst_addr, nbytes)
        if ret != 0:
            raise TransferError(f"Mooncake write of {nbytes} bytes to {peer} failed (code {ret})")
