"""The SCD producer: a prefill role that ships a prompt's KV as low-rank codes, encoded once for
every consumer that claims them (docs/pd_disaggregation.md, "SCD over PD").

    on_new_request(req)    a room opens (or meets claims that came first) and picks its rank level;
                           the request takes a cached prefix like any other (see the zh pool)
    before_forward(b, fb)  installs the hidden-state capture (models/llama.py HIDDEN_CAPTURE) on
                           every forward: each Patch layer's input_layernorm output is encoded
                           into the zh pool at the token's KV slot as the forward runs. A room's
                           first chunk that starts past 0 (its prefix came from the radix cache)
                           first queues the codes of that prefix as a segment of their own: they
                           cross the link and are rebuilt while this forward computes the rest
    after_launch(b)        (and before_forward) such a segment is handed to the sender now, to
                           the consumers whose claims are in (the inbox is read here too): the
                           scheduler thread waits for the forward's results before its next poll
    on_chunk(req, a, b)    positions [a, b) are computed: the codes of every position not sent yet
                           (Reuse layers from the KV the pool holds, Patch layers from the zh
                           pool) become one segment in the send buffer, written to every
                           consumer that claimed the room so far. Nothing here waits for the
                           encode's kernels: the sender thread waits for an event behind them
                           (and the device checksums) before the write
    on_prompt_done(req)    the last segment; the request's reply ends now and its KV goes to the
                           radix cache: the codes live on in the send buffer, under the room

The zh pool: per Patch layer a [pool.id_end, r_h] tensor beside the KV pool, indexed by KV slot and
written by every forward, so a slot's patch code lives exactly as long as its KV. A prompt whose
prefix is in the radix cache (a shared document prefilled before) takes that prefix's KV and
patch codes from the pools and computes only the rest: its codes are the same as a full prefill's.

Codes cover positions [0, n - 1): a consumer computes the last prompt position itself (its
first decode step), so the first token comes from its own model, not from the producer's.

Rank level (artifacts with nested `rank_levels`): chosen per room when its request arrives,
by --scd-rank (top, a fixed R_K:R_V, or auto: scd/rank_policy.py from the link rate and the
expected prefill time); every segment of the room is at that level, and a consumer reads the
level from the segment's bytes per token.

A room serves up to --scd-fanout consumers (claims naming the same manifest id), each with its
own ring, sequence numbers and acks; the segments are shared (encoded once, written N times).
The room closes when that many consumers have finished, or when nothing happened for
--kv-transfer-timeout once its codes were complete (or a claim's request never came): its
send-buffer bytes are freed, and a later claim gets KVFailed (that consumer prefills locally).

--enable-pd-trace (disagg/trace.py): a traced room records the prefill's queue / prefill[a:b]
spans, then per segment s `code[s]` (the projection of its KV and patch codes to the wire
codes) and `pack[s]` (packed into the send buffer, checksums summed), each waiting for its
kernels (traced rooms only: the untraced ones never wait), and per consumer its `wire[s]` and
`notice`; its KVDone carries them to that consumer.
"""
from __future__ import annotations

import functools
import itertools
import logging
import time
from collections import Counter, deque
from dataclasses import dataclass, field

import torch

from sgl_kvxfer.disagg.buffers import wsum64_async
from sgl_kvxfer.disagg.prefill import PrefillRole
from sgl_kvxfer.disagg.scd_common import ScdSetupError, load_producer, route_info
from sgl_kvxfer.disagg.sender import NoticeJob, WriteJob
from sgl_kvxfer.disagg.staging import RingWriter
from sgl_kvxfer.disagg.trace import PhaseTrace
from sgl_kvxfer.mem_cache.scd_payload import CodeLayout, pack_codes
from sgl_kvxfer.message.disagg import KVAck, KVCancel, KVClaim, KVDone, KVFailed, KVSegment
from sgl_kvxfer.models.llama import HIDDEN_CAPTURE
from sgl_kvxfer.scd.rank_policy import LevelChooser

logger = logging.getLogger(__name__)


@dataclass
class _Segment:
    start: int
    end: int
    offset: int  # in the send buffer
    nbytes: int
    # CUDA: an event behind the encode and pack (and the device checksums' copy to `sums`); every
    # consumer's write waits for it in the sender thread, never the scheduler thread
    ready: object | None = None
    sums: torch.Tensor | None = None  # device send buffer: wsum64_async's host sums, once for every consumer


@dataclass
class _Consumer:
    claim: KVClaim
    ring: RingWriter
    sent: int = 0  # room.segments[:sent] are queued to this consumer
    inflight: int = 0
    done_queued: bool = False
    outcome: str | None = None  # "ok" or a failure reason, once finished
    wire_bytes: int = 0
    wire_seconds: float = 0.0
    spans: list = field(default_factory=list)  # --enable-pd-trace: its wire[s] [name, start, end]


@dataclass
class ScdRoom:
    room: int
    req: object = None
    limit: int = 0  # positions [0, limit) get codes: prompt length - 1
    level: int = -1  # index into manifest.levels the codes go at (-1: the top)
    opened: float = field(default_factory=time.monotonic)
    encoded: int = 0
    segments: list = field(default_factory=list)
    prompt_done: bool = False
    prompt_done_at: float = 0.0
    first_token: int = 0
    consumers: dict = field(default_factory=dict)  # decode_id -> _Consumer
    notices: deque = field(default_factory=deque)  # (decode_id, "done" | "failed") per queued notice
    inflight: int = 0
    closing: str | None = None  # why it closes; set once
    progress: float = field(default_factory=time.monotonic)
    started: bool = False  # its request's first chunk was launched
    # --enable-pd-trace (the fields PrefillRole's chunk hooks read and write)
    trace: PhaseTrace | None = None
    launched: dict = field(default_factory=dict)
    chunk_done: dict = field(default_factory=dict)
    forward_end: float = 0.0


class ScdPrefillRole(PrefillRole):
    def __init__(self, settings, host: str):
        super().__init__(settings, host)
        self.fanout = settings.scd_fanout
        self.closed: dict[int, tuple[str, float]] = {}  # room -> (why, forget after)
        self._jobs: dict[int, tuple[int, str, int]] = {}  # write job id -> (room, decode_id, segment index)
        self._job_ids = itertools.count()
        self.encoded = {"rooms": 0, "tokens": 0, "bytes": 0}  # prefills whose codes were encoded (once each)
        self.rooms_closed: Counter = Counter()  # why rooms closed ("served", "fan-out timed out", ...)
        self.early: list[ScdRoom] = []  # rooms whose cached prefix's codes were queued by before_forward

    def start(self, ctx) -> None:
        runner, settings = ctx.runner, self.settings
        self.artifacts, self.manifest_id = load_producer(settings.scd_artifacts, runner)
        self.manifest = self.artifacts.manifest
        from sgl_kvxfer.scd.codec import ScdEncoder

        self.encoder = ScdEncoder(self.artifacts, runner.device)
        self.code_layout = CodeLayout.from_manifest(self.manifest)
        self.levels = self.manifest.levels
        self.layouts = [CodeLayout.from_manifest(self.manifest, lv) for lv in self.levels]
        try:
            self.chooser = LevelChooser(self.levels, [lay.bytes_per_token for lay in self.layouts],
                                        settings.scd_rank, settings.scd_wire_frac, settings.scd_min_rank,
                                        self.manifest.level_agreement)
        except ValueError as e:
            raise ScdSetupError(f"--scd-artifacts {settings.scd_artifacts}: {e}") from e
        self.patch_layers = frozenset(self.manifest.patch_layers)
        super().start(ctx)
        # NOTE: rows for every slot id the pool stores (pool.id_end), not pool.size + 1: a paged
        # allocator's last page ends at slot size + PAGE - 1. An index past the table is an
        # IndexError on the CPU but a device-side assert on a GPU, reported at a later sync
        self.zh_pool = {layer: torch.zeros(self.pool.id_end, self.manifest.r_h, dtype=self.manifest.code_dtype,
                                           device=self.pool.device) for layer in self.patch_layers}
        logger.info("SCD producer: artifacts %s (id %s), %d B/token of codes vs %d B/token of KV, fan-out %d",
                    settings.scd_artifacts, self.manifest_id[:12], self.code_layout.bytes_per_token,
                    self.manifest.raw_kv_bytes_per_token(torch.finfo(self.pool.dtype).bits // 8), self.fanout)

    def _paced_gbps(self) -> float | None:
        rate = getattr(self.engine, "rate_bps", 0)
        return rate / 1e9 if 0 < rate < float("inf") else None

    def _registration(self, host: str) -> dict:
        return {**super()._registration(host), "scd": route_info(self.manifest, self.manifest_id)}

    # ------------------------------------------------------------------ scheduler hooks
    def on_new_request(self, req) -> bool:
        if not self.transfers(req):
            return False
        room = self.rooms.get(req.bootstrap.room)
        if room is not None and room.req is not None:  # a stale room under a reused id
            self._close(room, "replaced by a new request")
            room = None
        if room is None:
            self.closed.pop(req.bootstrap.room, None)
            room = self.rooms[req.bootstrap.room] = ScdRoom(req.bootstrap.room)
        n = len(req.origin_input_ids)
        room.req, room.limit, room.progress, room.opened = req, n - 1, time.monotonic(), time.monotonic()
        room.level = self.chooser.choose(n - 1, self._paced_gbps())
        room.trace = None
        if self.trace_on:
            room.trace = PhaseTrace()
            room.trace.add("arrival", time.time(), time.time())
        return False

    def before_forward(self, batch, fb) -> None:
        for s in batch.slices:
            room = self._room_of(s.req)
            if room is None or room.started:
                continue
            room.started = True
            if s.start > 0 and room.closing is None:
                # the prefix came from the radix cache: its KV and patch codes are in the pools
                # now, so its codes go out while this forward computes the rest (launched
                # ahead of the forward in the stream; nothing here waits for them)
                self._encode(room, s.start)
                self.early.append(room)
        self._send_early()
        super().before_forward(batch, fb)  # the trace's chunk starts (after that encode: prefill[a:b] is the forward)
        if self.patch_layers:
            fb.extras[HIDDEN_CAPTURE] = functools.partial(self._capture, fb.out_cache_loc)

    def after_launch(self, batch) -> None:
        super().after_launch(batch)
        self._send_early()  # claims that came in while the forward was launched

    def _send_early(self) -> None:
        """Early segments (a cached prefix's codes) to every consumer that has claimed by now."""
        if not self.early:
            return
        for msg in self.inbox.get_all_nowait():
            self._on_message(msg)
        now = time.monotonic()
        for room in self.early:
            self._pump(room, now)
        self.early = [r for r in self.early
                      if r.closing is None and not r.prompt_done and len(r.consumers) < self.fanout]

    def _capture(self, slots: torch.Tensor, layer: int, hidden: torch.Tensor) -> None:
        """hidden [T, hidden]: the batch's tokens, in the order of their KV slots `slots` [T]."""
        if layer in self.patch_layers:
            # NOTE: graph runners skip forwards that carry a capture: `slots` are real tokens'
            self.zh_pool[layer][slots] = self.encoder.encode_patch(layer, hidden)

    def on_chunk(self, req, start: int, end: int) -> None:
        room = self._room_of(req)
        if room is not None and room.closing is None:
            self._encode(room, end)

    def on_prompt_done(self, req) -> bool:
        """Encode the rest; the request ends now (returns False: the scheduler retires it)."""
        room = self._room_of(req)
        if room is None:
            return super().on_prompt_done(req)
        if room.closing is None:
            self._encode(room, room.limit)
        room.prompt_done, room.prompt_done_at = True, time.monotonic()
        self.chooser.observe_prefill(room.limit, room.prompt_done_at - room.opened)
        room.first_token, room.progress = req.output_ids[0], time.monotonic()
        req.finish({"type": "length", "length": len(req.output_ids)})
        nbytes = sum(s.nbytes for s in room.segments)
        if room.closing is None:
            self.encoded["rooms"] += 1
            self.encoded["tokens"] += room.limit
            self.encoded["bytes"] += nbytes
        req.extra_meta = {"kv_transfer": {"status": "failed: " + room.closing if room.closing else "encoded",
                                          "scd_manifest": self.manifest_id[:12], "bytes": nbytes,
                                          "scd_level": list(self.levels[room.level]),
                                          "bytes_per_token": nbytes / max(1, room.limit), "fanout": self.fanout}}
        if room.trace is not None:  # the producer's side up to its last segment's codes
            req.extra_meta["kv_transfer"]["trace"] = list(room.trace.spans)
        return False

    def abort(self, rid: str, abort_all: bool) -> None:
        for room in list(self.rooms.values()):
            if room.req is not None and not room.prompt_done and (abort_all or room.req.rid == rid):
                self._close(room, "aborted")  # the scheduler ends the request itself

    def has_work(self) -> bool:
        return any(r.inflight or r.notices or any(c.outcome is None and (c.sent < len(r.segments) or
                                                                         (r.prompt_done and not c.done_queued))
                                                  for c in r.consumers.values()) for r in self.rooms.values())

    def poll(self) -> None:
        super().poll()
        now = time.monotonic()
        for rid in [r for r, (_, until) in self.closed.items() if until <= now]:
            del self.closed[rid]

    def _service_room(self, room, now: float) -> None:
        self._pump(room, now)
        self._check_room(room, now)

    def server_info(self) -> dict:
        return {**super().server_info(),
                "scd": {"manifest_id": self.manifest_id, "fanout": self.fanout,
                        "bytes_per_token": self.code_layout.bytes_per_token, "encoded": dict(self.encoded),
                        **self.chooser.info(),
                        "rooms_closed": dict(self.rooms_closed)}}

    # ------------------------------------------------------------------ encoding
    def _room_of(self, req):
        if not self.transfers(req):
            return None
        room = self.rooms.get(req.bootstrap.room)
        return room if room is not None and room.req is req else None

    def _encode(self, room: ScdRoom, upto: int) -> None:
        """Codes of positions [room.encoded, upto) as one segment in the send buffer."""
        a, b = room.encoded, min(upto, room.limit)
        if b <= a:
            return
        seq, trace = len(room.segments), room.trace
        t0 = time.time()
        slots = self.table.read(room.req.req_pool_idx, b, start=a)
        positions = torch.arange(a, b, device=slots.device)
        self.encoder.rotary.prime(positions, num_positions=b)  # every layer's deRoPE: one lookup, no sync
        codes = {}
        level, layout = self.levels[room.level], self.layouts[room.level]
        for layer in self.manifest.reuse_layers:
            k, v = self.pool.get_kv(layer, slots)
            codes[(layer, "k")], codes[(layer, "v")] = self.encoder.encode_reuse(layer, k, v, positions, level)
        for layer in self.patch_layers:
            codes[(layer, "h")] = self.zh_pool[layer][slots]
        cuda = positions.device.type == "cuda"
        if trace is not None:
            if cuda:  # traced rooms only: the span ends with the encode's kernels
                torch.cuda.current_stream().synchronize()
            trace.add(f"code[{seq}]", t0)
            t0 = time.time()
        nbytes = layout.nbytes(b - a)
        off = self.send_alloc.alloc(nbytes)
        if off is None:
            self._close(room, f"send buffer full ({nbytes} B of codes do not fit --kv-transfer-buffer-mb)")
            return
        payload = self.buffer[off:off + nbytes]
        pack_codes(layout, codes, payload)
        # nothing here waits for the kernels: the sender thread waits for `ready` before it reads
        # the bytes or the sums (a host buffer gets its xxh3 there)
        ready, sums = None, None
        if self.buffer.on_device:
            sums, ready = wsum64_async(payload)
        elif cuda:
            ready = torch.cuda.Event()
            ready.record()
        if trace is not None:
            if ready is not None:
                ready.synchronize()
            trace.add(f"pack[{seq}]", t0)
        room.segments.append(_Segment(a, b, off, nbytes, ready, sums))
        room.encoded, room.progress = b, time.monotonic()

    # ------------------------------------------------------------------ claims and transfers
    def _claim_error(self, msg: KVClaim) -> str | None:
        if msg.scd is None:
            return (f"this prefill ships SCD codes (artifacts {self.manifest_id[:12]}); start the decode server "
                    "with --scd-artifacts")
        if msg.scd.manifest_id != self.manifest_id:
            return (f"SCD artifacts differ: prefill {self.manifest_id[:12]}, decode {msg.scd.manifest_id[:12]} "
                    "(both sides need the same calibration output)")
        if msg.scd.consumer not in self.manifest.consumer_names:
            return f"unknown SCD consumer {msg.scd.consumer!r} (artifacts name {self.manifest.consumer_names})"
        return None

    def _refuse(self, msg: KVClaim, reason: str) -> None:
        self.sender.submit(NoticeJob(msg.room, msg.reply_to, KVFailed(msg.room, reason)))

    def _on_message(self, msg) -> None:
        room = self.rooms.get(msg.room)
        if isinstance(msg, KVClaim):
            reason = self._claim_error(msg)
            if reason is None and room is None and msg.room in self.closed:
                reason = f"room closed: {self.closed[msg.room][0]}"
            if reason is None and room is not None and (room.closing or len(room.consumers) >= self.fanout):
                reason = room.closing or f"the room's codes went to its {self.fanout} consumer(s) (--scd-fanout)"
            if reason is not None:
                self._refuse(msg, reason)
                return
            if room is None:  # the claim came first: the request follows (or the room orphans)
                room = self.rooms[msg.room] = ScdRoom(msg.room)
            if msg.decode_id not in room.consumers:
                room.consumers[msg.decode_id] = _Consumer(msg, RingWriter(msg.region_bytes))
            room.progress = time.monotonic()
            return
        c = room.consumers.get(msg.decode_id) if room is not None else None
        if c is None or c.outcome is not None:
            return  # a late message for a room or consumer that ended
        room.progress = time.monotonic()
        if isinstance(msg, KVAck):
            c.ring.ack(msg.seq)
        elif isinstance(msg, KVCancel):
            self._consumer_ended(room, c, f"cancelled by decode: {msg.reason}", notify=False)

    def _pump(self, room: ScdRoom, now: float) -> None:
        if room.closing:
            return
        for c in room.consumers.values():
            if c.outcome is not None:
                continue
            while c.sent < len(room.segments):
                seg = room.segments[c.sent]
                if not c.ring.fits_ever(seg.nbytes):
                    self._consumer_ended(room, c, f"a {seg.nbytes}-byte code segment exceeds the decode's region")
                    break
                seq = c.sent
                dst = c.ring.place(seq, seg.nbytes)
                if dst is None:
                    break  # the decode has not acked enough yet
                job = next(self._job_ids)
                self._jobs[job] = (room.room, c.claim.decode_id, seq)
                segment = KVSegment(room.room, seq, seg.start, seg.end, None, (0, 0, 0), dst, seg.nbytes, 0, [],
                                    codes=True)
                # NOTE: every consumer's write reads the same send-buffer bytes (never rewritten
                # while the room is open); only the KVSegment (ring offset, seq) is per consumer
                self.sender.submit(WriteJob(room.room, job, self.buffer[seg.offset:seg.offset + seg.nbytes],
                                            c.claim.session, c.claim.region_addr + dst, c.claim.reply_to, segment,
                                            None, self.buffer.checksum_kind if self.buffer.on_device else "xxh3",
                                            seg.ready, seg.sums))
                c.sent += 1
                c.inflight += 1
                room.inflight += 1
            if c.outcome is None and room.prompt_done and c.sent == len(room.segments) and not c.inflight \
                    and not c.done_queued:
                c.done_queued = True
                room.notices.append((c.claim.decode_id, "done"))
                done = KVDone(room.room, c.sent, room.first_token, 0, c.wire_bytes, wire_seconds=c.wire_seconds,
                              tail_seconds=now - room.prompt_done_at)
                if room.trace is not None:  # the room's spans and this consumer's writes
                    done.trace = [*room.trace.spans, *c.spans, ["notice", time.time(), time.time()]]
                    if self.gc_pauses is not None:
                        done.trace.extend(self.gc_pauses.spans(room.trace.start_of("arrival") or 0.0, time.time()))
                self.sender.submit(NoticeJob(room.room, c.claim.reply_to, done))

    def _on_result(self, res) -> None:
        room = self.rooms.get(res.room)
        if res.seq >= 0:
            _, decode_id, seq = self._jobs.pop(res.seq, (None, None, None))
            if room is None:
                return
            room.inflight -= 1
            c = room.consumers.get(decode_id)
            if c is not None:
                c.inflight -= 1
                if res.error:
                    self._consumer_ended(room, c, f"write failed: {res.error}")
                else:
                    c.wire_bytes += res.nbytes
                    c.wire_seconds += res.write_seconds
                    self.stats.moved(res.nbytes)
                    self.chooser.observe_write(res.nbytes, res.write_seconds)
                    if room.trace is not None:
                        if res.ready_wait is not None:  # the sender waiting for the encode's kernels
                            c.spans.append([f"pack_wait[{seq}]", *res.ready_wait])
                        c.spans.append([f"wire[{seq}]", res.write_start, res.write_end])
        elif room is not None and room.notices:
            decode_id, kind = room.notices.popleft()
            c = room.consumers.get(decode_id)
            if kind == "done" and c is not None and c.outcome is None:
                if res.error:
                    self._consumer_ended(room, c, res.error)
                else:
                    c.outcome = "ok"
                    self.stats.outcome("ok")
                    self.stats.tokens += room.limit
        if room is not None:
            room.progress = time.monotonic()

    # ------------------------------------------------------------------ endings
    def _consumer_ended(self, room: ScdRoom, c: _Consumer, reason: str, notify: bool = True) -> None:
        if c.outcome is not None:
            return
        c.outcome = reason
        self.stats.outcome("failed:" + reason.split(":")[0])
        logger.warning("SCD room %d, consumer %s: %s", room.room, c.claim.decode_id, reason)
        if notify:
            room.notices.append((c.claim.decode_id, "failed"))
            self.sender.submit(NoticeJob(room.room, c.claim.reply_to, KVFailed(room.room, reason)))

    def _check_room(self, room: ScdRoom, now: float) -> None:
        if room.closing is None:
            finished = [c for c in room.consumers.values() if c.outcome is not None]
            if room.prompt_done and len(finished) == self.fanout:
                self._close(room, f"served {self.fanout} consumer(s)", failed=False)
            elif now - room.progress > self.settings.timeout_s:
                if room.req is None:
                    self._close(room, "no request for the room")
                elif room.prompt_done:
                    self._close(room, f"fan-out timed out: {len(room.consumers)} of {self.fanout} consumer(s) "
                                      f"claimed, {len(finished)} finished")
        if room.closing is not None and not room.inflight and not room.notices:
            for seg in room.segments:
                self.send_alloc.free(seg.offset)
            room.segments = []
            self.rooms.pop(room.room, None)
            self.sender.cancelled.discard(room.room)
            self.closed[room.room] = (room.closing, time.monotonic() + self.settings.timeout_s)

    def _close(self, room: ScdRoom, reason: str, failed: bool = True) -> None:
        """No more writes or claims for the room; consumers not finished get KVFailed. Its
        send-buffer bytes are freed once the writes already queued have reported."""
        if room.closing is not None:
            return
        room.closing = reason
        self.rooms_closed[reason.split(":")[0] if failed else "served"] += 1
        if failed:
            logger.warning("SCD room %d closed: %s", room.room, reason)
            self.sender.cancelled.add(room.room)  # queued writes and KVDones must not go out
            for c in room.consumers.values():
                self._consumer_ended(room, c, reason)
        if room.req is not None and not room.prompt_done:
            room.req = None
