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

The role class lives here with the room's bootstrap and its steps; its parts are mixins in their
own files, and imports point one way (decode.py -> the parts -> decode_room.py):

    decode_room.py       DecodeRoom
    decode_receive.py    segments in: checksums launched (PendingChecksums), unpack, sums, acks
    decode_unpack.py     slots per tier, the row written, the request made ready (admission)
    decode_fallback.py   a failed room: freed, its region quarantined, the request prefilled here
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from weakref import WeakKeyDictionary

import msgspec
import torch

from sgl_kvxfer.disagg import create_transfer_engine
from sgl_kvxfer.disagg.base import KVPoll
from sgl_kvxfer.disagg.buffers import TransferBuffer
from sgl_kvxfer.disagg.common import FAKE_BOOTSTRAP_HOST, TransferStats, fetch_prefill_route
from sgl_kvxfer.disagg.decode_fallback import DecodeFallback
from sgl_kvxfer.disagg.decode_receive import DecodeReceive
from sgl_kvxfer.disagg.decode_room import DecodeRoom
from sgl_kvxfer.disagg.decode_unpack import DecodeUnpack
from sgl_kvxfer.disagg.peers import PeerMonitor
from sgl_kvxfer.disagg.role import PDRole
from sgl_kvxfer.disagg.staging import StagingAllocator
from sgl_kvxfer.disagg.trace import PhaseTrace
from sgl_kvxfer.forward_batch import ForwardMode
from sgl_kvxfer.message.disagg import KVClaim, KVLayoutInfo, KVRegister
from sgl_kvxfer.message.queue import PullQueue, PushQueue

logger = logging.getLogger(__name__)




class DecodeRole(DecodeReceive, DecodeUnpack, DecodeFallback, PDRole):
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

    # ------------------------------------------------------------------ messages out
    def _push(self, endpoint: str, msg) -> None:
        sock = self.peers.get(endpoint)
        if sock is None:
            sock = self.peers[endpoint] = PushQueue(endpoint)
        sock.put(msg)

    def close(self) -> None:
        super().close()
        if not self.fake:
            self.lookups.shutdown(wait=False, cancel_futures=True)
            self.inbox.close()
            for sock in self.peers.values():
                sock.close()
