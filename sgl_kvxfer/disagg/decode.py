"""The scheduler's decode role: receive a request's prompt KV from its prefill, then decode it.

A request with a bootstrap room (and a real peer) does not enter the waiting queue; it becomes
a room here (disagg/base.py has the states):

    BOOTSTRAPPING      find the prefill (its bootstrap server, in a worker thread; retried until
                       the timeout: D may come before P registered), send KVRegister (the prefill
                       watches this decode from now on), take a staging region and a request
                       row (they may wait on the load), send KVClaim
    WAITING_FOR_INPUT  \\ each KVSegment: launch its block checksums over the staging region,
    TRANSFERRING       / allocate slots (a tiered pool: in each token's tier store), unpack; the
                       sums are read when their event is done (no host wait on the GPU), and a
                       segment is acked once its sums match and its unpack is done
    SUCCESS            KVDone with every segment in, unpacked and verified: the request joins the
                       running batch with its prompt KV and first token, its prefill skipped
    FAILED             bad checksum, KVFailed, no progress within --kv-transfer-timeout, prefill
                       unreachable (peers.py: seen within seconds of its death; a request for a
                       prefill already seen dead fails at once): everything the room held is
                       freed and the request is prefilled here instead (the client still gets
                       the right answer)

Input logprobs are the prefill's (the router prepends them): a PD request never reports its own.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from weakref import WeakKeyDictionary

import msgspec
import numpy as np
import torch

from sgl_kvxfer.disagg import create_transfer_engine
from sgl_kvxfer.disagg.base import KVPoll
from sgl_kvxfer.disagg.buffers import PendingChecksums, TransferBuffer
from sgl_kvxfer.disagg.common import FAKE_BOOTSTRAP_HOST, TransferStats, fetch_prefill_route
from sgl_kvxfer.disagg.peers import PeerMonitor
from sgl_kvxfer.disagg.prefill import TIER_KEEP
from sgl_kvxfer.disagg.role import PDRole
from sgl_kvxfer.disagg.staging import StagingAllocator
from sgl_kvxfer.disagg.trace import PhaseTrace, render
from sgl_kvxfer.forward_batch import ForwardMode
from sgl_kvxfer.mem_cache.kv_payload import unpack_segment
from sgl_kvxfer.message.disagg import (KVAck, KVCancel, KVClaim, KVDone, KVFailed, KVLayoutInfo, KVRegister,
                                      KVSegment)
from sgl_kvxfer.message.queue import PullQueue, PushQueue
from sgl_kvxfer.spectrum.tiers import TIER_DROP, TIER_FP16, TIER_INT4, TIER_INT8

logger = logging.getLogger(__name__)


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


class DecodeRole(PDRole):
    mode = "decode"
    peer_kind = "prefill"

    def __init__(self, settings, host: str):
        self.settings = settings
        self.host = host
        self.stats = TransferStats()
        self.rooms: dict[int, DecodeRoom] = {}
        self.ready: list = []  # transferred requests waiting for a running-batch seat
        self.traces = WeakKeyDictionary()  # --enable-pd-trace: req -> (prefill spans, room trace) until admitted
        self.first_steps = WeakKeyDictionary()  # req -> (admitted, t0) until its first decode step
        self.fake = settings.backend == "fake"

    def start(self, ctx) -> None:
        super().start(ctx)
        settings, host = self.settings, self.host
        self.kv, self.pool, self.table = ctx.kv, ctx.pool, ctx.table
        self.tiered = getattr(self.pool, "layout", "") == "tiered"
        if self.fake:
            return
        self.engine = create_transfer_engine(settings.backend, host, settings.rate_gbps, settings.latency_ms,
                                             settings.ib_device, settings.gpu_id)
        self.staging = TransferBuffer(settings.buffer_bytes, ctx.runner.device, self.engine.gpu_memory)
        self.engine.register(self.staging.data_ptr(), self.staging.numel())
        self.regions = StagingAllocator(self.staging.numel())
        # regions of failed rooms, freed only after a timeout: a prefill that has not seen the
        # cancel yet may still write into them (checksums would catch it, but only until unpack)
        self.quarantine: list[tuple[float, int]] = []
        self.inbox = PullQueue(f"tcp://{host}:*", "kv_decode", bind=True)
        self.decode_id = self.inbox.endpoint
        self.peers: dict[str, PushQueue] = {}
        self.lookups = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kv-bootstrap")
        self.routes: dict[tuple[str, int], dict] = {}  # (bootstrap host, port) -> its /route info
        self.monitor = PeerMonitor()  # the prefills' bootstrap servers of open rooms
        p = self.pool
        self.layout = KVLayoutInfo(str(p.dtype).replace("torch.", ""), sum(p.stores_layer(i) for i in range(p.num_layers)),
                                   p.num_kv_heads, p.head_dim, getattr(p, "group_size", 32))
        self.full_bytes = 2 * self.layout.num_layers * p.num_kv_heads * p.head_dim * (torch.finfo(p.dtype).bits // 8)
        logger.info("PD decode: KV receiver %s on %s (%s), endpoint %s, %d MiB staging in %s memory",
                    settings.backend, self.engine.session_id(), self.engine.describe(), self.decode_id,
                    settings.buffer_bytes >> 20, self.staging.location)

    # ------------------------------------------------------------------ scheduler hooks
    def takes(self, req) -> bool:
        """A request whose prompt KV comes from a prefill server (not a health check, not a
        fallback coming back through the queue)."""
        b = req.bootstrap
        return b is not None and b.host != FAKE_BOOTSTRAP_HOST

    def on_new_request(self, req) -> bool:
        """Take a PD request (True): its KV is received here, it never waits for a prefill."""
        if not self.takes(req):
            return False
        req.input_logprobs_done = True  # the prefill's input logprobs reach the client, not ours
        if req.sampling.max_new_tokens == 0:  # prefill-only: nothing to receive or compute here
            req.finish({"type": "length", "length": 0})
            self.ctx.retire(req)
        elif self.fake:
            self._admit_fake(req)
        else:
            room = self.rooms[req.bootstrap.room] = DecodeRoom(req.bootstrap.room, req)
            if self.settings.trace:
                room.trace = PhaseTrace()
                room.trace.add("arrival", time.time(), time.time())
            peer = self._peer(req.bootstrap)
            if self.monitor.is_dead(peer):  # the router has not noticed yet: no wait
                self._end(room, f"{self.peer_kind} unreachable: {peer[0]}:{peer[1]} ({self.monitor.describe(peer)})")
            else:
                room.route = self._lookup(req.bootstrap)
        return True

    def after_forward(self, batch) -> None:
        """--enable-pd-trace: a traced request's first decode step, added to its reply's trace."""
        if self.first_steps and batch.mode == ForwardMode.DECODE:
            for s in batch.slices:
                start, t0 = self.first_steps.pop(s.req, (None, None))
                if start is not None:
                    s.req.extra_meta["kv_transfer"]["trace"]["phases"].append(
                        ["d.first_step", round(1e3 * (start - t0), 3), round(1e3 * (time.time() - start), 3)])

    def wake_sockets(self) -> list:
        return [] if self.fake else [self.inbox]

    def abort(self, rid: str, abort_all: bool) -> None:
        for room in list(self.rooms.values()):
            if abort_all or room.req.rid == rid:
                room.req.finish({"type": "abort", "message": "Abort requested", "status_code": None, "err_type": None})
                self._end(room, "aborted", fallback=False)
                self.ctx.retire(room.req)
        for req in [r for r in self.ready if abort_all or r.rid == rid]:
            self.ready.remove(req)
            req.finish({"type": "abort", "message": "Abort requested", "status_code": None, "err_type": None})
            self.ctx.retire(req)

    def has_work(self) -> bool:
        return bool(self.rooms or self.ready)

    def poll(self) -> None:
        if not self.fake:
            for msg in self.inbox.get_all_nowait():
                room = self.rooms.get(msg.room)
                if room is not None:
                    self._on_message(room, msg)
            now = time.monotonic()
            self.check_peers(now)
            for room in list(self.rooms.values()):
                self._advance(room, now)
            while self.quarantine and self.quarantine[0][0] <= now:
                self.regions.free(self.quarantine.pop(0)[1])
        while self.ready and self.ctx.has_seat():
            req = self.ready.pop(0)
            spans = self.traces.pop(req, None)
            self.ctx.admit(req)  # radix insert, tier marks, then the first token queued
            if spans is not None:  # the critical path ends here; the queued output holds req.extra_meta
                self._close_trace(req, *spans)

    def server_info(self) -> dict:
        extra = {} if self.fake else {"staging_used_bytes": self.regions.used_bytes(), "endpoint": self.decode_id,
                                      "buffer": self.staging.location, **self.engine.describe()}
        return self.stats.to_dict(rooms_open=len(self.rooms), **extra)

    # ------------------------------------------------------------------ peer liveness (role.py)
    def _peer(self, b) -> tuple[str, int]:
        """A request's prefill: its bootstrap server's (host, port)."""
        return b.host, b.port if b.port is not None else self.settings.bootstrap_port

    def watched_peers(self) -> dict:
        return {p: f"{p[0]}:{p[1]}" for p in (self._peer(r.req.bootstrap) for r in self.rooms.values())}

    def on_peer_dead(self, peer, reason: str) -> None:
        """Rooms of a prefill that stopped answering fail now (local prefill), not at the end
        of --kv-transfer-timeout. Its remembered route goes too (a restarted prefill has another)."""
        self.routes.pop(peer, None)
        for room in [r for r in self.rooms.values() if self._peer(r.req.bootstrap) == peer]:
            self._end(room, reason)

    # ------------------------------------------------------------------ the room's steps
    def _lookup(self, b) -> Future:
        """The prefill's route: remembered from an earlier room of the same prefill (a prefill's
        route is fixed for its life), else asked of its bootstrap server in a worker thread."""
        key = self._peer(b)
        if key in self.routes:
            known = Future()
            known.set_result(self.routes[key])
            return known
        return self.lookups.submit(fetch_prefill_route, *key)

    def _advance(self, room: DecodeRoom, now: float) -> None:
        if room.state == KVPoll.BOOTSTRAPPING:
            self._bootstrap(room)
        if room.state in (KVPoll.WAITING_FOR_INPUT, KVPoll.TRANSFERRING):
            self._unpack_ready(room)
            complete = room.done is not None and room.unpacked == room.done.segments
            if complete and room.room in self.rooms:  # the first token waits on these kernels: wait here, not a poll later
                self._wait_room(room)
            if room.room in self.rooms and self._verify(room):
                self._ack_unpacked(room)
        if room.room not in self.rooms:
            return
        if room.state == KVPoll.TRANSFERRING and room.done is not None and room.unpacked == room.done.segments \
                and not room.unverified:
            self._succeed(room)
        elif room.room in self.rooms and now - room.progress > self.settings.timeout_s:
            self._end(room, "timeout" if room.state != KVPoll.BOOTSTRAPPING else "prefill unreachable")

    def _bootstrap(self, room: DecodeRoom) -> None:
        if room.route is not None:
            if not room.route.done():
                return
            try:
                info = room.route.result()
            except Exception as e:  # not up yet, or gone: ask again until the deadline
                logger.debug("bootstrap lookup for room %d: %s", room.room, e)
                room.route = self._lookup(room.req.bootstrap) if time.monotonic() - room.created < self.settings.timeout_s else None
                return
            room.route = None
            if not self._check_route(room, info):
                return
            self.routes[self._peer(room.req.bootstrap)] = info
            room.endpoint = f"tcp://{info['rank_ip']}:{info['rank_port']}"
            # before staging is free: the prefill now knows this decode holds the room and
            # watches it (a decode that dies before claiming fails the room in seconds)
            self._push(room.endpoint, KVRegister(room.room, self.decode_id))
        if not room.endpoint:
            return
        n = len(room.req.origin_input_ids)
        want = min(self._region_bytes(n), self.regions.total // 2)
        region = self.regions.alloc(want)
        if region is None or not self.kv.admit_external(room.req):
            if region is not None:
                self.regions.free(region)
            return  # staging or request rows are busy: try again next poll
        room.region, room.region_bytes = region, want
        room.state, room.progress, room.claimed_at = KVPoll.WAITING_FOR_INPUT, time.monotonic(), time.monotonic()
        self._push(room.endpoint, KVClaim(room.room, self.decode_id, self.decode_id, self.engine.session_id(),
                                          self.staging.data_ptr() + region, want, n, self.layout,
                                          scd=self._scd_claim()))
        if room.trace is not None:
            room.trace.add("bootstrap", room.trace.start_of("arrival"))

    def _check_route(self, room: DecodeRoom, info: dict) -> bool:
        """Whether the prefill's KV fits this server; False when the room ended here."""
        if info.get("scd"):
            self._reject(room, f"the prefill at {room.req.bootstrap.host} ships SCD codes (artifacts "
                               f"{info['scd'].get('manifest_id', '?')[:12]}); this decode server has no "
                               "--scd-artifacts to rebuild KV from them")
            return False
        layout = info.get("kv_layout_info")
        if layout is not None and msgspec.convert(layout, KVLayoutInfo) != self.layout:
            self._end(room, f"incompatible KV layout: prefill {layout}, decode {self.layout}")
            return False
        return True

    def _region_bytes(self, prompt_len: int) -> int:
        """Staging bytes a room asks for: the whole prompt's KV (the ring then never waits)."""
        return self.full_bytes * prompt_len + (1 << 16)

    def _scd_claim(self):
        return None  # an SCD consumer names its artifacts (scd_decode.py)

    def _on_message(self, room: DecodeRoom, msg) -> None:
        room.progress = time.monotonic()
        if isinstance(msg, KVSegment):
            room.segments[msg.seq] = msg
            room.state = KVPoll.TRANSFERRING
        elif isinstance(msg, KVDone):
            room.done, room.state = msg, KVPoll.TRANSFERRING
        elif isinstance(msg, KVFailed):
            self._end(room, "prefill failed: " + msg.reason, notify=False)

    def _unpack_ready(self, room: DecodeRoom) -> None:
        """Launch each arrived segment's checksums, then its unpack, in seq order.
        NOTE: a segment is unpacked before its sums are read. Its KV is in slots of a request
        no decode step sees until `_succeed` (every sum compared first); a mismatch ends the
        room (`_verify`), which frees those slots. Kernels still queued on them run before any
        kernel of a later owner (one stream)."""
        while room.unpacked in room.segments:
            seg = room.segments[room.unpacked]
            t0 = time.time()
            payload = self.staging[room.region + seg.offset:room.region + seg.offset + seg.nbytes]
            if seg.seq not in room.unverified:  # launched once: a retry (no KV room) reuses it
                room.unverified[seg.seq] = (PendingChecksums(payload, seg.checksum_kind, seg.block_bytes),
                                            seg.checksums)
            if not self._write_segment(room.req, seg, payload):
                return  # no KV room yet (retried next poll; the prefill waits for the ack), or failed
            del room.segments[room.unpacked]
            room.unpacked += 1
            room.wire_bytes += seg.nbytes
            self.stats.moved(seg.nbytes)
            event = None
            if self.staging.on_device:  # NOTE: the unpack kernels still read the staging bytes
                event = torch.cuda.Event()
                event.record()
            room.acks.append((seg.seq, event))  # host staging: copied out of host memory already
            if room.trace is not None:
                room.trace.add(f"unpack[{seg.seq}]", t0)

    def _verify(self, room: DecodeRoom) -> bool:
        """Compare the sums whose event is done, in seq order (no wait). False: a mismatch
        ended the room (the request is prefilled here; nothing it received is read)."""
        while room.unverified:
            seq, (pending, want) = next(iter(room.unverified.items()))
            if not pending.ready():
                return True
            bad = pending.first_bad(want)
            if bad is not None:
                self._end(room, f"checksum mismatch in segment {seq} block {bad}")
                return False
            del room.unverified[seq]
        return True

    def _wait_room(self, room: DecodeRoom) -> None:
        """Every segment is in: wait for its sums, then its unpack kernels, each a trace span.
        The sums' events precede the unpack's on the stream, so the second wait is the rest."""
        if room.unverified:
            t0 = time.time()
            next(reversed(room.unverified.values()))[0].wait()
            if room.trace is not None:
                room.trace.add("checksum_wait", t0)
        if room.acks and room.acks[-1][1] is not None:
            t0 = time.time()
            room.acks[-1][1].synchronize()
            if room.trace is not None:
                room.trace.add("unpack_wait", t0)

    def _ack_unpacked(self, room: DecodeRoom) -> None:
        """Ack segments whose sums matched and whose unpack kernels are done: only then may the
        prefill write over their ring bytes (and the room's region go back, at success)."""
        while room.acks and room.acks[0][0] not in room.unverified and \
                (room.acks[0][1] is None or room.acks[0][1].query()):
            self._push(room.endpoint, KVAck(room.room, self.decode_id, room.acks.popleft()[0]))

    def _write_segment(self, req, seg: KVSegment, payload: torch.Tensor) -> bool:
        """Allocate slots for the segment's positions, unpack, update the row. False: no room."""
        n = seg.end - seg.start
        tiers = torch.zeros(n, dtype=torch.int16) if seg.tiers is None else \
            torch.from_numpy(np.frombuffer(seg.tiers, dtype=np.uint8).astype(np.int16))
        if bool((tiers == TIER_DROP).any()) and not self.pool.drops_tokens:
            self._end(self.rooms[req.bootstrap.room], "the payload drops tokens; a decode pool that masks "
                      "dropped tokens is tiered (--kv-tier-budget < 1)")
            return False
        if not seg.replaces and seg.start != req.kv_len:
            # the row's positions must be written in order from 0: a hole would be decoded
            # from whatever slot ids the row held before (and freed twice by release)
            self._end(self.rooms[req.bootstrap.room],
                      f"KV for positions [{seg.start}, {seg.end}) does not continue [0, {req.kv_len})")
            return False
        change = tiers != TIER_KEEP
        row = req.req_pool_idx
        old = self.table.read(row, seg.end, start=seg.start).clone()
        new = self._alloc_positions(req, seg, tiers, change)
        if new is None:
            return False
        live = change & (tiers != TIER_DROP)
        by_tier = tuple(new[(live & (tiers == t)).to(new.device)] for t in (TIER_FP16, TIER_INT8, TIER_INT4))
        unpack_segment(self.pool, payload, seg.lens, by_tier)
        row_slots = torch.where(change.to(old.device), new.to(old.device), old)
        self.table.write(row, seg.start, row_slots)
        req.kv_len = max(req.kv_len, seg.end)  # positions [0, kv_len) hold slots (release frees them)
        if seg.replaces and self.tiered:  # the streamed int8 copies of replaced tokens
            self.kv.allocator.free(old[change.to(old.device) & (old != 0)])
            # what stays of a streamed int8 page may now start past its slot 0: relocate it
            # (prefix-fill invariant, mem_cache/tiered_allocator.py)
            self.table.write(row, seg.start, self.kv.allocator.repack(row_slots, self.kv.make_room_tier))
        return True

    def _alloc_positions(self, req, seg, tiers, change) -> torch.Tensor | None:
        """New slot per changed position (0 for a drop); None when the pool has no room.
        Tiered pool: each tier's positions in position order, one alloc_tier call per tier (the
        int stores fill fresh pages in that order: the prefix-fill invariant)."""
        n = seg.end - seg.start
        out = torch.zeros(n, dtype=torch.int64, device=self.table.table.device)
        if not self.tiered:
            if seg.replaces:  # overwrite in place: same slots, new values
                return self.table.read(req.req_pool_idx, seg.end, start=seg.start).clone()
            slots = self.kv.alloc([req], [n], [seg.start])
            return slots
        alloc = self.kv.allocator
        for t in (TIER_FP16, TIER_INT8, TIER_INT4):
            idx = (change & (tiers == t)).nonzero().squeeze(1)
            if not idx.numel():
                continue
            if t == TIER_FP16:
                if not self.kv.make_room(idx.numel()):
                    alloc.free(out[out != 0])
                    return None
                got = alloc.alloc(idx.numel())
            else:
                got = alloc.alloc_tier(t, idx.numel())
                short = idx.numel() - got.numel()
                if short and self.kv.make_room(short):  # the rest lands in fp16 (dequantized)
                    got = torch.cat([got, alloc.alloc(short)])
                if got.numel() < idx.numel():
                    alloc.free(torch.cat([out[out != 0], got]))
                    return None
            out[idx.to(out.device)] = got.to(out.device)
        return out

    # ------------------------------------------------------------------ endings
    def _succeed(self, room: DecodeRoom) -> None:
        req, done = room.req, room.done
        n = len(req.origin_input_ids)
        if req.kv_len != n:
            self._end(room, f"the prefill's KV covered {req.kv_len} of the prompt's {n} positions")
            return
        req.output_ids.append(done.first_token)
        req.cached_tokens = done.cached_tokens
        if req.return_logprob and done.output_token_logprob is not None:
            req.output_token_logprobs.append(done.output_token_logprob)
            req.output_top_logprobs.extend(done.output_top_logprobs or [])
            req.output_token_ids_logprobs.extend(done.output_token_ids_logprobs or [])
        seconds = time.monotonic() - room.claimed_at
        req.extra_meta = {"kv_transfer": {
            "status": "ok", "bytes": room.wire_bytes, "bytes_per_token": room.wire_bytes / n, "segments": room.unpacked,
            "transfer_ms": 1e3 * seconds,  # claim -> every segment unpacked (includes the prefill's compute)
            "wire_ms": 1e3 * done.wire_seconds,  # the link's busy time for this room
            "tail_ms": 1e3 * done.tail_seconds,  # prompt done -> last write: what the prefill did not hide
            "link_gbps": room.wire_bytes * 8 / done.wire_seconds / 1e9 if done.wire_seconds else 0.0}}
        self.stats.outcome("ok")
        self.stats.tokens += n
        self._release_room(room)
        if room.trace is not None:
            room.trace.add("done", time.time(), time.time())
            self.traces[req] = (done.trace or [], room.trace)
        self.ready.append(req)

    def _close_trace(self, req, prefill: list, trace: PhaseTrace) -> None:
        """Render the trace into the reply: the first token is queued now."""
        now = time.time()
        trace.add("admit", trace.start_of("done"), now)
        arrivals = [t for t in (trace.start_of("arrival"), next((s for n, s, _ in prefill if n == "arrival"), None))
                    if t is not None]
        spans = [x for x in trace.spans if x[0] not in ("arrival", "done")]
        req.extra_meta["kv_transfer"]["trace"] = render([x for x in prefill if x[0] != "arrival"], spans, arrivals, now)
        self.first_steps[req] = (now, min(arrivals))

    def _end(self, room: DecodeRoom, reason: str, fallback: bool = True, notify: bool = True) -> None:
        """Fail the room: free what it holds; the request is prefilled here (or was aborted)."""
        logger.warning("PD room %d: %s%s", room.room, reason, "; prefilling locally" if fallback else "")
        self.routes.pop(self._peer(room.req.bootstrap), None)  # ask that prefill afresh next time
        if notify and room.endpoint and room.region is not None:
            self._push(room.endpoint, KVCancel(room.room, self.decode_id, reason))
        req = room.req
        self.kv.release(req)
        req.output_ids.clear()
        if room.region is not None and room.claimed_at:  # the prefill knows this region
            if self.monitor.is_dead(self._peer(room.req.bootstrap)):  # a dead prefill writes nothing late
                self.regions.free(room.region)
            else:
                self.quarantine.append((time.monotonic() + self.settings.timeout_s, room.region))
            room.region = None
        self._release_room(room)
        if fallback:
            self.stats.outcome("fallback:" + reason.split(":")[0].split(" in ")[0])
            req.extra_meta = {"kv_transfer": {"status": "fallback: " + reason}}
            self.ctx.requeue(req)

    def _reject(self, room: DecodeRoom, reason: str) -> None:
        """A prefill this server cannot take KV from (not a transfer fault): the request fails
        with 400 and the reason; no local prefill hides a misconfigured pair."""
        req = room.req
        self._end(room, reason, fallback=False)
        self.stats.outcome("rejected")
        req.finish({"type": "abort", "message": reason, "status_code": 400, "err_type": "BadRequestError"})
        self.ctx.retire(req)

    def _release_room(self, room: DecodeRoom) -> None:
        self.rooms.pop(room.room, None)
        if room.region is not None:
            self.regions.free(room.region)
            room.region = None
        if room.route is not None:
            room.route.cancel()

    def _push(self, endpoint: str, msg) -> None:
        sock = self.peers.get(endpoint)
        if sock is None:
            sock = self.peers[endpoint] = PushQueue(endpoint)
        sock.put(msg)

    def _admit_fake(self, req) -> None:
        """SGLang's fake backend: the prompt's KV slots are allocated and left unwritten, and the
        first token is a placeholder (the last prompt token); outputs are meaningless."""
        n = len(req.origin_input_ids)
        if not self.kv.admit_external(req):
            self.ctx.requeue(req)
            return
        slots = self.kv.alloc([req], [n], [0])
        if slots is None:
            self.kv.release(req)
            self.ctx.requeue(req)
            return
        self.table.write(req.req_pool_idx, 0, slots)
        req.kv_len = n
        req.output_ids.append(req.origin_input_ids[-1])
        self.ready.append(req)

    def close(self) -> None:
        super().close()
        if not self.fake:
            self.lookups.shutdown(wait=False, cancel_futures=True)
            self.inbox.close()
            for sock in self.peers.values():
                sock.close()
