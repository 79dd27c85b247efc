"""SCD over PD without servers: the code payload, the hidden-state capture hook, the SCD config
and start-up checks (which consumer a server is, mismatched artifacts), the claim checks, the
messages, and the private KV of SCD requests."""
import types

import pytest
import torch

from sgl_kvxfer.config import EngineConfig, SchedulerConfig
from sgl_kvxfer.disagg.scd_common import ScdSetupError, load_consumer, load_producer, manifest_id
from sgl_kvxfer.mem_cache.scd_payload import CodeLayout, pack_codes, unpack_codes
from sgl_kvxfer.message import decode, encode
from sgl_kvxfer.message.disagg import KVClaim, KVLayoutInfo, KVSegment, ScdClaimInfo
from sgl_kvxfer.models.arch_config import ModelArchConfig
from sgl_kvxfer.models.llama import HIDDEN_CAPTURE, LlamaForCausalLM
from sgl_kvxfer.models.presets import PRESETS, write_preset_config
from sgl_kvxfer.scd.artifacts import make_random_artifacts


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = write_preset_config("tiny", str(tmp_path_factory.mktemp("tiny")))
    arch = ModelArchConfig.from_dir(d)
    arts = {}
    for name, seed, ranks in (("a", 0, (8, 16, 32)), ("b", 1, (8, 16, 32)), ("c", 0, (4, 16, 32))):
        out = str(tmp_path_factory.mktemp(f"arts_{name}"))
        make_random_artifacts(arch, ["c0", "c1"], *ranks, patch_layers=[1], seed=seed).save(out)
        arts[name] = out
    return types.SimpleNamespace(dir=d, arch=arch, arts=arts)


def fake_runner(arch, load_format="dummy"):
    return types.SimpleNamespace(config=EngineConfig(load_format=load_format), arch=arch, device="cpu",
                                 model_dir="/nonexistent")


# ---------------------------------------------------------------- the code payload
def test_code_payload_round_trips_in_wire_order(tiny):
    arts = make_random_artifacts(tiny.arch, 1, 8, 16, 32, patch_layers=[1])
    layout = CodeLayout.from_manifest(arts.manifest)
    assert layout.bytes_per_token == arts.manifest.bytes_per_token == (2 * (8 + 16) + 32) * 2
    n = 5
    codes = {(layer, kind): torch.randn(n, *shape).to(layout.dtype) for layer, kind, shape in layout.fields}
    out = torch.zeros(layout.nbytes(n) + 7, dtype=torch.uint8)
    assert pack_codes(layout, codes, out) == layout.nbytes(n)
    back = unpack_codes(layout, out, n)
    assert back.keys() == codes.keys() and all(torch.equal(back[k], codes[k]) for k in codes)
    # field 0 is layer 0's k: its bytes lead the payload
    assert torch.equal(out[:n * 2 * 8 * 2], codes[(0, "k")].view(torch.uint8).reshape(-1))
    with pytest.raises(ValueError, match="shape"):
        pack_codes(layout, {**codes, (0, "k"): torch.zeros(n, 2, 9)}, out)
    with pytest.raises(ValueError, match="needs"):
        unpack_codes(layout, out[:10], n)


# ---------------------------------------------------------------- the capture hook
class _StubBackend:
    """Attention that returns q itself: enough to run the layers without a KV pool."""

    def forward_qkv(self, qkv, cos, sin, layer_id, fb):
        return qkv[:, :fb.q_size]


def test_hidden_capture_sees_each_input_layernorm_output_and_changes_nothing(tiny):
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny.arch).eval()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.2)
    ids, pos = torch.randint(0, 500, (7,)), torch.arange(7)
    fb = types.SimpleNamespace(attn_backend=_StubBackend(), q_size=tiny.arch.q_size, seq_lens_cpu=[7], extras={})
    seen = {}

    def keep(i):  # the normed output (a tuple with the residual when the norm adds one)
        def hook(module, args, out):
            seen[i] = (out[0] if isinstance(out, tuple) else out).clone()
        return hook

    hooks = [layer.input_layernorm.register_forward_hook(keep(i)) for i, layer in enumerate(model.model.layers)]
    with torch.no_grad():
        ref = model(ids, pos, fb)
    for h in hooks:
        h.remove()
    captured = {}
    fb.extras = {HIDDEN_CAPTURE: lambda layer, h: captured.__setitem__(layer, h.clone())}
    with torch.no_grad():
        out = model(ids, pos, fb)
    assert torch.equal(out, ref)
    assert sorted(captured) == list(range(tiny.arch.num_hidden_layers))
    assert all(torch.equal(captured[i], seen[i]) for i in captured)


def _pool_families():
    """(name, pool, allocator) of every non-tiered family the engine builds: slot-granular, the
    CPU backend's paged slots, the Triton backend's head-major pages, a FusedKV layer map."""
    from sgl_kvxfer.mem_cache.allocator import TokenSlotAllocator
    from sgl_kvxfer.mem_cache.fp16_pool import Fp16KVPool
    from sgl_kvxfer.mem_cache.layer_mapped_pool import LayerMappedKVPool
    from sgl_kvxfer.mem_cache.paged_allocator import PagedTokenSlotAllocator
    from sgl_kvxfer.mem_cache.paged_fp16_pool import PagedFp16KVPool

    dims = (2, 2, 32, torch.float32, "cpu")
    token = Fp16KVPool(100, *dims)
    cpu_paged = Fp16KVPool(128, *dims, page_size=16)
    triton = PagedFp16KVPool(256, *dims, page_size=64)
    mapped = LayerMappedKVPool(PagedFp16KVPool(128, 1, 2, 32, torch.float32, "cpu", page_size=64), 2)
    return [("token", token, TokenSlotAllocator(token.size)),
            ("cpu paged", cpu_paged, PagedTokenSlotAllocator(cpu_paged.size, 16)),
            ("triton paged", triton, PagedTokenSlotAllocator(triton.size, 64)),
            ("layer mapped", mapped, PagedTokenSlotAllocator(mapped.size, 64))]


@pytest.mark.parametrize("family", range(4))
def test_every_slot_an_allocator_hands_out_is_below_the_pools_id_end(family):
    name, pool, alloc = _pool_families()[family]
    slots = alloc.alloc(pool.size)
    assert slots is not None and alloc.available_size() == 0, name
    assert int(slots.min()) >= 1 and int(slots.max()) < pool.id_end, name


@pytest.mark.parametrize("family", range(4))
def test_producer_patch_codes_cover_every_slot_of_a_full_pool(tiny, family):
    """The zh pool is indexed by KV slot: a paged pool's last page holds slots past pool.size
    (on a GPU an index past the table is a device-side assert, not an IndexError)."""
    from sgl_kvxfer.disagg.common import DisaggSettings
    from sgl_kvxfer.disagg.scd_prefill import ScdPrefillRole

    name, pool, alloc = _pool_families()[family]
    runner = types.SimpleNamespace(**vars(fake_runner(tiny.arch)), kv_pool=pool)
    ctx = types.SimpleNamespace(runner=runner, pool=pool, table=None, tiering=None)
    role = ScdPrefillRole(DisaggSettings("prefill", 0, "fake", 5.0, 1 << 20, "end", 0.0, 0.0,
                                         scd_artifacts=tiny.arts["a"]), "127.0.0.1")
    role.start(ctx)  # the fake backend: no sender, no buffers; the zh pool is built
    slots = alloc.alloc(pool.size)  # every slot, the last page's included
    hidden = torch.randn(slots.numel(), tiny.arch.hidden_size)
    role._capture(slots, 1, hidden)
    assert torch.equal(role.zh_pool[1][slots], role.encoder.encode_patch(1, hidden)), name


# ---------------------------------------------------------------- config and start-up checks
def test_scd_flags_are_validated(tiny):
    SchedulerConfig(disaggregation_mode="prefill", scd_artifacts=tiny.arts["a"], scd_fanout=3)
    with pytest.raises(ValueError, match="need --scd-artifacts"):
        SchedulerConfig(disaggregation_mode="prefill", scd_fanout=2)
    with pytest.raises(ValueError, match="disaggregation-mode"):
        SchedulerConfig(scd_artifacts=tiny.arts["a"])
    with pytest.raises(ValueError, match="not fake"):
        SchedulerConfig(disaggregation_mode="decode", disaggregation_transfer_backend="fake", scd_artifacts=tiny.arts["a"])
    with pytest.raises(ValueError, match="no manifest.json"):
        SchedulerConfig(disaggregation_mode="decode", scd_artifacts=tiny.dir)
    with pytest.raises(ValueError, match="prefill's"):
        SchedulerConfig(disaggregation_mode="decode", scd_artifacts=tiny.arts["a"], scd_fanout=2)
    with pytest.raises(ValueError, match="decode server is"):
        SchedulerConfig(disaggregation_mode="prefill", scd_artifacts=tiny.arts["a"], scd_consumer="c0")
    with pytest.raises(ValueError, match="fp16-family"):
        SchedulerConfig(engine=EngineConfig(kv_tier_budget=0.5), disaggregation_mode="decode",
                        scd_artifacts=tiny.arts["a"])
    for rank in ("auto", "top", "4:12"):
        SchedulerConfig(disaggregation_mode="prefill", scd_artifacts=tiny.arts["a"], scd_rank=rank)
    for rank in ("bottom", "4", "0:3", "4:-1", "4:12:1", "99999999:1", ""):
        with pytest.raises(ValueError, match="--scd-rank"):
            SchedulerConfig(disaggregation_mode="prefill", scd_artifacts=tiny.arts["a"], scd_rank=rank)
    for frac in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="--scd-wire-frac"):
            SchedulerConfig(disaggregation_mode="prefill", scd_artifacts=tiny.arts["a"], scd_wire_frac=frac)
    with pytest.raises(ValueError, match="prefill's"):
        SchedulerConfig(disaggregation_mode="decode", scd_artifacts=tiny.arts["a"], scd_rank="auto")
    with pytest.raises(ValueError, match="need --scd-artifacts"):
        SchedulerConfig(disaggregation_mode="prefill", scd_rank="auto")
    for floor in ("4:12", "auto"):
        SchedulerConfig(disaggregation_mode="prefill", scd_artifacts=tiny.arts["a"], scd_rank="auto", scd_min_rank=floor)
    for bad in ("4", "0:3", "top", ""):
        with pytest.raises(ValueError, match="--scd-min-rank must be"):
            SchedulerConfig(disaggregation_mode="prefill", scd_artifacts=tiny.arts["a"], scd_rank="auto",
                            scd_min_rank=bad)
    with pytest.raises(ValueError, match="bounds --scd-rank auto"):
        SchedulerConfig(disaggregation_mode="prefill", scd_artifacts=tiny.arts["a"], scd_min_rank="4:12")


def test_rank_policy():
    from sgl_kvxfer.scd.rank_policy import choose_level

    bpt = [1000, 2000, 4000]
    assert choose_level(bpt, 1000, None, 0.1, 0.25) == 2  # no link rate: the top level
    assert choose_level(bpt, 1000, 100.0, None, 0.25) == 2  # no prefill time yet: the top level
    # 1000 tokens at 100 Gbit/s: 4000 B/token -> 0.32 ms; budget 0.25 x 10 ms = 2.5 ms
    assert choose_level(bpt, 1000, 100.0, 0.01, 0.25) == 2
    assert choose_level(bpt, 1000, 1.0, 0.01, 0.25) == 0  # 8 ms for the lowest: nothing fits, the lowest
    assert choose_level(bpt, 1000, 8.0, 0.01, 0.25) == 1  # 2 ms / 4 ms
    assert choose_level(bpt, 1000, float("nan"), 0.01, 0.25) == 2
    # a floor: the slow link that sends the lowest level sends the floor; a fast one still the top
    assert choose_level(bpt, 1000, 1.0, 0.01, 0.25, floor=1) == 1
    assert choose_level(bpt, 1000, 8.0, 0.01, 0.25, floor=1) == 1
    assert choose_level(bpt, 1000, 100.0, 0.01, 0.25, floor=1) == 2
    with pytest.raises(ValueError, match="floor"):
        choose_level(bpt, 1000, 1.0, 0.01, 0.25, floor=3)


def test_manifest_id_names_the_calibration_run(tiny):
    ids = {k: manifest_id(v) for k, v in tiny.arts.items()}
    assert len(set(ids.values())) == 3  # other encoders (seed) or other ranks: another run
    with pytest.raises(ScdSetupError, match="manifest.json"):
        manifest_id(tiny.dir)


def test_a_server_finds_which_consumer_it_is(tiny):
    runner = fake_runner(tiny.arch)
    _, name, mid = load_consumer(tiny.arts["a"], runner, None)
    assert name == "c0" and mid == manifest_id(tiny.arts["a"])  # random artifacts: any weights pass
    assert load_consumer(tiny.arts["a"], runner, "c1")[1] == "c1"
    with pytest.raises(ScdSetupError, match="names consumers"):
        load_consumer(tiny.arts["a"], runner, "c7")
    other = ModelArchConfig.from_hf_dict({**PRESETS["tiny"], "num_hidden_layers": 3})
    with pytest.raises(ScdSetupError, match="architecture"):
        load_consumer(tiny.arts["a"], fake_runner(other), None)
    with pytest.raises(ScdSetupError, match="architecture"):
        load_producer(tiny.arts["a"], fake_runner(other))
    arts, mid = load_producer(tiny.arts["a"], runner)
    assert "producer/k_enc.0" in arts.tensors and not any(k.startswith("c0/") for k in arts.tensors)


def test_producer_refuses_claims_it_cannot_serve(tiny):
    from sgl_kvxfer.disagg.scd_prefill import ScdPrefillRole

    role = object.__new__(ScdPrefillRole)  # only the claim check: no engine, no model
    role.manifest_id = manifest_id(tiny.arts["a"])
    role.manifest = load_producer(tiny.arts["a"], fake_runner(tiny.arch))[0].manifest
    layout = KVLayoutInfo("float32", 2, 2, 32, 32)

    def claim(scd):
        return KVClaim(5, "tcp://d:1", "tcp://d:1", "d:2", 0, 4096, 10, layout, scd=scd)

    assert role._claim_error(claim(ScdClaimInfo(role.manifest_id, "c1"))) is None
    assert "--scd-artifacts" in role._claim_error(claim(None))
    assert "artifacts differ" in role._claim_error(claim(ScdClaimInfo(manifest_id(tiny.arts["b"]), "c1")))
    assert "unknown SCD consumer" in role._claim_error(claim(ScdClaimInfo(role.manifest_id, "c9")))


def test_scd_messages_round_trip():
    layout = KVLayoutInfo("bfloat16", 30, 3, 64, 64)
    claim = KVClaim(7, "tcp://d:1", "tcp://d:1", "d:2", 1 << 40, 4096, 100, layout, scd=ScdClaimInfo("ab" * 32, "code"))
    seg = KVSegment(7, 0, 0, 64, None, (0, 0, 0), 0, 123, 4 << 20, [1, 2], codes=True)
    assert decode(encode(claim), "kv_prefill") == claim
    assert decode(encode(seg), "kv_decode") == seg


def test_decode_servers_refuse_a_prefill_of_the_other_kind_at_bootstrap(tiny):
    """The /route check before a claim: a plain decode meeting an SCD producer, and an SCD
    consumer meeting a plain producer or other artifacts, fail the request (400, no fallback)."""
    from sgl_kvxfer.disagg.decode import DecodeRole
    from sgl_kvxfer.disagg.scd_decode import ScdDecodeRole
    from sgl_kvxfer.message.disagg import BootstrapInfo

    room = types.SimpleNamespace(req=types.SimpleNamespace(bootstrap=BootstrapInfo("10.0.0.5", 8998, 3)))
    layout = KVLayoutInfo("float32", 2, 2, 32, 32)
    plain_info = {"kv_layout_info": {"dtype": "float32", "num_layers": 2, "num_kv_heads": 2, "head_dim": 32,
                                     "group_size": 32}}
    mid = manifest_id(tiny.arts["a"])
    scd_info = {**plain_info, "scd": {"manifest_id": mid, "consumers": ["c0", "c1"]}}

    def role(cls, **attrs):
        r = object.__new__(cls)
        r.rejected = []
        r._reject = lambda room, reason: r.rejected.append(reason)
        r._end = lambda room, reason, **kw: r.rejected.append("fallback: " + reason)
        r.layout, r.settings = layout, types.SimpleNamespace(bootstrap_port=8998)
        r.__dict__.update(attrs)
        return r

    plain = role(DecodeRole)
    assert plain._check_route(room, plain_info) and not plain.rejected
    assert not plain._check_route(room, scd_info) and "no --scd-artifacts" in plain.rejected[0]
    consumer = role(ScdDecodeRole, manifest_id=mid, consumer="c1")
    assert consumer._check_route(room, scd_info) and not consumer.rejected
    assert not consumer._check_route(room, plain_info) and "ships KV, not SCD codes" in consumer.rejected[-1]
    other = {**plain_info, "scd": {"manifest_id": manifest_id(tiny.arts["b"]), "consumers": ["c0", "c1"]}}
    assert not consumer._check_route(room, other) and "SCD artifacts differ" in consumer.rejected[-1]
    assert not role(ScdDecodeRole, manifest_id=mid, consumer="c9")._check_route(room, scd_info)


def test_level_chooser():
    from sgl_kvxfer.scd.rank_policy import LevelChooser

    levels, bpt = ((2, 2), (4, 4), (8, 8)), [1000, 2000, 4000]
    assert LevelChooser(levels, bpt, "top", 0.25).choose(100) == 2
    assert LevelChooser(levels, bpt, "4:4", 0.25).choose(100) == 1
    with pytest.raises(ValueError, match="hold levels"):
        LevelChooser(levels, bpt, "3:3", 0.25)
    auto = LevelChooser(levels, bpt, "auto", 0.25)
    assert auto.choose(1000) == 2  # nothing measured yet: the top level
    auto.observe_prefill(1000, 0.01)  # 100k tokens/s: 1000 tokens prefill in 10 ms
    assert auto.choose(1000) == 2  # no link rate known yet
    assert auto.choose(1000, paced_gbps=1.0) == 0 and auto.choose(1000, paced_gbps=8.0) == 1
    auto.observe_write(1 << 20, (1 << 20) * 8 / 100e9)  # measured 100 Gbit/s
    auto.observe_write(10, 1.0)  # a small write times latency: ignored
    assert auto.link_gbps == pytest.approx(100.0) and auto.choose(1000) == 2
    assert auto.info()["level_counts"] == {"2:2": 1, "4:4": 1, "8:8": 3}
    assert auto.info()["min_level"] == "2:2"
    floored = LevelChooser(levels, bpt, "auto", 0.25, min_rank="4:4")
    floored.observe_prefill(1000, 0.01)
    assert floored.choose(1000, paced_gbps=1.0) == 1 and floored.info()["min_level"] == "4:4"
    with pytest.raises(ValueError, match="--scd-min-rank 3:3: the artifacts hold levels"):
        LevelChooser(levels, bpt, "auto", 0.25, min_rank="3:3")
    with pytest.raises(ValueError, match="bounds --scd-rank auto"):
        LevelChooser(levels, bpt, "top", 0.25, min_rank="4:4")
    # the quality floor: the lowest level within one point of the top level's calibrated agreement
    for agreement, floor in (((0.50, 0.90, 0.91), 1), ((0.50, 0.89, 0.91), 2), ((0.905, 0.90, 0.91), 0),
                             ((0.2, 0.95, 0.93), 1)):
        q = LevelChooser(levels, bpt, "auto", 0.25, min_rank="auto", level_agreement=agreement)
        q.observe_prefill(1000, 0.01)
        assert q.floor == floor and q.choose(1000, paced_gbps=1.0) == floor, agreement
        assert q.info()["min_level"] == "{}:{}".format(*levels[floor])
    with pytest.raises(ValueError, match="level_agreement"):
        LevelChooser(levels, bpt, "auto", 0.25, min_rank="auto")


def test_quality_floor_slack():
    from sgl_kvxfer.scd.rank_policy import AGREEMENT_SLACK, quality_floor

    assert AGREEMENT_SLACK == 0.01
    assert quality_floor([0.1, 0.5, 0.9]) == 2
    assert quality_floor([0.1, 0.5, 0.9], slack=0.4) == 1
    assert quality_floor([0.1, 0.5, 0.9], slack=1.0) == 0
    assert quality_floor([0.7]) == 0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_consumers_rebuild_equals_the_codecs_per_layer_decode(tiny, device):
    """The consumer widens a segment's codes to float32 in one cast: each layer's K/V is still
    exactly the decoder's from that layer's wire codes (CPU). On a GPU its GEMMs run on TF32:
    within the bf16 pool's rounding of the float32 decode."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from sgl_kvxfer.disagg.scd_decode import ScdDecodeRole
    from sgl_kvxfer.scd.codec import KVProjection, ScdDecoder
    from sgl_kvxfer.scd.rebuild import StackedRebuild, per_layer

    arts = make_random_artifacts(tiny.arch, ["c0"], 8, 16, 32, patch_layers=[1], seed=3)
    m, layout = arts.manifest, CodeLayout.from_manifest(arts.manifest)
    assert layout.dtype != torch.float32 and not layout.bits  # the widened path
    g = torch.Generator().manual_seed(0)
    kv_out = m.num_kv_heads * m.head_dim
    hidden = tiny.arch.hidden_size
    role = ScdDecodeRole.__new__(ScdDecodeRole)
    role.pool = types.SimpleNamespace(device=device, dtype=torch.bfloat16)  # a string, as the engine passes it
    role.code_layout, role.manifest = layout, m
    role.decoder = ScdDecoder(arts, "c0", device)
    role.projections = [KVProjection(torch.randn(kv_out, hidden, generator=g).to(torch.bfloat16).to(device),
                                     torch.randn(kv_out, hidden, generator=g).to(torch.bfloat16).to(device))
                        for _ in range(m.num_layers)]
    role.stacked = StackedRebuild(role.decoder, role.projections, device)
    start, end = 3, 10
    n = end - start
    codes = {(layer, kind): torch.randn(n, *shape, generator=g).to(layout.dtype) for layer, kind, shape in layout.fields}
    payload = torch.zeros(layout.nbytes(n), dtype=torch.uint8)
    pack_codes(layout, codes, payload)
    chunks = list(role._rebuild(payload, start, end, max_tokens=4))  # [0, 4), [4, 7): chunked as served
    assert [(a, b) for a, b, _ in chunks] == [(0, 4), (4, 7)]
    parts = [per_layer(groups, m.num_layers) for _, _, groups in chunks]
    got = [tuple(torch.cat([p[layer][j] for p in parts]) for j in range(2)) for layer in range(m.num_layers)]
    assert torch.backends.cuda.matmul.allow_tf32 is False  # the rebuild's TF32 stays inside it
    positions = torch.arange(start, end, device=device)
    ref = ScdDecoder(arts, "c0", device)
    codes = {key: c.to(device) for key, c in codes.items()}
    for layer in range(m.num_layers):
        if layer in m.reuse_layers:
            want = ref.decode_reuse(layer, codes[(layer, "k")], codes[(layer, "v")], positions, torch.bfloat16)
        else:
            want = ref.regenerate_patch(layer, codes[(layer, "h")], positions, role.projections[layer], torch.bfloat16)
        for g_, w_ in zip(got[layer], want):
            if device == "cpu":
                assert torch.equal(g_, w_), layer
            else:  # TF32 inputs against float32: a few bf16 ulps of the largest value
                assert (g_.float() - w_.float()).abs().max() <= 2 ** -6 * w_.float().abs().max(), layer


def test_any_rebuild_failure_ends_the_room_instead_of_a_retry():
    """The row has moved on to the segment's end before the rebuild: a failure of any type ends
    the room (a local prefill takes over), never an exception the next poll would retry."""
    from sgl_kvxfer.disagg.scd_decode import ScdDecodeRole

    role = ScdDecodeRole.__new__(ScdDecodeRole)
    ended = []
    req = types.SimpleNamespace(bootstrap=types.SimpleNamespace(room=7), kv_len=0,
                                origin_input_ids=list(range(20)), req_pool_idx=0)
    role.rooms = {7: types.SimpleNamespace(room=7, trace=None)}
    role.layout_by_bpt = {4: object()}
    role.kv = types.SimpleNamespace(alloc=lambda reqs, ns, starts: torch.arange(1, 9))
    role.table = types.SimpleNamespace(write=lambda *a: None)
    role._end = lambda room, reason, *a, **kw: ended.append(reason)

    def broken(*a, **kw):
        raise AttributeError("'str' object has no attribute 'type'")

    role._rebuild = broken
    seg = types.SimpleNamespace(codes=True, start=0, end=8, nbytes=32)
    assert role._write_segment(req, seg, torch.zeros(32, dtype=torch.uint8)) is False
    assert ended and ended[0].startswith("rebuilding KV from codes failed: AttributeError")
