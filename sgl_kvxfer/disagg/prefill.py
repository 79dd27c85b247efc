"""The scheduler's prefill role: prefill, then hand the prompt's KV to the decode that claims it.

The Scheduler runs as usual; this role implements PDRole's hooks (disagg/role.py):

    on_new_request(req)      a room opens for req's bootstrap_room (or meets an early claim)
    on_chunk(req, a, b)      a prefill chunk finished: positions [a, b) may stream now
    on_prompt_done(req)      the prompt is prefilled and its first token sampled: the request
                             leaves the batch and waits here until its KV is out
    poll()                   each scheduler iteration: claims / acks / cancels from decodes,
                             the sender thread's results, packing, deadlines, finished rooms

What travels, by `--kv-tier-budget` b and `--kv-transfer-stream`:

    b = 1.0            every chunk streams at the model dtype as it finishes (the rest with the
                       last chunk): the transfer overlaps the next chunk's compute
    b < 1, "end"       nothing until the prompt is done; then the tiers SpectrumKV assigned
                       (the pool holds them already) go out as stored codes in two segments,
                       the first chunk and the rest (the first write waits for one chunk's
                       pack, not the prompt's; the rest is packed while it is on the wire)
    b < 1, "int8"      chunks stream at int8; at the end a replacing segment sends the tokens
                       whose final tier is not int8 (fp16 upgrades, int4 codes, drops), so the
                       decode ends with exactly the codes of the "end" variant
    b < 1, "chunk"     each chunk streams at tiers chosen for it at budget b when it finishes,
                       ranked by the attention of its own last W queries (EngineTiering
                       .chunk_tiers); the pool keeps the chunk at the model dtype, so it is
                       quantized on the way out. The last chunk, and chunks not yet packed when
                       the prompt ends, go at the final tiers (ranked by the whole prompt),
                       packed before the re-tier moves the KV (_on_final_tiers). On a GPU
                       a chunk's pack runs on a side stream after that chunk's kernels, beside
                       the next chunk's forward (pack_stream.py)
    b < 1, "chunk-upgrade"  "chunk", then one replacing segment with the tokens whose final
                       tier is more precise than the one they streamed at (TIER_KEEP for the
                       rest): the decode holds max(streamed, final) precision per token

A request finishes (its HTTP reply ends) once KVDone is out, or when its room fails (a write
error, a stalled ring, a cancel, no claim in `--kv-transfer-timeout`): the decode then prefills
locally. Either way the request's KV goes to the radix cache as usual; nothing leaks.

Which decode holds a room is known from its KVRegister (sent when the decode gets the request,
before it has staging to claim with). From then on the room fails as soon as that decode is
seen dead (peers.py); a room no decode registered for within `--kv-claim-timeout` of the
request's arrival fails then: its decode died before registering, or was dead when the router
dispatched. Both name the decode side. A decode that registers or claims a room that already
failed here gets KVFailed at once (it prefills locally), so a claim deadline that is too short
for a slow decode costs time, never an answer.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from contextlib import nullcontext
from dataclasses import dataclass, field

import msgspec
import torch

from sgl_kvxfer import env
from sgl_kvxfer.disagg import create_transfer_engine
from sgl_kvxfer.disagg.base import KVPoll
from sgl_kvxfer.disagg.buffers import TransferBuffer, wsum64_async
from sgl_kvxfer.disagg.common import FAKE_BOOTSTRAP_HOST, Fault, TransferStats, register_prefill_rank
from sgl_kvxfer.disagg.pack_stream import PackStream
from sgl_kvxfer.disagg.peers import PeerMonitor, endpoint_peer
from sgl_kvxfer.disagg.role import PDRole
from sgl_kvxfer.disagg.sender import NoticeJob, SenderThread, WriteJob
from sgl_kvxfer.disagg.shaped import ShapedTransferEngine
from sgl_kvxfer.disagg.staging import RingWriter, StagingAllocator
from sgl_kvxfer.disagg.trace import GCPauses, PhaseTrace
from sgl_kvxfer.forward_batch import ForwardMode
from sgl_kvxfer.mem_cache.kv_payload import pack_segment, segment_layout, tier_counts, wire_tier_of
from sgl_kvxfer.message.disagg import (KVAck, KVCancel, KVClaim, KVDone, KVFailed, KVLayoutInfo, KVRegister,
                                      KVSegment)
from sgl_kvxfer.message.queue import PullQueue, WakeChannel
from sgl_kvxfer.spectrum.tiers import TIER_DROP, TIER_INT8

logger = logging.getLogger(__name__)
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
    chunk_marks: dict = field(default_factory=dict)  # tiered chunk streams on CUDA: chunk end ->
    # the event behind its kernels, until on_chunk queues its range (its pack waits for it alone)


class PrefillRole(PDRole):
    mode = "prefill"
    intercepts_prefill = True
    peer_kind = "decode"
    packs: PackStream | None = None  # the side stream of chunk-stream packs (CUDA only)

    def __init__(self, settings, host: str):
        self.settings = settings
        self.host = host
        self.stats = TransferStats()
        self.rooms: dict[int, PrefillRoom] = {}
        self.ended: dict[int, tuple[str, float]] = {}  # failed room -> (reason, forget at): a late
        # register or claim for it is answered with KVFailed (insertion order is expiry order)
        self.fake = settings.backend == "fake"
        self.stream = settings.stream
        self.trace_on = settings.trace  # rooms opened from now on get a phase trace (/kv_transfer_link switches it)
        self.gc_pauses = GCPauses() if settings.trace else None  # the collector's pauses, for traced rooms
        self.last_chunk = settings.last_chunk  # --kv-transfer-last-chunk for rooms opened from now on (likewise)

    def start(self, ctx) -> None:
        super().start(ctx)
        settings, host = self.settings, self.host
        self.pool, self.table, self.tiering = ctx.pool, ctx.table, ctx.tiering
        self.tiered = ctx.tiering is not None
        if self.tiered:
            ctx.tiering.final_tiers_hook = self._on_final_tiers
        self.device = ctx.runner.device
        if self.fake:
            return
        self.packs = PackStream.create(self.device) if self.tiered else None
        self.engine = create_transfer_engine(settings.backend, host, settings.rate_gbps, settings.latency_ms,
                                             settings.ib_device, settings.gpu_id)
        self.buffer = TransferBuffer(settings.buffer_bytes, self.device, self.engine.gpu_memory)
        self.engine.register(self.buffer.data_ptr(), self.buffer.numel())
        self.send_alloc = StagingAllocator(self.buffer.numel())
        self.wake = WakeChannel()
        self.sender = SenderThread(self.engine, Fault.parse(env.KV_TRANSFER_FAULT.get()), self.wake,
                                   torch.cuda.current_device() if self.buffer.on_device else None, coalesce=True)
        self.inbox = PullQueue(f"tcp://{host}:*", "kv_prefill", bind=True)
        self.monitor = PeerMonitor()  # the KV inboxes of decodes that claimed open rooms
        p = self.pool
        self.layout = KVLayoutInfo(str(p.dtype).replace("torch.", ""), sum(p.stores_layer(i) for i in range(p.num_layers)),
                                   p.num_kv_heads, p.head_dim, getattr(p, "group_size", 32))
        register_prefill_rank(host, settings.bootstrap_port, self._registration(host))
        logger.info("PD prefill: KV sender %s on %s (%s), endpoint %s, %d MiB send buffer in %s memory",
                    settings.backend, self.engine.session_id(), self.engine.describe(), self.inbox.endpoint,
                    settings.buffer_bytes >> 20, self.buffer.location)

    def _registration(self, host: str) -> dict:
        """This rank's PUT /route body (bootstrap_server.py)."""
        return {
            "attn_tp_size": 1, "attn_tp_rank": 0, "attn_cp_size": 1, "attn_cp_rank": 0, "attn_dp_size": 1,
            "attn_dp_rank": 0, "pp_size": 1, "pp_rank": 0, "system_dp_size": 1, "system_dp_rank": 0,
            "rank_ip": host, "rank_port": self.inbox.port, "page_size": self.ctx.kv.page_size,
            "kv_cache_dtype": "auto", "kv_layout": "sgl_kvxfer-segments", "load_balance_method": "round_robin",
            "decode_allocation_policy": "early", "transfer_backend": self.settings.backend,
            "transfer_session": self.engine.session_id(), "kv_layout_info": msgspec.structs.asdict(self.layout)}

    # ------------------------------------------------------------------ scheduler hooks
    def before_forward(self, batch, fb) -> None:
        """The trace's chunk start (an SCD producer also captures hidden states here)."""
        if self.settings.trace:
            now = time.time()
            for s in batch.slices:
                room = self._room_of(s.req)
                if room is not None and room.trace is not None:
                    if room.trace.start_of("queue") is None:  # its first chunk
                        room.trace.add("queue", room.trace.start_of("arrival"), now)
                    # keyed by the chunk's end: with overlapped prefill the next chunk is
                    # launched before this one's after_forward reads its start
                    room.launched[s.start + s.length] = now

    def after_launch(self, batch) -> None:
        """On a GPU, an event right behind the chunk's kernels marks its end (with overlapped
        chunks the next chunk is in the stream before this one's results are applied): a traced
        room's chunk span waits for it, and a tiered chunk stream packs the chunk on the side
        stream after it (pack_stream.py; not the prompt's last chunk, packed at the final tiers)."""
        if not str(self.device).startswith("cuda"):
            return
        traced, marked = [], []
        for s in batch.slices:
            room, end = self._room_of(s.req), s.start + s.length
            if room is None:
                continue
            if self.settings.trace and getattr(room, "trace", None) is not None:
                traced.append((room, end))
            if self.packs is not None and getattr(room, "stream", None) in CHUNK_STREAMS and end < s.req.seq_len:
                marked.append((room, end))
        if not (traced or marked):
            return
        if self.packs is not None:
            done = self.packs.mark()
        else:
            done = torch.cuda.Event()
            done.record()
        for room, end in traced:
            room.chunk_done[end] = done
        for room, end in marked:
            room.chunk_marks[end] = done

    def after_forward(self, batch) -> None:
        """The trace's chunk end; on a GPU it waits for the chunk's kernels (trace runs only)."""
        if not self.settings.trace or batch.mode != ForwardMode.EXTEND:
            return
        rooms = [(s, r) for s in batch.slices if (r := self._room_of(s.req)) is not None and r.trace is not None]
        if rooms and str(self.device).startswith("cuda"):
            events = [room.chunk_done.pop(s.start + s.length, None) for s, room in rooms]
            if all(e is not None for e in events):
                for e in events:
                    e.synchronize()
            else:
                torch.cuda.synchronize()
        now = time.time()
        for s, room in rooms:
            end = s.start + s.length
            room.trace.add(f"prefill[{s.start}:{end}]", room.launched.pop(end, now), now)
            room.forward_end = now

    def wake_sockets(self) -> list:
        return [] if self.fake else [self.inbox, self.wake]

    def transfers(self, req) -> bool:
        """A request whose KV leaves this server (not a health check or a prefill-only one)."""
        b = req.bootstrap
        return (not self.fake and b is not None and b.host != FAKE_BOOTSTRAP_HOST
                and req.sampling.max_new_tokens > 0)

    def on_new_request(self, req) -> bool:
        """Open the request's room; the request itself is queued as usual (returns False)."""
        if self.transfers(req):
            room = self.rooms.get(req.bootstrap.room)
            if room is None or room.req is not None:  # a fresh room (a reused id replaces a stale one)
                room = self.rooms[req.bootstrap.room] = PrefillRoom(req.bootstrap.room)
            room.req, room.stream, room.last_chunk = req, self.stream, self.last_chunk
            room.created = room.progress = time.monotonic()
            self.ended.pop(room.room, None)  # a reused id starts afresh
            if self.trace_on:
                room.trace = PhaseTrace()
                room.trace.add("arrival", time.time(), time.time())
            if self.tiered and room.stream in CHUNK_STREAMS:
                self.tiering.rank_chunks(req)  # feed a per-chunk importance window from now on
        return False

    def on_chunk(self, req, start: int, end: int) -> None:
        room = self._room_of(req)
        if room is None or room.error:
            return
        if self.tiered and room.stream == "end":  # nothing leaves before the final tiers exist
            room.chunk_ends.append(end)
            return
        # from `streamed`, not `start`: a prompt whose head came from the prefix cache has its
        # first chunk start past 0, and the decode needs those cached positions too
        start = room.streamed
        if not self.tiered:
            room.pending.append(_Range(start, end, "stored"))
        elif room.stream == "int8":
            room.pending.append(_Range(start, end, "int8"))
        else:  # chunk streams: tiers at budget b for this chunk, from what is known now
            t0 = time.time()
            tiers, slots = self.tiering.chunk_tiers(req, start, end, with_slots=True)
            after = room.chunk_marks.pop(end, None)
            for stale in [e for e in room.chunk_marks if e < end]:  # (none in order; a retry's)
                del room.chunk_marks[stale]
            room.pending.append(_Range(start, end, "chunk", tiers, slots, after))
            if room.trace is not None:
                room.trace.add(f"chunk_tier[{start}:{end}]", t0)
        room.streamed = end
        if self.tiered and room.stream in CHUNK_STREAMS:
            # pack now, while the next chunk (launched before this one's results were applied,
            # when chunks overlap) computes: a range still pending when the prompt ends would
            # go at the final tiers after the re-tier instead
            self._pump(room)

    def last_chunk_tokens(self, req) -> int:
        """--kv-transfer-last-chunk for a tiered chunk stream's request: its last chunk is short,
        so the segment that can only leave once the prompt is done (at the final tiers) is short
        too, and the rest streamed under the compute (0: chunks as the chunk size cuts them; the
        scheduler cuts only a rest of one chunk and at least twice this, Scheduler._chunk_limit)."""
        room = self._room_of(req)
        if room is None or not self.tiered or getattr(room, "stream", None) not in CHUNK_STREAMS:
            return 0  # (an SCD room streams codes, not chunk tiers)
        return room.last_chunk

    def on_prompt_done(self, req) -> bool:
        """The prompt is prefilled; True when the request now waits here for its KV to go out.
        A request with no peer (2.2.2.2, the fake backend) ends now: a prefill server never
        decodes."""
        room = self._room_of(req)
        if room is None:
            if req.finished_reason is None:
                req.finish({"type": "length", "length": len(req.output_ids)})
            return False
        n = len(req.origin_input_ids)
        if room.trace is not None:
            now = time.time()
            room.trace.add("tier", room.forward_end or now, now)  # tiering + caching after the forward
            spans = self.tiering.prefill_spans.pop(req, []) if self.tiered else []
            for name, a, b in spans:  # its parts: scores, retier (evictions), then the radix insert
                room.trace.add(name, a, b)
            if spans:
                room.trace.add("cache", max(b for _, _, b in spans), now)
        if self.tiered and room.stream in CHUNK_STREAMS:
            self._finalize_chunks(room, n)
        if self.tiered and room.stream == "int8" and room.streamed:
            room.pending.append(_Range(0, room.streamed, "replace"))
        if room.streamed < n:
            # tiered "end": two segments, cut at the first chunk's end. A pack's host time hardly
            # grows with its length (launch-bound: a fixed number of gathers, codec calls and
            # copies per tier), so the first write waits for one chunk's pack while the rest goes
            # as one segment, packed under that write; a segment per chunk would put every
            # further pack in series on the tail
            cut = [e for e in room.chunk_ends if room.streamed < e < n][:1]
            bounds = [room.streamed, *cut, n]
            room.pending.extend(_Range(a, b, "stored") for a, b in zip(bounds, bounds[1:]))
            room.streamed = n
        room.prompt_done, room.prompt_done_at = True, time.monotonic()
        if room.state == KVPoll.BOOTSTRAPPING and room.claim is not None:
            room.state = KVPoll.TRANSFERRING
        if room.error:
            self._finish(room)
        return True

    def abort(self, rid: str, abort_all: bool) -> None:
        """A request waiting here ends as aborted; one still prefilling is the scheduler's to
        end (its room just closes)."""
        for room in list(self.rooms.values()):
            req = room.req
            if req is None or not (abort_all or req.rid == rid):
                continue
            if room.prompt_done:
                req.finish({"type": "abort", "message": "Abort requested", "status_code": None, "err_type": None})
                self._fail(room, "aborted")
            else:
                room.req = None
                self._fail(room, "aborted")

    def has_work(self) -> bool:
        """Requests wait here (prompt done, KV going out): keep the scheduler loop turning."""
        return any(r.prompt_done for r in self.rooms.values())

    def poll(self) -> None:
        if self.fake:
            return
        self.wake.drain()
        for msg in self.inbox.get_all_nowait():
            self._on_message(msg)
        for res in self.sender.drain():
            self._on_result(res)
        now = time.monotonic()
        self.check_peers(now)
        for room in list(self.rooms.values()):
            self._service_room(room, now)
        while self.ended and next(iter(self.ended.values()))[1] <= now:
            del self.ended[next(iter(self.ended))]
        self._join_packs()  # the step's forward and frees come after every pack launched so far

    # ------------------------------------------------------------------ peer liveness (role.py)
    def _decode_of(self, room) -> str | None:
        """The decode a live room depends on (None: none registered yet, or the room failed)."""
        # NOTE: an SCD room (scd_prefill.py) has consumers, not one decode: not watched here
        decode = getattr(room, "decode", None)
        return decode if decode and room.error is None else None

    def watched_peers(self) -> dict:
        """The KV inboxes of decodes that registered for or claimed open rooms."""
        return {endpoint_peer(d): d for d in map(self._decode_of, self.rooms.values()) if d}

    def on_peer_dead(self, peer, reason: str) -> None:
        """A decode that registered for rooms and died: its rooms end now, naming it."""
        for room in [r for r in self.rooms.values() if (d := self._decode_of(r)) and endpoint_peer(d) == peer]:
            room.claim = None  # nothing more goes to it
            self._fail(room, reason)

    def _service_room(self, room, now: float) -> None:
        """One poll's work on a room: send what is ready, fail it past its deadline."""
        self._pump(room)
        self._check_deadline(room, now)

    def server_info(self) -> dict:
        extra = {} if self.fake else {"send_buffer_used_bytes": self.send_alloc.used_bytes(),
                                      "endpoint": self.inbox.endpoint, "stream": self.stream,
                                      "buffer": self.buffer.location, "checksum": self.buffer.checksum_kind,
                                      **self.engine.describe()}
        return self.stats.to_dict(rooms_open=len(self.rooms),
                                  rooms_prefilled=sum(r.prompt_done for r in self.rooms.values()), **extra)

    # ------------------------------------------------------------------ messages and results
    def _room_of(self, req):
        if not self.transfers(req):
            return None
        room = self.rooms.get(req.bootstrap.room)
        return room if room is not None and room.req is req else None

    def _on_message(self, msg) -> None:
        room = self.rooms.get(msg.room)
        if isinstance(msg, (KVRegister, KVClaim)):
            failed = room.error if room is not None else self.ended.get(msg.room, ("",))[0]
            if failed:  # late for a room that failed here: the decode prefills locally now
                self.sender.submit(NoticeJob(msg.room, msg.decode_id, KVFailed(msg.room, failed)))
                return
        if isinstance(msg, KVRegister):
            if room is None:  # the decode came first: the request follows (or the room orphans)
                room = self.rooms[msg.room] = PrefillRoom(msg.room)
            room.decode, room.progress = room.decode or msg.decode_id, time.monotonic()
        elif isinstance(msg, KVClaim):
            if msg.layout != self.layout:
                self.sender.submit(NoticeJob(msg.room, msg.reply_to, KVFailed(
                    msg.room, f"incompatible KV layout: prefill {self.layout}, decode {msg.layout}")))
                return
            if room is None:  # the claim came first: the request follows (or the room orphans)
                room = self.rooms[msg.room] = PrefillRoom(msg.room)
            room.claim, room.ring, room.progress = msg, RingWriter(msg.region_bytes), time.monotonic()
            room.decode = msg.reply_to
            if room.prompt_done and room.state == KVPoll.BOOTSTRAPPING:
                room.state = KVPoll.TRANSFERRING
            elif room.state == KVPoll.BOOTSTRAPPING:
                room.state = KVPoll.WAITING_FOR_INPUT
        elif room is None or room.claim is None or msg.decode_id != room.claim.decode_id:
            return  # a late message for a room that ended, or from a decode it no longer serves
        elif isinstance(msg, KVAck):
            room.ring.ack(msg.seq)
            room.progress = time.monotonic()
        elif isinstance(msg, KVCancel):
            room.claim = None  # nothing more goes to that decode
            self._fail(room, f"cancelled by decode: {msg.reason}")

    def _on_result(self, res) -> None:
        room = self.rooms.get(res.room)
        if room is None:
            return
        off = room.inflight.pop(res.seq, None)
        if off is not None:
            self.send_alloc.free(off)
        room.progress = time.monotonic()
        if res.error:
            self._fail(room, f"write failed: {res.error}")
        elif res.seq >= 0:
            room.wire_bytes += res.nbytes
            room.wire_seconds += res.write_seconds
            self.stats.moved(res.nbytes)
            if room.trace is not None:
                if res.ready_wait is not None:  # the sender waiting for the pack's kernels
                    room.trace.add(f"pack_wait[{res.seq}]", *res.ready_wait)
                room.trace.add(f"wire[{res.seq}]", res.write_start, res.write_end)
        elif room.done_queued and room.error is None:  # KVDone is out
            room.state = KVPoll.SUCCESS
            self.stats.outcome("ok")
            self._finish(room)
        if room.error is not None and room.req is not None and (room.prompt_done or room.req.finished):
            self._finish(room)  # a failed room's last write reported

    # ------------------------------------------------------------------ sending
    def _pump(self, room: PrefillRoom) -> None:
        if room.claim is None or room.error or room.state == KVPoll.SUCCESS:
            return
        while room.pending:
            if not self._send_next(room):
                return
        if room.prompt_done and not room.inflight and not room.done_queued:
            self._queue_done(room)

    def _segment_tiers(self, room: PrefillRoom, rng: _Range, slots: torch.Tensor) -> torch.Tensor:
        """Wire tier per position of the range (int16: TIER_KEEP does not fit int8; on the wire
        one unsigned byte each)."""
        if rng.kind == "chunk":
            return rng.tiers.to(torch.int16)
        stored = wire_tier_of(self.pool, slots).to(torch.int16)
        if rng.kind == "int8":
            return torch.where(stored == TIER_DROP, stored, torch.full_like(stored, TIER_INT8))
        if rng.kind == "replace":  # what the int8 stream got right stays where it is
            return torch.where(stored == TIER_INT8, torch.full_like(stored, TIER_KEEP), stored)
        if rng.kind == "upgrade":  # a smaller tier id is more precise: resend those, keep the rest
            sent = room.sent_tiers[rng.start:rng.end]
            return torch.where(stored < sent, stored, torch.full_like(stored, TIER_KEEP))
        return stored

    def _on_final_tiers(self, req, start: int, slots: torch.Tensor, tiers: torch.Tensor) -> None:
        try:
            self._pack_final(req, start, slots, tiers)
        finally:
            # NOTE: the re-tier moves the prompt's rows and frees its fp16 ones right after this
            # hook: its kernels (and any later reuse of those rows) queue behind every side pack
            self._join_packs()

    def _pack_final(self, req, start: int, slots: torch.Tensor, tiers: torch.Tensor) -> None:
        """A chunk stream's prompt end, after its final tiers are assigned and before the re-tier
        moves its KV (EngineTiering.final_tiers_hook): what has not left yet (the last chunk,
        and chunks the link has not taken) is packed now at the final tiers asked for, quantized
        from the model-dtype rows on the way, so its write does not wait for the move. The
        pack's kernels are enqueued ahead of the move's, which is what keeps the rows it reads
        intact. A range the ring or the send buffer cannot take yet stays pending and is dropped
        at on_prompt_done (_finalize_chunks): it then goes as the pool's stored codes. Where the
        re-tier gets a more precise tier than asked (a short store), `chunk-upgrade` resends it."""
        room = self._room_of(req)
        if room is None or room.error or getattr(room, "stream", None) not in CHUNK_STREAMS:
            return
        n = len(req.origin_input_ids)
        first = room.pending[0].start if room.pending else room.streamed  # packed in order: a suffix
        if start + slots.numel() != n or not start <= first < n:
            return  # positions before `start` are the cache's, at their cached tiers: stored codes
        room.pending.clear()
        room.pending.append(_Range(first, n, "chunk", tiers[first - start:], slots[first - start:]))
        room.streamed = n
        self._pump(room)  # (on the current stream: these ranges carry no chunk event)

    def _finalize_chunks(self, room: PrefillRoom, n: int) -> None:
        """Prompt end of a chunk stream: chunk ranges not packed yet go at the final tiers
        instead (none of their bytes left), and the upgrade pass covers what did leave."""
        if room.pending:  # NOTE: packed in order, so the unpacked chunks are a suffix
            room.streamed = room.pending[0].start
            room.pending.clear()
        if room.stream == "chunk-upgrade" and room.streamed:
            room.pending.append(_Range(0, room.streamed, "upgrade"))

    def _send_next(self, room: PrefillRoom) -> bool:
        """Pack the next pending range (split to fit the decode's ring) and queue its write."""
        rng = room.pending[0]
        req = room.req
        t0 = time.time()
        # the range's slot ids on the host: the one read-back of a pack (tiers, the live cut
        # and pack_segment's routing below all run on these, with no further host sync)
        slots = rng.slots if rng.slots is not None else self.table.read(req.req_pool_idx, rng.end, start=rng.start).cpu()
        tiers = self._segment_tiers(room, rng, slots)
        if rng.kind == "upgrade" and bool((tiers == TIER_KEEP).all()):
            room.pending.popleft()  # no token's tier rose: nothing to resend
            return True
        live = (tiers != TIER_DROP) & (tiers != TIER_KEEP)
        lay = segment_layout(self.pool, tier_counts(tiers[live]))
        if not room.ring.fits_ever(lay.total_bytes) or lay.total_bytes > self.send_alloc.total // 2:
            if rng.end - rng.start == 1:
                self._fail(room, f"one token's KV ({lay.total_bytes} B) exceeds the transfer buffers")
                return False
            room.pending.popleft()
            room.pending.extendleft(reversed(rng.split()))
            return True
        seq = room.next_seq
        dst = room.ring.place(seq, lay.total_bytes)
        if dst is None:
            return False  # the decode has not acked enough yet
        src = self.send_alloc.alloc(lay.total_bytes)
        if src is None:
            room.ring.ack(seq)  # undo the placement; retry next poll
            return False
        payload = self.buffer[src:src + lay.total_bytes]
        # nothing here waits for the pack: on CUDA the sender thread waits for `ready` (recorded
        # after the pack and, for a device buffer, the checksums summed where the bytes are, on
        # the stream that ran them) before it reads the bytes; a host buffer gets its xxh3 there.
        # A chunk's own range packs on the side stream after that chunk's kernels (pack_stream.py)
        side = self.packs is not None and rng.after is not None
        with self.packs.after(rng.after) if side else nullcontext():
            pack_segment(self.pool, slots[live], tiers[live], payload)
            ready, host_sums = None, None
            if self.buffer.on_device:
                host_sums, ready = wsum64_async(payload)
            elif torch.cuda.is_available():
                ready = torch.cuda.Event()
                ready.record()
        if rng.kind == "chunk":
            if room.sent_tiers is None:
                room.sent_tiers = torch.full((len(req.origin_input_ids),), -1, dtype=torch.int16)
            room.sent_tiers[rng.start:rng.end] = tiers
        segment = KVSegment(room.room, seq, rng.start, rng.end, None if bool((tiers == 0).all()) else tiers.to(torch.uint8).numpy().tobytes(),
                            lay.lens, dst, lay.total_bytes, 0, [], replaces=rng.kind in ("replace", "upgrade"))
        room.inflight[seq] = src
        room.next_seq += 1
        room.pending.popleft()
        room.first_write = room.first_write or time.monotonic()
        if room.trace is not None:
            room.trace.add(f"pack[{seq}]", t0)
        c = room.claim
        self.sender.submit(WriteJob(room.room, seq, payload, c.session, c.region_addr + dst, c.reply_to, segment,
                                    None, self.buffer.checksum_kind if self.buffer.on_device else "xxh3",
                                    ready, host_sums))
        return True

    def _queue_done(self, room: PrefillRoom) -> None:
        req = room.req
        msg = KVDone(room.room, room.next_seq, req.output_ids[0], req.cached_tokens, room.wire_bytes,
                     wire_seconds=room.wire_seconds, tail_seconds=time.monotonic() - room.prompt_done_at)
        if req.return_logprob and req.output_token_logprobs:
            msg.output_token_logprob = req.output_token_logprobs[0]
            msg.output_top_logprobs = req.output_top_logprobs[:1] or None
            msg.output_token_ids_logprobs = req.output_token_ids_logprobs[:1] or None
        room.done_queued = True
        self.stats.tokens += len(req.origin_input_ids)
        if room.trace is not None:
            room.trace.add("notice", time.time())
            pauses = getattr(self, "gc_pauses", None)
            if pauses is not None:
                room.trace.spans.extend(pauses.spans(room.trace.start_of("arrival") or 0.0, time.time()))
            msg.trace = room.trace.spans
        self.sender.submit(NoticeJob(room.room, room.claim.reply_to, msg))

    # ------------------------------------------------------------------ endings
    def _join_packs(self) -> None:
        """NOTE: side-stream packs read pool rows that only compute-stream kernels change. Every
        place after which the request's rows may move, be freed or be reused (the final re-tier,
        a failed or finished room, the end of each poll: before the step's forward, after an
        abort's or a failed batch's frees) joins first, so those kernels queue behind the packs.
        No host wait."""
        if self.packs is not None:
            self.packs.join()

    def _check_deadline(self, room: PrefillRoom, now: float) -> None:
        if room.error or room.state == KVPoll.SUCCESS or room.done_queued:
            return
        deadline = self.settings.claim_deadline_s
        if room.decode is None and room.req is not None and now - room.created > deadline:
            self._fail(room, f"decode unreachable: no decode registered for the room within {deadline:g} s of "
                             "the request's arrival (the decode died or never got the request)")
        elif now - room.progress > self.settings.timeout_s:
            if room.req is None:  # an orphan claim: its request never came
                self._fail(room, "no request for the room")
            elif room.claim is None:
                self._fail(room, "no decode claimed the room")
            elif room.prompt_done:
                self._fail(room, "transfer stalled")

    def _fail(self, room: PrefillRoom, reason: str) -> None:
        self._join_packs()  # the scheduler may free the request's KV next (an abort)
        if room.error is None:
            room.error = reason
            room.state = KVPoll.FAILED
            self.ended[room.room] = (reason, time.monotonic() + self.settings.timeout_s)
            self.sender.cancelled.add(room.room)  # its queued writes must not start
            self.stats.outcome("failed:" + reason.split(":")[0])
            logger.warning("PD room %d failed: %s", room.room, reason)
            if room.claim is not None:
                self.sender.submit(NoticeJob(room.room, room.claim.reply_to, KVFailed(room.room, reason)))
        if room.req is None:  # nothing was packed for it
            self.rooms.pop(room.room, None)
            self.sender.cancelled.discard(room.room)
        elif room.prompt_done or room.req.finished:
            self._finish(room)

    def _finish(self, room: PrefillRoom) -> None:
        """End the request: its HTTP reply completes and its KV goes to the radix cache."""
        if room.inflight or room.finished:  # writes still read the send buffer: finish when they report
            return
        room.finished = True
        self.rooms.pop(room.room, None)
        self.sender.cancelled.discard(room.room)
        req = room.req
        if req.finished_reason is None:
            req.finish({"type": "length", "length": len(req.output_ids)})
        req.extra_meta = {"kv_transfer": {"status": "ok" if room.error is None else "failed: " + room.error,
                                          "bytes": room.wire_bytes,
                                          "bytes_per_token": room.wire_bytes / max(1, len(req.origin_input_ids)),
                                          "transfer_ms": 1e3 * (time.monotonic() - (room.first_write or time.monotonic()))}}
        if room.trace is not None:
            req.extra_meta["kv_transfer"]["trace"] = room.trace.spans
        self._join_packs()  # (its packs have all run: the sender waited for each `ready`)
        self.ctx.retire(req)

    def set_link(self, rate_gbps: float, latency_ms: float, stream: str | None = None,
                 trace: bool | None = None, last_chunk: int | None = None) -> tuple[bool, str]:
        """Re-pace the shaped link (the server was started with --kv-transfer-rate-gbps; rate 0:
        unpaced) and, with `stream`, switch --kv-transfer-stream for rooms opened from now on;
        with `trace`, trace those rooms or not (--enable-pd-trace servers: a traced chunk waits
        for its kernels, so untraced requests give the undisturbed timing); with `last_chunk`,
        their --kv-transfer-last-chunk. An unshaped link takes rate 0 and latency 0 only (a
        stream, trace or last-chunk switch)."""
        if self.fake:
            return False, "the fake transfer backend moves no KV"
        if not (0 <= rate_gbps <= 1e6 and 0 <= latency_ms <= 1e6):  # NaN fails every comparison
            return False, "rate_gbps must be in [0, 1e6] (0: unpaced) and latency_ms in [0, 1e6]"
        if stream is not None and stream not in STREAMS:
            return False, f"stream must be one of {STREAMS}, got {stream!r}"
        if last_chunk is not None and not (last_chunk == 0 or 32 <= last_chunk <= 1 << 20):
            return False, f"last_chunk must be 0 (off) or tokens in [32, {1 << 20}], got {last_chunk}"
        if trace and not self.settings.trace:
            return False, "tracing needs a server started with --enable-pd-trace"
        shaped = isinstance(self.engine, ShapedTransferEngine)
        if not shaped and (rate_gbps or latency_ms):
            return False, "the KV link is not shaped: start the prefill server with --kv-transfer-rate-gbps"
        if shaped:
            self.engine.set_link(rate_gbps, latency_ms)
        self.stream = stream or self.stream
        self.trace_on = self.trace_on if trace is None else trace
        self.last_chunk = self.last_chunk if last_chunk is None else last_chunk
        logger.info("KV link re-paced: %g Gbit/s, %g ms, stream %s, trace %s, last chunk %d", rate_gbps, latency_ms,
                    self.stream, self.trace_on, self.last_chunk)
        return True, (f"KV link: {rate_gbps:g} Gbit/s, {latency_ms:g} ms, stream {self.stream}, trace {self.trace_on}, "
                      f"last chunk {self.last_chunk}")

    def close(self) -> None:
        super().close()
        if getattr(self, "gc_pauses", None) is not None:
            self.gc_pauses.close()
        if not self.fake:
            self.sender.close()
            self.inbox.close()
