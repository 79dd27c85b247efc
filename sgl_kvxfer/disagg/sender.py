"""The prefill's sender thread: checksum a packed segment, write it, tell the decode.

The scheduler thread packs segments into the registered send buffer and queues jobs; this
thread runs them in order (so a room's KVDone follows its last segment) and reports each write's
outcome back, waking the scheduler's loop through its WakeChannel. It owns its own ZMQ push
sockets (a socket belongs to one thread). Host buffers are checksummed here (xxh3, off the
scheduler thread); GPU buffers arrive with their checksums (computed on the device).

    scheduler thread --WriteJob / NoticeJob--> [queue] --> sender thread --write--> decode memory
                    <----------- SendResult ----------                  --KVSegment / KVDone / KVFailed--> decode

Coalescing (`coalesce`, while the link is not paced: disagg/shaped.py): WriteJobs queued behind the one taken, of the same
room and decode, whose bytes follow each other exactly both in the send buffer and in the
decode's ring, go out as one engine write (an engine write has a fixed cost per call). Each
segment's KVSegment follows that write; each job still reports its own SendResult.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass

import msgspec
import torch

from sgl_kvxfer.disagg.base import TransferEngine, TransferError
from sgl_kvxfer.disagg.buffers import BLOCK_BYTES, block_checksums, wsum64_values
from sgl_kvxfer.disagg.common import Fault
from sgl_kvxfer.message.disagg import KVDone, KVSegment
from sgl_kvxfer.message.queue import PushQueue

logger = logging.getLogger(__name__)
_NOTHING = object()  # SenderThread._run: no job held over from coalescing


@dataclass
class WriteJob:
    room: int
    seq: int
    payload: torch.Tensor  # uint8 view of the send buffer (registered memory)
    peer: str  # the decode's transfer session
    dst_addr: int
    reply_to: str
    segment: KVSegment  # checksums filled in here unless `checksums` is given
    checksums: list[int] | None = None  # computed already (GPU buffers: wsum64 on the device)
    checksum_kind: str = "xxh3"
    # CUDA: the pack (and wsum64_async's copy of `sums`) was launched, not waited for; this
    # thread waits for the event before it reads the payload or the sums
    ready: object | None = None
    sums: torch.Tensor | None = None  # wsum64_async's host tensor: the checksums once `ready`


@dataclass
class NoticeJob:
    room: int
    reply_to: str
    msg: msgspec.Struct  # KVDone / KVFailed


@dataclass
class SendResult:
    room: int
    seq: int  # -1: a notice
    error: str | None
    nbytes: int = 0
    write_seconds: float = 0.0  # the engine write alone (the link's busy time), not checksumming
    write_start: float = 0.0  # time.time() of the write's start and end (the phase trace)
    write_end: float = 0.0
    ready_wait: tuple[float, float] | None = None  # time.time() span this thread waited for the
    # pack's kernels (WriteJob.ready), the phase trace's pack_wait[s]


class SenderThread:
    def __init__(self, engine: TransferEngine, faults: list[Fault] | None = None, wake=None, device=None,
                 coalesce: bool = False):
        self.engine = engine
        self.coalesce = coalesce
        self.faults = faults or []
        self.wake = wake  # WakeChannel: notified after each result (its push end is this thread's)
        self.device = device  # CUDA device of GPU buffers (a thread's current device is its own)
        self.jobs: queue.Queue = queue.Queue()
        self.results: queue.SimpleQueue = queue.SimpleQueue()
        self.cancelled: set[int] = set()  # rooms whose writes must not start any more (the
        # scheduler thread adds, this thread reads: a set add / membership test is atomic)
        self._peers: dict[str, PushQueue] = {}
        self._thread = threading.Thread(target=self._run, name="kv-sender", daemon=True)
        self._thread.start()

    def submit(self, job) -> None:
        self.jobs.put(job)

    def drain(self) -> list[SendResult]:
        out = []
        while True:
            try:
                out.append(self.results.get_nowait())
            except queue.Empty:
                return out

    def _push(self, endpoint: str, msg) -> None:
        sock = self._peers.get(endpoint)
        if sock is None:
            sock = self._peers[endpoint] = PushQueue(endpoint)
        sock.put(msg)

    def _report(self, result: SendResult) -> None:
        self.results.put(result)
        if self.wake is not None:
            self.wake.notify()

    def _run(self) -> None:
        if self.device is not None:
            torch.cuda.set_device(self.device)
        held = _NOTHING  # a job taken while coalescing that did not join it runs next (None: stop)
        while True:
            job, held = (held, _NOTHING) if held is not _NOTHING else (self.jobs.get(), _NOTHING)
            if job is None:
                return
            if isinstance(job, NoticeJob) and isinstance(job.msg, (KVDone,)) and job.room in self.cancelled:
                self._report(SendResult(job.room, -1, "room cancelled"))
                continue
            group = [job]
            try:
                if isinstance(job, WriteJob):
                    if self.coalesce and not getattr(self.engine, "paced", False):
                        held = self._gather(group)  # NOTE: held before a possible raise below
                    for result in (self._write(job),) if len(group) == 1 else self._write_group(group):
                        self._report(result)
                else:
                    self._push(job.reply_to, job.msg)
                    self._report(SendResult(job.room, -1, None))
            except Exception as e:  # never let one room's failure stop the thread
                logger.warning("KV transfer of room %s failed: %s: %s", job.room, type(e).__name__, e)
                for failed in group:  # every job of a coalesced write reports
                    self._report(SendResult(failed.room, getattr(failed, "seq", -1), f"{type(e).__name__}: {e}"))

    def _gather(self, group: list[WriteJob]):
        """Append to `group` the queued WriteJobs that continue it exactly; the first job that
        does not (or _NOTHING: the queue is empty) is returned to run next."""
        while True:
            try:
                nxt = self.jobs.get_nowait()
            except queue.Empty:
                return _NOTHING
            last = group[-1]
            nbytes = last.payload.numel()
            if not (isinstance(nxt, WriteJob) and nxt.room == last.room and nxt.peer == last.peer
                    and nxt.reply_to == last.reply_to and nxt.payload.device == last.payload.device
                    and last.payload.data_ptr() + nbytes == nxt.payload.data_ptr()
                    and last.dst_addr + nbytes == nxt.dst_addr
                    and not Fault.for_room(self.faults, last.room).kind):
                return nxt
            group.append(nxt)

    def _write_group(self, group: list[WriteJob]) -> list[SendResult]:
        """One engine write for jobs whose bytes are contiguous on both sides (`_gather`)."""
        waits = [self._prepare(job) for job in group]
        room, total = group[0].room, sum(job.payload.numel() for job in group)
        if room in self.cancelled:
            return [SendResult(room, job.seq, "room cancelled before its write", ready_wait=w)
                    for job, w in zip(group, waits)]
        wall_start, write_start = time.time(), time.perf_counter()
        try:
            self.engine.write(group[0].peer, group[0].payload.data_ptr(), group[0].dst_addr, total)
        except TransferError as e:
            return [SendResult(room, job.seq, str(e), ready_wait=w) for job, w in zip(group, waits)]
        seconds = time.perf_counter() - write_start
        out = []
        for job, waited in zip(group, waits):
            self._push(job.reply_to, job.segment)
            share = seconds * job.payload.numel() / total if total else 0.0  # the link's time, by bytes
            out.append(SendResult(room, job.seq, None, job.payload.numel(), share, wall_start, wall_start + seconds,
                                  waited))
        return out

    def _prepare(self, job: WriteJob) -> tuple[float, float] | None:
        """Wait for the job's pack, fill in its segment's checksums; the wait's span (or None)."""
        waited = None
        if job.ready is not None:
            t = time.time()
            job.ready.synchronize()
            waited = (t, time.time())
        if job.checksums is None and job.sums is not None:
            job.checksums = wsum64_values(job.sums)
        if job.checksums is None:
            job.checksums, job.checksum_kind = block_checksums(job.payload, "xxh3", BLOCK_BYTES), "xxh3"
        job.segment.checksums, job.segment.checksum_kind = job.checksums, job.checksum_kind
        job.segment.block_bytes = BLOCK_BYTES
        return waited

    def _write(self, job: WriteJob) -> SendResult:
        payload = job.payload
        nbytes = payload.numel()
        waited = self._prepare(job)
        sent = nbytes
        fault = Fault.for_room(self.faults, job.room)
        if fault.kind == "delay":
            time.sleep(fault.arg)
        if job.room in self.cancelled:  # the decode gave the region up: never write into it
            return SendResult(job.room, job.seq, "room cancelled before its write", ready_wait=waited)
        elif fault.kind == "corrupt" and nbytes:
            payload[nbytes // 2] ^= 0xFF  # after checksumming: the wire carries a flipped byte
            if payload.is_cuda:
                torch.cuda.current_stream().synchronize()
        elif fault.kind == "truncate":
            sent = nbytes // 2
        wall_start, write_start = time.time(), time.perf_counter()
        try:
            if sent:
                self.engine.write(job.peer, payload.data_ptr(), job.dst_addr, sent)
        except TransferError as e:
            return SendResult(job.room, job.seq, str(e), ready_wait=waited)
        write_seconds = time.perf_counter() - write_start
        self._push(job.reply_to, job.segment)
        return SendResult(job.room, job.seq, None, sent, write_seconds, wall_start, wall_start + write_seconds, waited)

    def close(self) -> None:
        self.jobs.put(None)
        self._thread.join(timeout=5)
        for sock in self._peers.values():
            sock.close()
        if self.wake is not None:
            self.wake.close()
