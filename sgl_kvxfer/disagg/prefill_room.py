"""A prefill room's state: one request's KV hand-off to the decode that claims it (prefill.py).

Invariants:
- `pending` holds ranges in position order; [0, streamed) is queued (pending or sent), and the
  ranges still pending are a suffix of it (packed in order).
- `inflight` maps each seq whose write has not reported to its send-buffer offset: the room
  finishes only once it is empty (the writes still read that buffer).
- TIER_KEEP is a wire tier only: it marks, in a replacing segment, a position the decode keeps.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch

from sgl_kvxfer.disagg.base import KVPoll
from sgl_kvxfer.disagg.staging import RingWriter
from sgl_kvxfer.disagg.trace import PhaseTrace
from sgl_kvxfer.message.disagg import KVClaim


TIER_KEEP = 255  # in a replacing segment: the decode keeps what it holds for this position
CHUNK_STREAMS = ("chunk", "chunk-upgrade")
STREAMS = ("end", "int8", *CHUNK_STREAMS)


@dataclass
class _Range:
    start: int
    end: int
    kind: str  # "stored": the pool's tiers; "int8" / "chunk": quantized on the way; "replace" / "upgrade"
    tiers: torch.Tensor | None = None  # "chunk": the wire tier per position, chosen when the chunk ended
    # "chunk": the host slot ids of [start, end) as the chunk's launch left the row (None: read
    # the table). Valid until the prompt's re-tier moves them; a chunk range still pending
    # then is dropped (_finalize_chunks), and a packed one was enqueued before the re-tier.
    slots: torch.Tensor | None = None
    # "chunk" on CUDA: the event behind the chunk's kernels (PackStream.mark at its launch); the
    # range is packed on the role's side stream after it (None: packed on the current stream)
    after: object = None

    def split(self) -> tuple["_Range", "_Range"]:
        cut = (self.end - self.start) // 2
        mid = self.start + cut
        head = lambda t: None if t is None else t[:cut]  # noqa: E731
        tail = lambda t: None if t is None else t[cut:]  # noqa: E731
        return (_Range(self.start, mid, self.kind, head(self.tiers), head(self.slots), self.after),
                _Range(mid, self.end, self.kind, tail(self.tiers), tail(self.slots), self.after))


@dataclass
class PrefillRoom:
    room: int
    req: object = None
    claim: KVClaim | None = None
    decode: str | None = None  # the reply endpoint of the decode that registered or claimed it
    ring: RingWriter | None = None
    state: KVPoll = KVPoll.BOOTSTRAPPING
    pending: deque = field(default_factory=deque)
    streamed: int = 0  # positions [0, streamed) are queued as segments
    next_seq: int = 0
    inflight: dict = field(default_factory=dict)  # seq -> send-buffer offset, until its write reports
    prompt_done: bool = False
    done_queued: bool = False
    error: str | None = None
    created: float = field(default_factory=time.monotonic)
    progress: float = field(default_factory=time.monotonic)
    wire_bytes: int = 0
    wire_seconds: float = 0.0  # summed write times: bytes / wire_seconds is the achieved link rate
    prompt_done_at: float = 0.0
    first_write: float | None = None
    finished: bool = False
    sent_tiers: torch.Tensor | None = None  # "chunk-upgrade": int16 [n], the wire tier each
    # position went out at (-1: not yet)
    trace: PhaseTrace | None = None  # --enable-pd-trace
    stream: str = "end"  # --kv-transfer-stream when its request arrived
    last_chunk: int = 0  # --kv-transfer-last-chunk when its request arrived
    launched: dict = field(default_factory=dict)  # chunk end -> time.time() that chunk was launched
    chunk_ends: list = field(default_factory=list)  # tiered "end": its chunks' ends (the first cuts the range)
    forward_end: float = 0.0  # time.time() its last chunk's forward ended
    chunk_done: dict = field(default_factory=dict)  # chunk end -> CUDA event behind its kernels (trace)
    chunk_marks: dict = field(default_factory=dict)  # chunk streams and untiered pools on CUDA: chunk
    # end -> the event behind its kernels, until its range is queued (its pack waits for it alone)
    chunk_rows: dict = field(default_factory=dict)  # untiered pools on CUDA: chunk end -> RowSnapshot
    # of the row [0, end) as that chunk's launch left it (the range's host slot ids)
