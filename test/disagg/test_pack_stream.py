"""The prefill role's side stream for chunk-stream packs (disagg/pack_stream.py): on CPU, with a
stand-in for torch.cuda's stream API, which chunks get an event at launch, which ranges pack on
the side stream (after which event), and where the compute stream joins it; on a GPU, a pack on
the side stream runs beside a long kernel on the compute stream, gives a compute-stream pack's
bytes, and a re-tier after the role's hook cannot change what it read; through a scheduler,
the real role's segments are byte for byte those of compute-stream packs."""
from __future__ import annotations

from contextlib import contextmanager
from types import SimpleNamespace as NS

import pytest
import torch

from sgl_kvxfer.disagg.pack_stream import PackStream


class FakeCuda:
    """torch.cuda's stream API as PackStream uses it; every call is logged as (stream, what, arg)."""

    def __init__(self):
        self.log, self.current = [], "main"
        fake = self

        class Stream:
            def __init__(self, device=None, priority=0, name="side"):
                self.name = name

            def wait_event(self, ev):
                fake.log.append((self.name, "wait_event", ev.id))

            def wait_stream(self, other):
                fake.log.append((self.name, "wait_stream", other.name))

        class Event:
            count = 0

            def __init__(self):
                Event.count += 1
                self.id = Event.count

            def record(self):
                fake.log.append((fake.current, "record", self.id))

        self.Stream, self.Event = Stream, Event

    @contextmanager
    def stream(self, s):
        prev, self.current = self.current, s.name
        try:
            yield
        finally:
            self.current = prev

    def current_stream(self):
        return self.Stream(name=self.current)


class Buffer:
    on_device = False

    def __init__(self, n):
        self.data = torch.zeros(n, dtype=torch.uint8)

    def __getitem__(self, key):
        return self.data[key]


def make_role(monkeypatch, device="cuda:0"):
    """A PrefillRole with no engine: rooms by request, a stand-in tiering, buffers and sender."""
    from sgl_kvxfer.disagg import prefill_send
    from sgl_kvxfer.disagg.prefill import PrefillRole
    from sgl_kvxfer.disagg.staging import StagingAllocator

    role = object.__new__(PrefillRole)
    fake = FakeCuda()
    role.device, role.settings, role.tiered, role.fake, role.pool = device, NS(trace=False), True, False, None
    role.packs = PackStream(device, cuda=fake) if device.startswith("cuda") else None
    role.rooms_by_req = {}
    monkeypatch.setattr(role, "_room_of", lambda req: role.rooms_by_req.get(id(req)))
    role.tiering = NS(chunk_tiers=lambda req, a, b, with_slots: (torch.full((b - a,), 1, dtype=torch.int8),
                                                                  torch.arange(a, b)))
    role.send_alloc, role.buffer = StagingAllocator(1 << 16), Buffer(1 << 16)
    role.jobs, role.packed = [], []
    role.sender = NS(submit=role.jobs.append, cancelled=set())
    monkeypatch.setattr(prefill_send, "segment_layout", lambda pool, counts: NS(total_bytes=64, lens=counts))
    monkeypatch.setattr(prefill_send, "pack_segment",
                        lambda pool, slots, tiers, out: role.packed.append((fake.current, slots.tolist())))
    return role, fake


def open_room(role, stream, n, claimed=False):
    from sgl_kvxfer.disagg.prefill import PrefillRoom
    from sgl_kvxfer.disagg.staging import RingWriter

    req = NS(origin_input_ids=list(range(n)), seq_len=n)
    room = PrefillRoom(len(role.rooms_by_req) + 1, req=req, stream=stream)
    if claimed:
        room.claim, room.ring = NS(session="s", region_addr=0, reply_to="r"), RingWriter(1 << 16)
    role.rooms_by_req[id(req)] = room
    return req, room


def test_only_a_cuda_tiered_chunk_stream_marks_its_chunks(monkeypatch):
    role, fake = make_role(monkeypatch)
    a, room_a = open_room(role, "chunk", 48)
    up, room_up = open_room(role, "chunk-upgrade", 48)
    last, room_last = open_room(role, "chunk", 32)
    end, room_end = open_room(role, "end", 48)
    i8, room_i8 = open_room(role, "int8", 48)
    batch = NS(slices=[NS(req=a, start=0, length=16), NS(req=up, start=16, length=16),
                       NS(req=last, start=16, length=16), NS(req=end, start=0, length=16),
                       NS(req=i8, start=0, length=16)])
    role.after_launch(batch)
    assert [x for x in fake.log if x[1] == "record"] == [("main", "record", 1)]  # one event, on the compute stream
    assert list(room_a.chunk_marks) == [16] and list(room_up.chunk_marks) == [32]
    assert not room_last.chunk_marks and not room_end.chunk_marks and not room_i8.chunk_marks  # the last chunk too

    cpu, fake_cpu = make_role(monkeypatch, device="cpu")
    a, room_a = open_room(cpu, "chunk", 48)
    cpu.after_launch(NS(slices=[NS(req=a, start=0, length=16)]))
    assert cpu.packs is None and PackStream.create("cpu") is None
    assert not room_a.chunk_marks and not fake_cpu.log  # CPU: no stream, no event
    cpu.on_chunk(a, 0, 16)
    assert room_a.pending[0].after is None


def test_a_chunk_packs_on_the_side_stream_after_its_own_event(monkeypatch):
    role, fake = make_role(monkeypatch)
    req, room = open_room(role, "chunk", 48, claimed=True)
    role.after_launch(NS(slices=[NS(req=req, start=0, length=16)]))  # chunk 0
    role.after_launch(NS(slices=[NS(req=req, start=16, length=16)]))  # chunk 1 launched before 0 is applied
    role.on_chunk(req, 0, 16)  # chunk 0 applied: packed now
    assert role.packed == [("side", list(range(16)))] and len(role.jobs) == 1
    assert fake.log[-1] == ("side", "wait_event", 1)  # chunk 0's event, not chunk 1's
    assert list(room.chunk_marks) == [32] and role.packs.dirty
    role.on_chunk(req, 16, 32)
    assert role.packed[-1] == ("side", list(range(16, 32))) and fake.log[-1] == ("side", "wait_event", 2)
    # a split range keeps its chunk's event; a range with none packs on the compute stream
    from sgl_kvxfer.disagg.prefill import _Range

    head, tail = _Range(0, 8, "chunk", torch.zeros(8), torch.arange(8), after="ev").split()
    assert head.after == tail.after == "ev"
    room.pending.append(_Range(32, 48, "chunk", torch.zeros(16, dtype=torch.int8), torch.arange(32, 48)))
    role._pump(room)
    assert role.packed[-1] == ("main", list(range(32, 48)))


def test_the_final_retier_and_the_endings_wait_for_the_side_stream(monkeypatch):
    role, fake = make_role(monkeypatch)
    req, room = open_room(role, "chunk", 48, claimed=True)
    role.after_launch(NS(slices=[NS(req=req, start=0, length=16)]))
    role.on_chunk(req, 0, 16)
    joins = lambda: [x for x in fake.log if x[1] == "wait_stream"]  # noqa: E731
    assert not joins()
    # the prompt's end: the hook packs the rest (on the compute stream), then the compute stream
    # joins the side stream before the re-tier that follows the hook moves and frees the rows
    role._on_final_tiers(req, 0, torch.arange(48), torch.ones(48, dtype=torch.int8))
    assert role.packed[-1] == ("main", list(range(16, 48)))
    assert joins() == [("main", "wait_stream", "side")] and not role.packs.dirty
    # a hook for a room that packs nothing still joins (after any side work since the last join)
    role.packs.dirty = True
    monkeypatch.setattr(role, "_room_of", lambda req: None)
    role._on_final_tiers(req, 0, torch.arange(48), torch.ones(48, dtype=torch.int8))
    assert len(joins()) == 2
    role._on_final_tiers(req, 0, torch.arange(48), torch.ones(48, dtype=torch.int8))
    assert len(joins()) == 2  # nothing launched since: no join
    # a failed room (an abort frees the request's KV next)
    role.packs.dirty = True
    room.req = None
    role.rooms, role.ended, role.settings = {room.room: room}, {}, NS(trace=False, timeout_s=1.0)
    role.stats = NS(outcome=lambda _: None)
    role._fail(room, "aborted")
    assert len(joins()) == 3
    # each poll's end: the step's forward and frees come after the packs launched so far
    role.packs.dirty = True
    role.wake, role.inbox, role.monitor = NS(drain=lambda: None), NS(get_all_nowait=lambda: []), None
    role.sender.drain = lambda: []
    role.poll()
    assert len(joins()) == 4


def test_an_untiered_pool_packs_every_chunk_on_the_side_stream_from_its_row_snapshot(monkeypatch):
    """fp16 KV (no tiering): every chunk, the prompt's last one too, gets an event and a snapshot
    of its row at launch; its range carries the snapshot's slot ids and packs on the side stream
    after its own chunk's event (the scheduler thread reads nothing back from the stream)."""
    role, fake = make_role(monkeypatch)
    role.tiered = False
    rows = {0: torch.arange(100, 148)}  # the request-to-token row of req_pool_idx 0
    reads = []

    def read(idx, end, start=0):
        reads.append((idx, start, end))
        return rows[idx][start:end]

    role.table = NS(read=read)
    monkeypatch.setattr("sgl_kvxfer.disagg.prefill_send.wire_tier_of",
                        lambda pool, slots: torch.zeros(slots.numel(), dtype=torch.int8))
    req, room = open_room(role, "end", 48, claimed=True)
    req.req_pool_idx = 0
    for start in (0, 16, 32):
        role.after_launch(NS(slices=[NS(req=req, start=start, length=16)]))
    assert list(room.chunk_marks) == list(room.chunk_rows) == [16, 32, 48]  # the last chunk too
    assert reads == [(0, 0, 16), (0, 0, 32), (0, 0, 48)]
    role.on_chunk(req, 0, 16)
    role.on_chunk(req, 16, 32)
    assert role.packed == [("side", list(range(100, 116))), ("side", list(range(116, 132)))]
    assert [x for x in fake.log if x[1] == "wait_event"] == [("side", "wait_event", 1), ("side", "wait_event", 2)]
    role.pool = NS()
    role.on_prompt_done(req)  # the last chunk: as stored, after its own event
    assert role.packed[-1] == ("side", list(range(132, 148))) and fake.log[-1] == ("side", "wait_event", 3)
    assert len(reads) == 3 and not room.chunk_rows and not room.chunk_marks  # no read-back at the pack
    # a chunk launched with no snapshot (none taken: e.g. the role started mid-prompt) reads the row
    req2, room2 = open_room(role, "end", 32, claimed=True)
    req2.req_pool_idx = 0
    role.on_chunk(req2, 0, 16)
    assert role.packed[-1] == ("main", list(range(100, 116))) and reads[-1] == (0, 0, 16)


@pytest.mark.gpu
def test_side_stream_pack_runs_beside_the_next_chunk_and_the_retier_waits_for_it():
    """On a GPU: the pack of chunk k, on the side stream after chunk k's event, finishes while a
    long kernel ("chunk k + 1") still runs on the compute stream, with the bytes and checksums of
    a compute-stream pack; then, behind a long "chunk k" so the pack cannot have started, the
    role's final-tiers hook joins, and a rewrite of the rows the pack reads and the re-tier that
    follow on the compute stream leave the side pack's bytes equal to the reference."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from sgl_kvxfer.disagg.buffers import wsum64_async, wsum64_values
    from sgl_kvxfer.disagg.prefill import PrefillRole
    from sgl_kvxfer.mem_cache.kv_payload import pack_segment, segment_layout, tier_counts
    from sgl_kvxfer.mem_cache.tier_plan import TierStorePlan
    from sgl_kvxfer.mem_cache.tiered_allocator import TieredSlotAllocator
    from sgl_kvxfer.mem_cache.tiered_pool import TieredKVPool

    L, H, D, N = 4, 2, 64, 96
    pool = TieredKVPool(256, L, H, D, torch.float16, "cuda", TierStorePlan(160, 128, 128), group_size=32, page_size=8)
    alloc = TieredSlotAllocator(pool, "cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    slots = alloc.alloc(N)
    for layer in range(L):
        k, v = (torch.randn(N, H, D, device="cuda", dtype=torch.float16, generator=gen) for _ in range(2))
        pool.set_kv(layer, slots, k, v)
    host = slots.cpu()
    wire = torch.tensor([0, 1, 2, 1, 2, 2], dtype=torch.int8).repeat(N // 6)  # fp16 / int8 / int4 on the wire
    lay = segment_layout(pool, tier_counts(wire))
    ref = torch.zeros(lay.total_bytes, dtype=torch.uint8, device="cuda")
    pack_segment(pool, host, wire, ref)
    ref_sums, ev = wsum64_async(ref)
    ev.synchronize()
    # warm the side stream's kernels (compiles, allocator pools) outside the timed window
    packs = PackStream("cuda")
    with packs.after(packs.mark()):
        pack_segment(pool, host, wire, torch.empty_like(ref))
    packs.join()
    torch.cuda.synchronize()

    out = torch.zeros_like(ref)
    torch.cuda._sleep(100_000_000)  # "chunk k"
    mark = packs.mark()
    torch.cuda._sleep(2_000_000_000)  # "chunk k + 1", about a second, already queued
    busy = torch.cuda.Event()
    busy.record()
    with packs.after(mark):
        pack_segment(pool, host, wire, out)
        sums, ready = wsum64_async(out)
    ready.synchronize()
    assert not busy.query()  # the pack did not queue behind "chunk k + 1"
    assert torch.equal(out, ref) and wsum64_values(sums) == wsum64_values(ref_sums)
    torch.cuda.synchronize()

    role = object.__new__(PrefillRole)
    role.packs = packs
    role._room_of = lambda req: None  # (no room: the hook only joins)
    out.zero_()
    torch.cuda._sleep(1_000_000_000)  # a long "chunk k": the side pack cannot start before it ends
    mark = packs.mark()
    with packs.after(mark):
        pack_segment(pool, host, wire, out)
        sums, ready = wsum64_async(out)
    role._on_final_tiers(None, 0, host, wire)  # as EngineTiering._retier calls it, before the move
    for rows in pool.stacked_rows():  # the rows the pack reads, rewritten on the compute stream
        rows.index_fill_(1, slots, 0)
    assert not ready.query()  # queued before the pack ran: without the join it would race the pack
    new, _ = alloc.retier(host, wire)  # the re-tier's move and frees, on the compute stream too
    torch.cuda.synchronize()
    assert torch.equal(out, ref) and wsum64_values(sums) == wsum64_values(ref_sums)
    assert bool((new.cpu() != host)[wire != 0].all())  # the re-tier did move the int tokens


# ---------------------------------------------------------------- the role in a scheduler
@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from sgl_kvxfer.models.presets import write_dummy_tokenizer, write_preset_config

    d = str(tmp_path_factory.mktemp("tiny"))
    write_dummy_tokenizer(write_preset_config("tiny", d), 512)
    return d


def capturing_prefill(side: bool, tiered: bool = True):
    """The prefill role's chunk-stream path (or, untiered, its fp16 chunks) with the link cut
    off: a room per request, claimed at once with a ring that takes everything; each write job
    is kept, none reports."""
    from sgl_kvxfer.disagg.buffers import TransferBuffer
    from sgl_kvxfer.disagg.prefill import PrefillRole, PrefillRoom
    from sgl_kvxfer.disagg.role import PDRole
    from sgl_kvxfer.disagg.staging import RingWriter, StagingAllocator

    class CapturingPrefill(PrefillRole):
        def start(self, ctx):
            PDRole.start(self, ctx)
            self.pool, self.table, self.tiering, self.tiered = ctx.pool, ctx.table, ctx.tiering, tiered
            if tiered:
                ctx.tiering.final_tiers_hook = self._on_final_tiers
            self.device = ctx.runner.device
            self.packs = PackStream.create(self.device) if side else None
            self.buffer = TransferBuffer(1 << 22, str(self.device), True)
            self.send_alloc = StagingAllocator(self.buffer.numel())
            self.jobs, self.side_packs = [], 0
            self.sender = NS(submit=self.jobs.append, cancelled=set(), drain=lambda: [])
            self.wake, self.inbox, self.monitor = NS(drain=lambda: None), NS(get_all_nowait=lambda: []), None

        def transfers(self, req):
            return True

        def on_new_request(self, req):
            room = self.rooms[req.rid] = PrefillRoom(req.rid, req=req, stream="chunk")
            room.claim, room.ring = NS(session="s", region_addr=0, reply_to="r"), RingWriter(1 << 22)
            if tiered:
                self.tiering.rank_chunks(req)
            return False

        def _room_of(self, req):
            room = self.rooms.get(req.rid)
            return room if room is not None and room.req is req else None

        def has_work(self):
            return False  # (nothing reports: a finished prompt's room would wait forever)

    settings = NS(backend="capture", stream="chunk", trace=False, last_chunk=0, stream_chunk=0, claim_deadline_s=1e9,
                  timeout_s=1e9)
    role = CapturingPrefill(settings, "127.0.0.1")
    return role


def captured(role) -> list:
    """Each write job's (positions, tiers, tier counts, payload bytes, checksums), once packed."""
    from sgl_kvxfer.disagg.buffers import wsum64_values

    out = []
    for job in role.jobs:
        if job.ready is not None:
            job.ready.synchronize()
        seg = job.segment
        out.append(((seg.start, seg.end), seg.tiers, tuple(seg.lens), job.payload.cpu().clone(),
                    None if job.sums is None else wsum64_values(job.sums)))
    return out


@pytest.mark.parametrize("tiered", [True, False], ids=["tiered", "fp16"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a GPU")])])
def test_side_stream_chunk_packs_send_the_bytes_of_compute_stream_packs(tiny_dir, device, tiered):
    """A tiered chunk-stream prompt (or an fp16 one) through the scheduler with overlapped chunks
    (on a GPU) and the real role: its segments (each chunk's own, then the rest at the final
    tiers, packed before the re-tier; fp16: every chunk as stored, the last one too) carry the
    same positions, tiers and bytes whether chunk packs run on the side stream or on the compute
    stream (on CPU: no side stream either way)."""
    from sgl_kvxfer.config import EngineConfig, SchedulerConfig
    from sgl_kvxfer.message import TokenizedGenerateReq
    from sgl_kvxfer.sampling.params import SamplingParams
    from sgl_kvxfer.scheduler.scheduler import Scheduler
    from sgl_kvxfer.scheduler.startup import create_runner

    runs = []
    for side in (False, True):
        role = capturing_prefill(side, tiered)
        cfg = SchedulerConfig(engine=EngineConfig(model_path=tiny_dir, load_format="dummy", device=device,
                                                  max_total_tokens=2048, kv_tier_budget=0.3 if tiered else 1.0,
                                                  kv_int4="on" if tiered else "auto"),
                              chunked_prefill_size=16, max_running_requests=4)
        runner, _, _ = create_runner(cfg)
        sched = Scheduler(cfg, runner, None, role=role)
        assert sched.chunk_overlap == (device == "cuda" and tiered)  # (fp16 prefill overlaps by the plain rule)
        if role.packs is not None:  # count the packs that run on the side stream
            real_after = role.packs.after

            def after(event, role=role, real_after=real_after):
                role.side_packs += 1
                return real_after(event)

            role.packs.after = after
        sched.handle(TokenizedGenerateReq(rid="c", input_ids=[(7 * i) % 400 + 50 for i in range(60)],
                                          sampling=SamplingParams.from_dict({"max_new_tokens": 3, "temperature": 0,
                                                                             "ignore_eos": True})))
        for _ in range(50):
            sched.step()
            if role.rooms["c"].prompt_done:
                break
        runs.append((captured(role), role.side_packs))
    (plain, none), (sided, n_side) = runs
    # tiered: chunks [0, 16), [16, 32), [32, 48); fp16: [48, 60) too
    assert none == 0 and n_side == ((3 if tiered else 4) if device == "cuda" else 0)
    assert [p[0] for p in plain] == [(0, 16), (16, 32), (32, 48), (48, 60)]
    assert len(sided) == len(plain)
    for a, b in zip(plain, sided):
        assert a[:3] == b[:3] and torch.equal(a[3], b[3]) and a[4] == b[4], a[0]


def test_leave_legacy_stream_settings():
    from sgl_kvxfer.disagg.pack_stream import leave_legacy_stream

    assert not leave_legacy_stream("cpu", "auto") and not leave_legacy_stream("cuda:0", "0")
    with pytest.raises(ValueError, match="auto or 0"):
        leave_legacy_stream("cuda:0", "sometimes")


@pytest.mark.gpu
def test_a_legacy_stream_copy_waits_for_default_stream_work_and_not_for_our_stream():
    """The hazard leave_legacy_stream removes, on a GPU: a copy another thread issues on the
    legacy default stream (what Mooncake's NVLink transport does) waits for a long kernel on the
    default stream, and not for one on the stream leave_legacy_stream installs."""
    import threading

    from sgl_kvxfer.disagg.pack_stream import leave_legacy_stream

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    src = torch.ones(1 << 20, dtype=torch.uint8, device="cuda")
    dst = torch.zeros_like(src)

    def copy_took() -> bool:
        """Whether the other thread's legacy-stream copy finished while the kernel still runs."""
        busy = torch.cuda.Event()
        torch.cuda._sleep(1_500_000_000)  # about a second on the current stream
        busy.record()
        out = {}

        def legacy_copy():
            with torch.cuda.stream(torch.cuda.default_stream()):
                dst.copy_(src)
                torch.cuda.default_stream().synchronize()
            out["kernel_still_running"] = not busy.query()

        t = threading.Thread(target=legacy_copy)
        t.start()
        t.join()
        torch.cuda.synchronize()
        return out["kernel_still_running"]

    torch.cuda.synchronize()
    assert not copy_took()  # default stream: the copy waited for the kernel
    done = []
    t = threading.Thread(target=lambda: done.append((leave_legacy_stream("cuda", "auto"), copy_took())))
    t.start()
    t.join()
    assert done == [(True, True)]  # own stream: the copy ran beside it
    assert torch.equal(dst, src)
