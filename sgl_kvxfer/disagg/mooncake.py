"""Mooncake's Transfer Engine, SGLang's default PD backend, from either of its PyPI builds:

    mooncake-transfer-engine-non-cuda   host memory only (the CPU install and CI)
    mooncake-transfer-engine-cuda13     host or GPU memory; its CUDA 12 twin is the plain
                                        `mooncake-transfer-engine`

Both install the same `mooncake.engine` module. As in SGLang, each process starts one engine
in peer-to-peer handshake mode (no metadata server), reached at "host:rpc_port", with protocol
"rdma" and the `--disaggregation-ib-device` filter; Mooncake then picks the transport itself from
the HCAs it finds and the environment it reads when its library loads:

    MC_INTRANODE_NVLINK   set: GPU memory written over NVLink / PCIe peer copies (both
                          servers on one host, CUDA build). Mooncake tests only that it is
                          present; here "0", "false", "no", "off" and "" remove it first.
    MC_FORCE_TCP          TCP even where an HCA exists (`--disaggregation-transfer-backend
                          mooncake_tcp` sets it, as SGLang's does)
    otherwise             RDMA where an HCA is found, else TCP in the non-CUDA build; the CUDA
                          build then uses its own default path (on two H100s of one host it
                          moved 1.6 GB/s, against 385 GB/s with MC_INTRANODE_NVLINK)

A write copies bytes from this process's registered memory into a peer's registered memory
(`transfer_sync_write`); a peer that is gone returns an error code, which becomes TransferError.
"""
from __future__ import annotations

import contextlib
import importlib.metadata
import json
import logging
import os
import sys
import tempfile
import threading

from sgl_kvxfer.disagg.base import TransferEngine, TransferError

logger = logging.getLogger(__name__)

NON_CUDA_DIST = "mooncake-transfer-engine-non-cuda"
# the one install line for the CUDA build (setup.py's "pd-cuda13" extra; both builds install the
# `mooncake` package, so the host-memory one goes first)
CUDA_BUILD_INSTALL = f"pip uninstall -y {NON_CUDA_DIST} && pip install -e '.[pd-cuda13]'"
FALSE_VALUES = ("", "0", "false", "no", "off")


def installed_build() -> str | None:
    """The Mooncake distribution that provides `mooncake` (None: none found by name, e.g. a
    source build)."""
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if name.startswith("mooncake-transfer-engine"):
            return name
    return None


def build_has_cuda(build: str | None = None) -> bool:
    """Whether the installed build can register GPU memory (every build but the non-CUDA one)."""
    build = installed_build() if build is None else build
    return build is not None and build != NON_CUDA_DIST


def _prepare_environment() -> None:
    """Mooncake reads MC_* once, when its library loads: settle them before the import."""
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # glog; its start-up noise: _START_NOISE
    if os.environ.get("MC_INTRANODE_NVLINK", "x").strip().lower() in FALSE_VALUES:
        del os.environ["MC_INTRANODE_NVLINK"]  # NOTE: Mooncake enables it on presence, "false" included


# What Mooncake's glog writes on every engine start, none of it the user's concern: glog's notice
# that it logs before InitGoogleLogging, and an ERROR line from the P2P handshake's metadata
# lookup of this engine's own segment before it is published. Dropped from stderr during
# `initialize` only; everything else it writes there passes through.
# The CUDA build adds two lines of its own at start (seen with 0.3.14 on an H200 host): the
# allocator it picked for RDMA buffers and that metrics reporting is off.
_START_NOISE = ("Logging before InitGoogleLogging() is written to STDERR", "Local segment descriptor not found",
                "-aligned malloc/free for protocol", "Metrics reporting is disabled")


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
    _prepare_environment()
    try:
        from mooncake.engine import TransferEngine as MooncakeEngine
    except ImportError as e:
        if "libibverbs" in str(e) or "libmlx5" in str(e):
            hint = (" (the engine links libibverbs.so.1 even for TCP: install rdma-core's libibverbs1, e.g. "
                    "`apt-get install libibverbs1`; the CUDA build also links libmlx5.so.1: ibverbs-providers)")
        elif "mooncake" in str(e):
            hint = (" (pip install -e '.[pd]' for host memory, or '.[pd-cuda13]' for Mooncake's CUDA build, "
                    "which also moves GPU memory)")
        elif "libcuda" in str(e) or "libcudart" in str(e):
            hint = (" (Mooncake's CUDA build needs the CUDA driver and runtime; on a host without a GPU "
                    f"use its host-memory build: pip uninstall -y mooncake-transfer-engine-cuda13 && "
                    "pip install -e '.[pd]')")
        else:
            hint = ""
        raise ImportError(f"Mooncake's transfer engine is unavailable: {e}{hint}") from e
    return MooncakeEngine


def gpu_build_missing(what: str, build: str | None = None) -> str:
    """The error for a GPU-memory transfer asked of a Mooncake build that cannot register GPU
    memory: what asked for it, the build found, and the install line of the CUDA build."""
    build = installed_build() if build is None else build
    return (f"{what}, but the installed Mooncake build ({build or 'none found by name'}) moves host memory "
            f"only. Install its CUDA build: {CUDA_BUILD_INSTALL} (plus the ibverbs-providers system package), "
            "or leave it unset to move KV through host memory")


def ib_devices_for_gpu(spec: str | None, gpu_id: int) -> str:
    """The HCA filter for this GPU from --disaggregation-ib-device, in SGLang's forms: "" (all),
    "mlx5_0,mlx5_1" (every GPU), or a JSON object {"<gpu id>": "mlx5_0", ...} inline or in a
    .json file. ValueError names what is wrong."""
    spec = (spec or "").strip()
    if not spec:
        return ""
    if spec.endswith(".json"):
        if not os.path.isfile(spec):
            raise ValueError(f"--disaggregation-ib-device {spec}: no such file")
        with open(spec) as f:
            spec = f.read().strip()
    if not spec.startswith("{"):
        return spec
    try:
        mapping = json.loads(spec)
    except ValueError as e:
        raise ValueError(f"--disaggregation-ib-device: not valid JSON ({e})") from e
    if not isinstance(mapping, dict) or not mapping or not all(
            str(k).isdigit() and isinstance(v, str) for k, v in mapping.items()):
        raise ValueError('--disaggregation-ib-device: expected {"<gpu id>": "<devices>", ...}')
    devices = {int(k): v.strip() for k, v in mapping.items()}
    if gpu_id not in devices:
        raise ValueError(f"--disaggregation-ib-device names no devices for GPU {gpu_id} (it has {sorted(devices)})")
    return devices[gpu_id]


def expected_transport(build: str | None = None) -> str:
    """What Mooncake should pick here, from the environment and the HCAs sysfs lists (for
    /server_info; Mooncake itself decides)."""
    if "MC_INTRANODE_NVLINK" in os.environ and build_has_cuda(build):
        return "nvlink_intra"
    hcas = os.path.isdir("/sys/class/infiniband") and bool(os.listdir("/sys/class/infiniband"))
    if hcas and "MC_FORCE_TCP" not in os.environ:
        return "rdma"
    return "tcp" if not build_has_cuda(build) or "MC_FORCE_TCP" in os.environ else "cuda-build default"


class MooncakeTransferEngine(TransferEngine):
    name = "mooncake"

    def __init__(self, host: str, ib_device: str | None = None, gpu_id: int = 0):
        self.devices = ib_devices_for_gpu(ib_device, gpu_id)
        engine_class = load_engine_class()  # settles MC_* first
        self.build = installed_build()
        self.gpu_memory = build_has_cuda(self.build)
        if "MC_INTRANODE_NVLINK" in os.environ and not self.gpu_memory:  # present (not "false"): on
            raise RuntimeError(gpu_build_missing("MC_INTRANODE_NVLINK is set (Mooncake's NVLink transport)",
                                                 self.build))
        self._engine = engine_class()
        self._lock = threading.Lock()
        self.transport = expected_transport(self.build)
        with _stderr_without(_START_NOISE):
            ret = self._engine.initialize(host, "P2PHANDSHAKE", "rdma", self.devices)
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

    def describe(self) -> dict:
        return {"engine": self.name, "build": self.build, "expected_transport": self.transport,
                "ib_devices": self.devices or "all"}
