"""A PD role's registered transfer buffer, and the block checksums of what it carries.

Each role registers one buffer with its transfer engine (prefill: packed segments; decode:
staging regions). It is GPU memory when the server runs on CUDA and the installed Mooncake build
registers GPU memory (the CUDA build): KV then goes pool -> send buffer -> the peer's staging ->
its pool without touching host memory. Otherwise it is host memory (pinned on a CUDA host).
SGL_KVXFER_KV_BUFFER=host|device overrides the choice; `device` with an engine that cannot
register GPU memory (Mooncake's host-memory build) is an error naming the CUDA build's install.

Checksums, one per BLOCK_BYTES block of a segment (the last block may be short):

    xxh3     xxh3-64 of the block's bytes (`xxhash`). Host buffers: the sender thread computes it
             while the scheduler runs the next chunk.
    wsum64   sum_i w_i * m_i mod 2^64 over the block's little-endian 8-byte words w_i (a short
             last word zero-padded), m_i = (i * 0x9E3779B97F4A7C15 mod 2^64) | 1. GPU buffers:
             one pass on the device, no copy to the host. Every m_i is odd, hence invertible mod
             2^64, so any change to one word changes the sum; swapped words and a stale
             (unwritten) tail change it unless the stale bytes happen to be the same. It is not
             a cryptographic hash: it guards against faulty transfers, not against an adversary.

Both are computed with integer arithmetic that wraps mod 2^64 (torch int64 on either device),
so the sum does not depend on the reduction order and a CPU computes what a GPU does.
"""
from __future__ import annotations

import logging

import numpy as np
import torch
import xxhash

from sgl_kvxfer import env
from sgl_kvxfer.disagg.mooncake import CUDA_BUILD_INSTALL, gpu_build_missing

logger = logging.getLogger(__name__)

BLOCK_BYTES = 4 << 20
_WORDS = BLOCK_BYTES // 8
_GROUP_BLOCKS = 16  # wsum64 multiplies this many blocks at a time (bounds the int64 temporary)
_MULT: dict = {}  # device -> int64 [_WORDS] multipliers


def _multipliers(device) -> torch.Tensor:
    key = str(device)
    if key not in _MULT:
        m = np.arange(_WORDS, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15) | np.uint64(1)
        _MULT[key] = torch.from_numpy(m.view(np.int64)).to(device)
    return _MULT[key]


def wsum64(payload: torch.Tensor, block_bytes: int = BLOCK_BYTES) -> list[int]:
    """wsum64 of each block of `payload` (uint8, any device, starting 8-byte aligned); values
    as unsigned 64-bit ints."""
    assert payload.dtype == torch.uint8 and payload.dim() == 1 and block_bytes == BLOCK_BYTES
    if payload.numel() == 0:
        return []
    return wsum64_values(_wsum64_tensor(payload))


def wsum64_async(payload: torch.Tensor) -> tuple[torch.Tensor, object | None]:
    """wsum64 launched without waiting: (the sums as an int64 tensor on the host, a CUDA event
    recorded after their copy, or None off CUDA). The host tensor is valid once the event has
    completed: the sender thread waits for it, so the scheduler thread never blocks on a pack.
    wsum64_values turns it into wsum64's list."""
    assert payload.dtype == torch.uint8 and payload.dim() == 1
    if payload.numel() == 0:
        return torch.empty(0, dtype=torch.int64), None
    sums = _wsum64_tensor(payload)
    if not sums.is_cuda:
        return sums, None
    host = torch.empty(sums.shape, dtype=sums.dtype, pin_memory=True)
    host.copy_(sums, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    return host, done


def wsum64_values(sums: torch.Tensor) -> list[int]:
    return [v & 0xFFFFFFFFFFFFFFFF for v in sums.tolist()]


def _wsum64_tensor(payload: torch.Tensor) -> torch.Tensor:
    n = payload.numel()
    nwords = n // 8
    m = _multipliers(payload.device)
    words = payload[:nwords * 8].view(torch.int64)
    sums = []
    full = nwords // _WORDS
    for g in range(0, full, _GROUP_BLOCKS):
        k = min(_GROUP_BLOCKS, full - g)
        blocks = words[g * _WORDS:(g + k) * _WORDS].view(k, _WORDS)
        sums.append((blocks * m).sum(dim=1))
    rest, tail = words[full * _WORDS:], n - nwords * 8
    if rest.numel() or tail:
        last = (rest * m[:rest.numel()]).sum().reshape(1)
        if tail:  # the short last word, zero-padded
            pad = torch.zeros(8, dtype=torch.uint8, device=payload.device)
            pad[:tail] = payload[nwords * 8:]
            last = last + pad.view(torch.int64) * m[rest.numel()]
        sums.append(last)
    return torch.cat(sums)


def xxh3_blocks(payload: torch.Tensor, block_bytes: int = BLOCK_BYTES) -> list[int]:
    """xxh3-64 of each block (a device payload is copied to the host first)."""
    view = memoryview(payload.cpu().numpy()) if payload.numel() else memoryview(b"")
    return [xxhash.xxh3_64_intdigest(view[i:i + block_bytes]) for i in range(0, len(view), block_bytes)]


CHECKSUMS = {"xxh3": xxh3_blocks, "wsum64": wsum64}


def block_checksums(payload: torch.Tensor, kind: str, block_bytes: int = BLOCK_BYTES) -> list[int]:
    if kind not in CHECKSUMS:
        raise ValueError(f"unknown checksum kind {kind!r}")
    return CHECKSUMS[kind](payload, block_bytes)


def first_bad_block(payload: torch.Tensor, checksums: list[int], kind: str, block_bytes: int) -> int | None:
    """Index of the first block whose checksum differs (a corrupt or short write), or None."""
    return _first_mismatch(block_checksums(payload, kind, block_bytes), checksums)


def _first_mismatch(got: list[int], want: list[int]) -> int | None:
    if len(got) != len(want):
        return min(len(got), len(want))
    return next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)


class PendingChecksums:
    """A payload's block checksums launched without a host wait (the decode's GPU staging).

    wsum64 of a GPU payload: summed on the device, the sums copied to pinned host memory.
    xxh3 of a GPU payload: the bytes copied to pinned host memory, hashed once there. An event
    recorded after the copy says when `first_bad` may run. A host payload is summed at once
    (event None). NOTE: the payload's bytes must stay put until `ready()`: the sums and the
    copy read them on the current stream, after whatever was queued there before the launch."""

    def __init__(self, payload: torch.Tensor, kind: str, block_bytes: int):
        if kind not in CHECKSUMS:
            raise ValueError(f"unknown checksum kind {kind!r}")
        self.kind, self.block_bytes = kind, block_bytes
        self.event = None
        self.host: torch.Tensor | None = None
        self.values: list[int] | None = None
        if not payload.is_cuda or payload.numel() == 0:
            self.values = block_checksums(payload, kind, block_bytes)
        elif kind == "wsum64":
            assert block_bytes == BLOCK_BYTES
            self.host, self.event = wsum64_async(payload)
        else:
            self.host = torch.empty(payload.shape, dtype=payload.dtype, pin_memory=True)
            self.host.copy_(payload, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()

    def ready(self) -> bool:
        return self.event is None or self.event.query()

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()

    def first_bad(self, checksums: list[int]) -> int | None:
        """first_bad_block's answer for the launched payload; only once ready()."""
        if self.values is None:
            host, self.host = self.host, None
            self.values = wsum64_values(host) if self.kind == "wsum64" else \
                block_checksums(host, self.kind, self.block_bytes)
        return _first_mismatch(self.values, checksums)


class TransferBuffer:
    """`nbytes` of registered transfer memory on the server's device or in host memory."""

    def __init__(self, nbytes: int, device: str, gpu_capable_engine: bool):
        choice = env.KV_BUFFER.get() or "auto"
        if choice not in ("auto", "host", "device"):
            raise ValueError(f"{env.KV_BUFFER.name} must be auto, host or device, got {choice!r}")
        on_gpu = str(device).startswith("cuda")
        if on_gpu and choice == "device" and not gpu_capable_engine:  # registering it would fail obscurely
            raise ValueError(gpu_build_missing(f"{env.KV_BUFFER.name}=device asks for a GPU transfer buffer"))
        if on_gpu and choice == "auto" and not gpu_capable_engine:
            logger.warning("PD on a GPU with a host-memory transfer engine: KV is staged through pinned host "
                           "memory (Mooncake's CUDA build moves it GPU to GPU: %s)", CUDA_BUILD_INSTALL)
        self.on_device = on_gpu and (choice == "device" or (choice == "auto" and gpu_capable_engine))
        if self.on_device:
            self.tensor = torch.empty(nbytes, dtype=torch.uint8, device=device)
        else:
            self.tensor = torch.empty(nbytes, dtype=torch.uint8, pin_memory=on_gpu)
        # device buffers are summed where they are; host buffers by the sender thread
        self.checksum_kind = "wsum64" if self.on_device else "xxh3"

    @property
    def location(self) -> str:
        return f"GPU ({self.tensor.device})" if self.on_device else "host"

    def data_ptr(self) -> int:
        return self.tensor.data_ptr()

    def numel(self) -> int:
        return self.tensor.numel()

    def __getitem__(self, key) -> torch.Tensor:
        return self.tensor[key]
