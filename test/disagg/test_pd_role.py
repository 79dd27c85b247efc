"""PD roles without servers: the hooks the Scheduler calls (disagg/role.py) on a tiny CPU engine,
per-chunk tiers for the chunk streams, the upgrade pass, the phase trace, the link route's
validation, Mooncake's settings (HCA filter, environment), the loop's wake channel and the
prefill's view of its decodes (registration, claim deadline, a registered decode's death)."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from sgl_kvxfer.config import EngineConfig, SchedulerConfig, ServerArgs
from sgl_kvxfer.disagg.role import PDRole
from sgl_kvxfer.message import TokenizedGenerateReq
from sgl_kvxfer.sampling.params import SamplingParams


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from sgl_kvxfer.models.presets import write_dummy_tokenizer, write_preset_config

    d = str(tmp_path_factory.mktemp("tiny"))
    write_dummy_tokenizer(write_preset_config("tiny", d), 512)
    return d


def make_scheduler(tiny_dir, role, device="cpu", **engine):
    from sgl_kvxfer.scheduler.scheduler import Scheduler
    from sgl_kvxfer.scheduler.startup import create_runner

    cfg = SchedulerConfig(engine=EngineConfig(model_path=tiny_dir, load_format="dummy", device=device,
                                              max_total_tokens=2048, **engine), chunked_prefill_size=16,
                          max_running_requests=4)
    runner, _, _ = create_runner(cfg)
    return Scheduler(cfg, runner, None, role=role)


def submit(sched, rid, n, max_new=3, **extra):
    sched.handle(TokenizedGenerateReq(rid=rid, input_ids=[(7 * i) % 400 + 50 for i in range(n)],
                                      sampling=SamplingParams.from_dict({"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}),
                                      **extra))


def run(sched, steps=200):
    outs = []
    for _ in range(steps):
        sched.step()
        outs += sched.take_outputs()
        if not sched.has_work():
            break
    return outs


class Recorder(PDRole):
    intercepts_prefill = True

    def __init__(self):
        self.calls = []

    def start(self, ctx):
        super().start(ctx)
        self.calls.append(("start",))

    def before_forward(self, batch, fb):
        self.calls.append(("before_forward", batch.mode.name))

    def after_forward(self, batch):
        self.calls.append(("after_forward", batch.mode.name))

    def on_chunk(self, req, start, end):
        self.calls.append(("chunk", start, end))

    def on_prompt_done(self, req):
        self.calls.append(("prompt_done", req.rid))
        return False


def test_the_scheduler_calls_the_role_hooks_it_was_given(tiny_dir):
    role = Recorder()
    sched = make_scheduler(tiny_dir, role)
    assert sched.role is role and role.calls == [("start",)] and role.ctx.pool is sched.runner.kv_pool
    submit(sched, "r", 40)
    outs = run(sched)
    assert outs[-1].finish_reason is not None
    hooks = [c for c in role.calls if c[0] in ("chunk", "prompt_done")]
    assert hooks == [("chunk", 0, 16), ("chunk", 16, 32), ("prompt_done", "r")]
    extend = [c for c in role.calls if c == ("before_forward", "EXTEND")]
    assert len(extend) == 3 and role.calls.count(("after_forward", "EXTEND")) == 3
    assert role.calls.count(("after_forward", "DECODE")) == 2  # 3 tokens: the first from the prefill


class Holder(PDRole):
    """Takes every request, then hands it back to the scheduler's queue (a decode role's fallback)."""

    def __init__(self):
        self.held = []

    def on_new_request(self, req):
        self.held.append(req)
        return True

    def poll(self):
        while self.held:
            self.ctx.requeue(self.held.pop())

    def has_work(self):
        return bool(self.held)


def test_a_role_hands_requests_back_through_its_context(tiny_dir):
    sched = make_scheduler(tiny_dir, Holder())
    submit(sched, "x", 20)
    assert not sched.waiting and sched.role.held  # the role took it
    outs = run(sched)
    assert outs[-1].rid == "x" and len(outs[-1].new_output_ids) + sum(len(o.new_output_ids) for o in outs[:-1]) == 3


class Finisher(PDRole):
    """Holds every request after the first and ends it in its next poll (as a decode role admits a
    prefilled request or ends a room there): the poll queues the request's output."""

    def __init__(self):
        self.held, self.forwards = [], 0

    def on_new_request(self, req):
        if req.rid == "running":
            return False
        self.held.append(req)
        return True

    def poll(self):
        while self.held:
            req = self.held.pop()
            req.finish({"type": "length", "length": 0})
            self.ctx.retire(req)

    def after_forward(self, batch):
        self.forwards += 1

    def has_work(self):
        return bool(self.held)


def test_what_the_role_poll_queues_goes_out_before_the_next_forward(tiny_dir):
    sched = make_scheduler(tiny_dir, Finisher())
    submit(sched, "running", 20, max_new=50)
    while not sched.running:
        sched.step()
    sched.take_outputs()
    submit(sched, "polled", 10)
    forwards = sched.role.forwards
    assert sched.step()
    # the step's poll ended "polled": its output leaves before "running"'s next decode step
    assert [o.rid for o in sched.take_outputs()] == ["polled"] and sched.role.forwards == forwards
    assert sched.step() and sched.role.forwards == forwards + 1  # then the forward runs


class ChunkTiers(PDRole):
    intercepts_prefill = True

    def __init__(self):
        self.tiers = {}

    def on_new_request(self, req):
        self.ctx.tiering.rank_chunks(req)
        return False

    def on_chunk(self, req, start, end):
        self.tiers[(start, end)] = self.ctx.tiering.chunk_tiers(req, start, end)


@pytest.mark.parametrize("budget", [0.5, 0.3])
def test_chunk_tiers_meet_the_budget_chunk_by_chunk(tiny_dir, budget):
    from sgl_kvxfer.spectrum.budget import assignment_bytes, fp16_bytes

    role = ChunkTiers()
    sched = make_scheduler(tiny_dir, role, kv_tier_budget=budget, kv_int4="on")
    submit(sched, "c", 60)
    run(sched)
    assert sorted(role.tiers) == [(0, 16), (16, 32), (32, 48)]  # the last chunk is tiered with the prompt
    layout = sched.tiering.layout
    for (a, b), tiers in role.tiers.items():
        assert tiers.numel() == b - a
        assert assignment_bytes(tiers, layout) <= budget * fp16_bytes(b - a, layout) + 1e-6
    assert role.tiers[(0, 16)][0] == 0  # a sink, pinned at fp16 in the first chunk


class ChunkTiersAndSlots(ChunkTiers):
    """Records each chunk's tiers, its snapshot slot ids, and the table's row when on_chunk runs."""

    def __init__(self):
        super().__init__()
        self.slots, self.launches = {}, []

    def after_launch(self, batch):
        self.launches.append([(s.start, s.start + s.length) for s in batch.slices])

    def on_chunk(self, req, start, end):
        tiers, slots = self.ctx.tiering.chunk_tiers(req, start, end, with_slots=True)
        self.tiers[(start, end)] = tiers
        self.slots[(start, end)] = (slots, self.ctx.table.read(req.req_pool_idx, end, start=start).clone())


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a GPU")])])
def test_overlapped_chunks_tier_as_serial_chunks_do(tiny_dir, device):
    """Chunks of a tiered prompt overlap (chunk_overlap): chunk N's results, tiers and pack come
    after chunk N + 1 is launched. Each chunk's tiers, ranked from its own window snapshot, and
    its snapshot's slot ids are those of the serial run; the sampled token is the same (on a
    GPU the snapshots are copied behind each chunk's own event)."""
    results = []
    for overlap in (False, True):
        role = ChunkTiersAndSlots()
        sched = make_scheduler(tiny_dir, role, device, kv_tier_budget=0.3, kv_int4="on")
        sched.chunk_overlap = overlap
        applied_late = []
        real_apply = sched._apply_prefill

        def apply(sched=sched, real_apply=real_apply, applied_late=applied_late):
            if sched.pending_prefill is not None:  # a chunk applied after the next was launched
                applied_late.append(sched.pending_prefill.batch.slices[0].start)
            real_apply()

        sched._apply_prefill = apply
        submit(sched, "c", 60)
        outs = run(sched)
        assert sorted(role.tiers) == [(0, 16), (16, 32), (32, 48)]
        for (a, b), (snap, row) in role.slots.items():
            assert snap is not None and torch.equal(snap, row.cpu()), (overlap, a, b)  # unchanged until the re-tier
        results.append(({k: v.tolist() for k, v in role.tiers.items()},
                        [t for o in outs for t in o.new_output_ids], applied_late))
    (serial_tiers, serial_out, serial_late), (over_tiers, over_out, over_late) = results
    assert serial_late == [] and over_late == [0, 16, 32]  # the overlap did happen, chunk by chunk
    assert over_tiers == serial_tiers and over_out == serial_out


class _Pool:
    layout = "tiered"

    def __init__(self, tiers):
        self.tiers = torch.tensor(tiers, dtype=torch.int8)

    def tier_of(self, slots):
        return self.tiers[slots]


def test_upgrade_resends_only_the_tokens_whose_tier_rose():
    from sgl_kvxfer.disagg.prefill import TIER_KEEP, PrefillRole, PrefillRoom

    role = object.__new__(PrefillRole)
    role.pool = _Pool([0, 1, 2, 1, 3, 2])  # final tiers of slots 0..5 (slot i holds position i)
    room = PrefillRoom(1, stream="chunk-upgrade")
    room.sent_tiers = torch.tensor([1, 1, 1, 2, 2, 3], dtype=torch.int16)  # what each position streamed at
    room.streamed = 6
    role._finalize_chunks(room, 6)
    assert [(r.start, r.end, r.kind) for r in room.pending] == [(0, 6, "upgrade")]
    tiers = role._segment_tiers(room, room.pending[0], torch.arange(6))
    assert tiers.tolist() == [0, TIER_KEEP, TIER_KEEP, 1, TIER_KEEP, 2]  # rose: fp16, int8, int4 (from a drop)


def test_chunks_not_packed_at_prompt_end_go_at_the_final_tiers():
    from sgl_kvxfer.disagg.prefill import PrefillRole, PrefillRoom, _Range

    role = object.__new__(PrefillRole)
    room = PrefillRoom(1, stream="chunk")
    room.pending.extend([_Range(16, 32, "chunk", torch.zeros(16)), _Range(32, 48, "chunk", torch.zeros(16))])
    room.streamed = 48
    role._finalize_chunks(room, 60)
    assert not room.pending and room.streamed == 16  # on_prompt_done then sends [16, 60) stored
    r = _Range(0, 10, "chunk", torch.arange(10))
    a, b = r.split()
    assert (a.start, a.end, b.start, b.end) == (0, 5, 5, 10) and b.tiers.tolist() == [5, 6, 7, 8, 9]


def test_final_tiers_pack_the_rest_before_the_retier_moves_it(monkeypatch):
    """A chunk stream's prompt end: once the final tiers exist and before the KV moves, the
    rest of the prompt (the last chunk and any chunk not packed yet) is queued as one chunk
    range at those tiers, with the host slot ids, and pumped; a prompt whose unsent part
    starts inside the cached head is left to on_prompt_done (stored codes)."""
    from types import SimpleNamespace as NS

    from sgl_kvxfer.disagg.prefill import PrefillRole, PrefillRoom, _Range

    role = object.__new__(PrefillRole)
    room = PrefillRoom(1, stream="chunk")
    pumped = []
    monkeypatch.setattr(role, "_room_of", lambda req: room)
    monkeypatch.setattr(role, "_pump", lambda r: pumped.append([(x.start, x.end, x.kind) for x in r.pending]))
    req = NS(origin_input_ids=list(range(60)))
    room.pending.append(_Range(32, 48, "chunk", torch.zeros(16)))  # the link had not taken it
    room.streamed = 48
    slots, tiers = torch.arange(100, 160), torch.arange(60, dtype=torch.int8) % 4
    role._on_final_tiers(req, 0, slots, tiers)
    assert pumped == [[(32, 60, "chunk")]] and room.streamed == 60
    rng = room.pending[0]
    assert rng.tiers.tolist() == tiers[32:].tolist() and rng.slots.tolist() == list(range(132, 160))

    room2 = PrefillRoom(2, stream="chunk-upgrade")
    monkeypatch.setattr(role, "_room_of", lambda req: room2)
    room2.streamed = 0  # one chunk, its head from the prefix cache: [0, 8) is the cache's
    role._on_final_tiers(req, 8, slots[8:], tiers[8:])
    assert len(pumped) == 1 and not room2.pending and room2.streamed == 0
    room3 = PrefillRoom(3, stream="end")
    monkeypatch.setattr(role, "_room_of", lambda req: room3)
    role._on_final_tiers(req, 0, slots, tiers)
    assert len(pumped) == 1 and not room3.pending


def test_end_stream_sends_the_first_chunk_then_the_rest_after_the_prompt(monkeypatch):
    """Tiered `end`: nothing is queued while chunks finish; at prompt end the stored range is cut
    at the first chunk's end only, so the first write waits for one chunk's pack and the rest is
    one segment (a pack's host cost barely depends on its length)."""
    from types import SimpleNamespace as NS

    from sgl_kvxfer.disagg.prefill import PrefillRole, PrefillRoom

    role = object.__new__(PrefillRole)
    role.tiered = True
    room = PrefillRoom(1, stream="end")
    monkeypatch.setattr(role, "_room_of", lambda req: room)
    req = NS(origin_input_ids=list(range(40)))
    for a, b in ((0, 10), (10, 20), (20, 30)):
        role.on_chunk(req, a, b)
    assert not room.pending and room.streamed == 0
    assert role.on_prompt_done(req)
    assert [(r.start, r.end, r.kind) for r in room.pending] == [(0, 10, "stored"), (10, 40, "stored")]
    assert room.streamed == 40
    one = PrefillRoom(2, stream="end")  # a prompt of one chunk: one segment
    monkeypatch.setattr(role, "_room_of", lambda req: one)
    assert role.on_prompt_done(req) and [(r.start, r.end) for r in one.pending] == [(0, 40)]


def test_the_link_route_rejects_bad_values():
    from sgl_kvxfer.disagg.base import TransferEngine
    from sgl_kvxfer.disagg.prefill import PrefillRole
    from sgl_kvxfer.disagg.shaped import ShapedTransferEngine

    class Engine(TransferEngine):
        def session_id(self):
            return "x:1"

        def register(self, addr, nbytes):
            pass

        def write(self, peer, src, dst, n):
            pass

    from types import SimpleNamespace

    role = object.__new__(PrefillRole)
    role.fake, role.stream, role.engine = False, "end", ShapedTransferEngine(Engine(), 10.0)
    role.settings, role.trace_on, role.last_chunk = SimpleNamespace(trace=False), False, 512
    for rate, lat, stream in ((float("nan"), 0, None), (-1, 0, None), (1, float("inf"), None), (1e9, 0, None),
                              (1, 0, "fast")):
        ok, msg = role.set_link(rate, lat, stream)
        assert not ok and msg, (rate, lat, stream)
    assert role.set_link(0, 0, "chunk")[0] and role.stream == "chunk" and role.engine.rate_bps == float("inf")
    assert not role.set_link(0, 0, None, True)[0] and not role.trace_on  # started without --enable-pd-trace
    role.settings.trace = role.trace_on = True
    assert role.set_link(0, 0, None, False)[0] and not role.trace_on and role.stream == "chunk"
    assert role.set_link(0, 0)[0] and not role.trace_on  # no trace given: unchanged
    assert role.set_link(0, 0, None, True)[0] and role.trace_on
    for bad in (-1, 16, 1 << 21):
        assert not role.set_link(0, 0, None, None, bad)[0] and role.last_chunk == 512
    assert role.set_link(0, 0, None, None, 0)[0] and role.last_chunk == 0
    assert role.set_link(0, 0)[0] and role.last_chunk == 0  # none given: unchanged
    role.engine = Engine()  # not shaped: a stream switch only
    assert not role.set_link(5, 0)[0] and role.set_link(0, 0, "end")[0] and role.stream == "end"


def test_gc_pauses_become_trace_spans():
    import gc

    from sgl_kvxfer.disagg.trace import GCPauses

    pauses = GCPauses(min_s=0.0)
    try:
        t0 = time.time()
        garbage = [[i] for i in range(20000)]
        gc.collect()
        t1 = time.time()
        spans = pauses.spans(t0, t1)
        assert any(name == "gc2" and t0 <= s <= e <= t1 for name, s, e in spans), spans
        assert pauses.spans(t1 + 1, t1 + 2) == []  # nothing outside the window
    finally:
        pauses.close()
    assert pauses._on_gc not in gc.callbacks
    del garbage


def test_trace_render_finds_the_uncovered_stretches():
    from sgl_kvxfer.disagg.trace import render

    prefill = [["queue", 0.000, 0.010], ["prefill[0:16]", 0.010, 0.050], ["wire[0]", 0.060, 0.070]]
    decode = [["bootstrap", 0.001, 0.005], ["unpack[0]", 0.075, 0.080], ["admit", 0.100, 0.101]]
    t = render(prefill, decode, [0.0, 0.001], 0.101)
    assert t["critical_ms"] == pytest.approx(101.0)
    assert t["unaccounted_ms"] == pytest.approx(10 + 5 + 20)  # 50-60, 70-75, 80-100
    assert [g[:2] for g in t["gaps"]] == [["p.prefill[0:16]", "p.wire[0]"], ["p.wire[0]", "d.unpack[0]"],
                                          ["d.unpack[0]", "d.admit"]]
    assert t["by_phase_ms"]["p.prefill"] == pytest.approx(40.0)
    assert [p[0] for p in t["phases"]][:2] == ["p.queue", "d.bootstrap"]


def test_the_emit_span_runs_from_the_first_token_queued_to_its_chunk_written():
    from sgl_kvxfer.disagg.trace import render, with_emit

    trace = render([["queue", 10.0, 10.1]], [["admit", 10.1, 10.2]], [10.0], 10.2)
    assert trace["critical_ms"] == pytest.approx(200.0) and trace["first_token_time"] == 10.2
    kv = {"status": "ok", "trace": trace}
    snapshot = {"text": "a", "meta_info": {"id": "r", "kv_transfer": kv}}
    out = with_emit(snapshot, 10.25)
    assert out["meta_info"]["kv_transfer"]["trace"]["phases"][-1] == ["d.emit", pytest.approx(200.0), pytest.approx(50.0)]
    assert out["meta_info"]["kv_transfer"]["trace"]["by_phase_ms"]["d.emit"] == pytest.approx(50.0)
    assert kv["trace"] is trace and all(p[0] != "d.emit" for p in trace["phases"])  # the shared state is untouched
    assert with_emit(out, 11.0) is out  # one span per request
    plain = {"text": "a", "meta_info": {"id": "r"}}
    assert with_emit(plain, 11.0) is plain


def test_ib_device_forms_of_sglang(tmp_path):
    from sgl_kvxfer.disagg.mooncake import ib_devices_for_gpu

    assert ib_devices_for_gpu(None, 0) == "" and ib_devices_for_gpu("mlx5_0,mlx5_1", 3) == "mlx5_0,mlx5_1"
    assert ib_devices_for_gpu('{"0": "mlx5_0", "1": "mlx5_1"}', 1) == "mlx5_1"
    f = tmp_path / "map.json"
    f.write_text('{"0": "mlx5_2"}')
    assert ib_devices_for_gpu(str(f), 0) == "mlx5_2"
    for bad, gpu in (('{"0": "mlx5_0"}', 1), ("{oops", 0), ('{"a": "mlx5_0"}', 0), ('{"0": 5}', 0),
                     (str(tmp_path / "none.json"), 0)):
        with pytest.raises(ValueError):
            ib_devices_for_gpu(bad, gpu)


def test_mooncake_env_false_means_off(monkeypatch):
    import os

    from sgl_kvxfer.disagg.mooncake import _prepare_environment

    for value in ("false", "0", "", "Off"):
        monkeypatch.setenv("MC_INTRANODE_NVLINK", value)
        _prepare_environment()
        assert "MC_INTRANODE_NVLINK" not in os.environ  # Mooncake would enable it on presence
    monkeypatch.setenv("MC_INTRANODE_NVLINK", "true")
    _prepare_environment()
    assert os.environ["MC_INTRANODE_NVLINK"] == "true"


def test_the_wake_channel_ends_a_wait_from_another_thread():
    from sgl_kvxfer.message.queue import WakeChannel, wait_readable

    wake = WakeChannel()
    try:
        threading.Timer(0.05, wake.notify).start()
        start = time.monotonic()
        wait_readable([wake], 5.0)
        assert time.monotonic() - start < 2.0
        wake.drain()
        start = time.monotonic()
        wait_readable([wake], 0.05)  # drained: nothing pending
        assert time.monotonic() - start >= 0.04
    finally:
        wake.close()


def test_pd_flags_are_validated():
    ok = ServerArgs.from_flat(base_gpu_id=1, disaggregation_ib_device='{"1": "mlx5_1"}',
                              kv_transfer_stream="chunk-upgrade", enable_pd_trace=True)
    assert ok.engine.base_gpu_id == 1 and ok.scheduler.enable_pd_trace
    for bad in (dict(base_gpu_id=-1), dict(disaggregation_ib_device='{"0": "mlx5_0"}', base_gpu_id=1),
                dict(kv_transfer_rate_gbps=float("nan")), dict(kv_transfer_latency_ms=float("inf")),
                dict(kv_transfer_stream="fast"), dict(disaggregation_transfer_backend="nixl"),
                dict(kv_transfer_timeout=float("nan")), dict(kv_claim_timeout=float("nan")),
                dict(kv_claim_timeout=float("inf")), dict(kv_claim_timeout=0), dict(kv_claim_timeout=-1),
                dict(kv_claim_timeout=1e9)):
        with pytest.raises(ValueError):
            ServerArgs.from_flat(**bad)
    from sgl_kvxfer.server.flags import parse_server_args

    assert parse_server_args(["--kv-claim-timeout", "2.5"]).scheduler.kv_claim_timeout == 2.5
    for bad in ("nan", "inf", "0", "-3", "1e9", "soon"):
        with pytest.raises(SystemExit):  # argparse's error, naming the flag
            parse_server_args(["--kv-claim-timeout", bad])
    assert ServerArgs.from_flat(disaggregation_transfer_backend="mooncake_tcp").scheduler.disaggregation_transfer_backend \
        == "mooncake_tcp"


def test_fused_head_importance_equals_the_per_head_loop():
    """Chunk ranking's accumulator (one product per layer) computes the per-head loop's scores."""
    from sgl_kvxfer.spectrum.importance import ImportanceAccumulator

    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(40, 8, 16, generator=gen), torch.randn(100, 2, 16, generator=gen)
    loop, fused = ImportanceAccumulator(100, 32), ImportanceAccumulator(100, 32, fused_heads=True)
    for acc in (loop, fused):
        acc.add_layer(q, k, q_positions=torch.arange(60, 100))
        acc.add_layer(q, k, q_positions=torch.arange(60, 100), logit_softcap=5.0)
    assert fused.num_rows == loop.num_rows and torch.allclose(fused.scores(), loop.scores(), atol=1e-6)


def test_a_gpu_transfer_asked_of_the_host_memory_build_names_the_cuda_build(monkeypatch):
    """SGL_KVXFER_KV_BUFFER=device with an engine that registers host memory only, or
    MC_INTRANODE_NVLINK with Mooncake's non-CUDA build: an error with the CUDA build's install line
    (checked before any GPU memory is touched, so it runs on CPU)."""
    from sgl_kvxfer.disagg import mooncake
    from sgl_kvxfer.disagg.buffers import TransferBuffer

    monkeypatch.setenv("SGL_KVXFER_KV_BUFFER", "device")
    with pytest.raises(ValueError, match=r"SGL_KVXFER_KV_BUFFER=device.*\.\[pd-cuda13\]"):
        TransferBuffer(1 << 20, "cuda", gpu_capable_engine=False)
    assert not TransferBuffer(1 << 10, "cpu", gpu_capable_engine=False).on_device  # a CPU server: host memory
    if mooncake.installed_build() != mooncake.NON_CUDA_DIST:
        pytest.skip("the NVLink check needs Mooncake's host-memory build installed")
    pytest.importorskip("mooncake.engine")
    monkeypatch.setenv("MC_INTRANODE_NVLINK", "true")
    with pytest.raises(RuntimeError, match=r"MC_INTRANODE_NVLINK is set.*mooncake-transfer-engine-non-cuda.*pd-cuda13"):
        mooncake.MooncakeTransferEngine("127.0.0.1")
    monkeypatch.setenv("MC_INTRANODE_NVLINK", "false")  # off: the host-memory build starts as usual
    engine = mooncake.MooncakeTransferEngine("127.0.0.1")
    try:
        assert not engine.gpu_memory and engine.describe()["build"] == mooncake.NON_CUDA_DIST
    finally:
        engine.close()


# ---------------------------------------------------------------- the prefill's view of its decodes
class _Sender:
    def __init__(self):
        self.jobs, self.cancelled = [], set()

    def submit(self, job):
        self.jobs.append(job)


class _Req:
    finished = False


def _prefill_role(claim_timeout=2.0, timeout=30.0):
    from sgl_kvxfer.disagg.common import DisaggSettings, TransferStats
    from sgl_kvxfer.disagg.prefill import PrefillRole

    role = object.__new__(PrefillRole)
    role.settings = DisaggSettings("prefill", 8998, "mooncake", timeout, 1 << 20, "end", 0.0, 0.0,
                                   claim_timeout_s=claim_timeout)
    role.stats, role.rooms, role.ended, role.sender = TransferStats(), {}, {}, _Sender()
    return role


def test_a_room_no_decode_registers_for_ends_at_the_claim_deadline_naming_the_decode():
    from sgl_kvxfer.disagg.prefill import PrefillRoom
    from sgl_kvxfer.message.disagg import KVFailed, KVRegister

    role = _prefill_role(claim_timeout=2.0)
    room = role.rooms[5] = PrefillRoom(5, req=_Req())
    role._check_deadline(room, room.created + 1.9)
    assert room.error is None and role.watched_peers() == {}  # nothing to watch yet
    role._check_deadline(room, room.created + 2.1)
    assert room.error.startswith("decode unreachable: no decode registered for the room within 2 s")
    assert role.stats.rooms == {"failed:decode unreachable": 1}  # counted once, however often polled
    role._check_deadline(room, room.created + 9)
    assert role.stats.rooms == {"failed:decode unreachable": 1}
    # a slow decode that registers afterwards is told at once (it prefills locally), not at its timeout
    role.rooms.pop(5)
    role._on_message(KVRegister(5, "tcp://d:7"))
    (job,) = role.sender.jobs
    assert job.reply_to == "tcp://d:7" and isinstance(job.msg, KVFailed) and "decode unreachable" in job.msg.reason
    assert 5 not in role.rooms
    # the claim deadline never exceeds --kv-transfer-timeout
    assert _prefill_role(claim_timeout=60, timeout=10).settings.claim_deadline_s == 10


def test_a_registered_decode_is_watched_and_its_death_ends_its_rooms():
    from sgl_kvxfer.disagg.prefill import PrefillRoom
    from sgl_kvxfer.message.disagg import KVRegister

    role = _prefill_role(claim_timeout=2.0)
    role._on_message(KVRegister(6, "tcp://10.0.0.2:4000"))  # the decode came first
    role.rooms[6].req = _Req()
    other = role.rooms[7] = PrefillRoom(7, req=_Req())
    role._on_message(KVRegister(7, "tcp://10.0.0.3:4000"))
    assert role.watched_peers() == {("10.0.0.2", 4000): "tcp://10.0.0.2:4000", ("10.0.0.3", 4000): "tcp://10.0.0.3:4000"}
    room = role.rooms[6]
    role._check_deadline(room, room.created + 5)  # registered: the claim deadline does not apply
    assert room.error is None
    role.on_peer_dead(("10.0.0.2", 4000), "decode unreachable: tcp://10.0.0.2:4000 (2 failed probes)")
    assert room.error == "decode unreachable: tcp://10.0.0.2:4000 (2 failed probes)" and other.error is None
    assert role.watched_peers() == {("10.0.0.3", 4000): "tcp://10.0.0.3:4000"}  # a failed room watches nothing


def test_trace_chunk_spans_start_at_their_own_launch(monkeypatch):
    """Overlapped prefill launches chunk 2 before chunk 1's after_forward: each prefill[a:b]
    span still starts at its own chunk's launch, and the queue span is recorded once."""
    import time as _time
    from types import SimpleNamespace as NS

    import sgl_kvxfer.disagg.prefill as prefill_mod
    from sgl_kvxfer.disagg.trace import PhaseTrace
    from sgl_kvxfer.forward_batch import ForwardMode

    role = prefill_mod.PrefillRole.__new__(prefill_mod.PrefillRole)
    role.settings, role.device = NS(trace=True), "cpu"
    room = prefill_mod.PrefillRoom(1)
    room.trace = PhaseTrace()
    room.trace.add("arrival", 0.5, 0.5)
    monkeypatch.setattr(role, "_room_of", lambda req: room)
    clock = iter([1.0, 2.0, 3.0, 4.0])
    monkeypatch.setattr(prefill_mod, "time", NS(time=lambda: next(clock), monotonic=_time.monotonic))
    chunks = [NS(slices=[NS(req=None, start=a, length=16)], mode=ForwardMode.EXTEND) for a in (0, 16)]
    role.before_forward(chunks[0], None)  # 1.0
    role.before_forward(chunks[1], None)  # 2.0: launched before chunk 1's after_forward
    role.after_forward(chunks[0])  # 3.0
    role.after_forward(chunks[1])  # 4.0
    spans = {n: (s, e) for n, s, e in room.trace.spans}
    assert spans["prefill[0:16]"] == (1.0, 3.0) and spans["prefill[16:32]"] == (2.0, 4.0)
    assert [n for n, *_ in room.trace.spans].count("queue") == 1 and spans["queue"] == (0.5, 1.0)
