"""A decode room's state: one request's prompt KV arriving from its prefill (decode.py).

Invariants:
- Segments are unpacked in seq order: `unpacked` is the next seq to unpack, `segments` holds
  those arrived and not unpacked yet.
- A seq is acked (in `acks` order) only once it is out of `unverified` (its sums matched) and
  its unpack kernels are done.
"""
from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field

from sgl_kvxfer.disagg.base import KVPoll
from sgl_kvxfer.disagg.trace import PhaseTrace
from sgl_kvxfer.message.disagg import KVDone


@dataclass
class DecodeRoom:
    room: int
    req: object
    state: KVPoll = KVPoll.BOOTSTRAPPING
    route: Future | None = None
    endpoint: str = ""  # the prefill's KV manager (tcp://)
    region: int | None = None  # offset in the staging buffer
    region_bytes: int = 0
    segments: dict = field(default_factory=dict)  # seq -> KVSegment not yet unpacked
    unpacked: int = 0
    done: KVDone | None = None
    created: float = field(default_factory=time.monotonic)
    progress: float = field(default_factory=time.monotonic)
    claimed_at: float = 0.0
    wire_bytes: int = 0
    trace: PhaseTrace | None = None  # --enable-pd-trace
    acks: deque = field(default_factory=deque)  # (seq, CUDA event or None): unpacked, not acked
    # seq -> (PendingChecksums, the prefill's checksums): launched, not yet compared
    unverified: dict = field(default_factory=dict)
