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

The role class lives here with the hooks above; its parts are mixins in their own files, and
imports point one way (prefill.py -> the parts -> prefill_room.py):

    prefill_room.py      PrefillRoom, the ranges it queues, TIER_KEEP and the stream names
    prefill_send.py      decode messages in, packs / writes / KVDone out, the writes' results
    prefill_chunks.py    chunk streams: untiered chunks and chunk tiers, side-stream packs, final tiers
    prefill_endings.py   aborts, a dead decode, deadlines, failure and finish
"""
from __future__ import annotations

import logging
import time

import msgspec
import torch

from sgl_kvxfer import env
from sgl_kvxfer.disagg import create_transfer_engine
from sgl_kvxfer.disagg.base import KVPoll
from sgl_kvxfer.disagg.buffers import TransferBuffer
from sgl_kvxfer.disagg.common import FAKE_BOOTSTRAP_HOST, Fault, TransferStats, register_prefill_rank
from sgl_kvxfer.disagg.pack_stream import PackStream, leave_legacy_stream
from sgl_kvxfer.disagg.peers import PeerMonitor
from sgl_kvxfer.disagg.prefill_chunks import PrefillChunkStream
from sgl_kvxfer.disagg.prefill_endings import PrefillEndings
# re-exported: tests, benchmarks and the decode side import the room and its constants from here too
from sgl_kvxfer.disagg.prefill_room import CHUNK_STREAMS, STREAMS, TIER_KEEP, PrefillRoom, _Range  # noqa: F401
from sgl_kvxfer.disagg.prefill_send import PrefillSender
from sgl_kvxfer.disagg.role import PDRole
from sgl_kvxfer.disagg.sender import SenderThread
from sgl_kvxfer.disagg.shaped import ShapedTransferEngine
from sgl_kvxfer.disagg.staging import StagingAllocator
from sgl_kvxfer.disagg.trace import GCPauses, PhaseTrace
from sgl_kvxfer.forward_batch import ForwardMode
from sgl_kvxfer.message.disagg import KVLayoutInfo
from sgl_kvxfer.message.queue import PullQueue, WakeChannel

logger = logging.getLogger(__name__)


class PrefillRole(PrefillChunkStream, PrefillSender, PrefillEndings, PDRole):
    mode = "prefill"
    intercepts_prefill = True
    peer_kind = "decode"
    packs: PackStream | None = None  # the side stream of chunk packs (CUDA only)

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
        self.packs = PackStream.create(self.device)
        self.engine = create_transfer_engine(settings.backend, host, settings.rate_gbps, settings.latency_ms,
                                             settings.ib_device, settings.gpu_id)
        self.buffer = TransferBuffer(settings.buffer_bytes, self.device, self.engine.gpu_memory)
        self.engine.register(self.buffer.data_ptr(), self.buffer.numel())
        self.own_stream = self.buffer.on_device and leave_legacy_stream(self.device, env.PD_COMPUTE_STREAM.get())
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
        if self.own_stream:
            logger.info("PD prefill: the model runs on its own CUDA stream (KV copies do not wait for it)")

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
            if self.tiered:
                room.pending.extend(_Range(a, b, "stored") for a, b in zip(bounds, bounds[1:]))
            else:  # the last chunk, on the side stream after its kernels (prefill_chunks.py)
                room.pending.append(self._stored_range(room, room.streamed, n))
            room.streamed = n
        room.prompt_done, room.prompt_done_at = True, time.monotonic()
        if room.state == KVPoll.BOOTSTRAPPING and room.claim is not None:
            room.state = KVPoll.TRANSFERRING
        if room.error:
            self._finish(room)
        elif not self.tiered:
            self._pump(room)  # the last chunk's pack and write start now, not at the next poll
        return True

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

    # ------------------------------------------------------------------ rooms
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

    def _room_of(self, req):
        if not self.transfers(req):
            return None
        room = self.rooms.get(req.bootstrap.room)
        return room if room is not None and room.req is req else None

    # ------------------------------------------------------------------ link control
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
