"""Per-layer int store formats (per-layer budgets, KIVI) on CPU, no model: the KIVI page codec,
pools whose layers hold different formats, byte accounting, the greedy layer allocation, the
layer profile file and the config checks."""
import json

import pytest
import torch

from sgl_kvxfer.mem_cache.kivi_pages import ChannelKeyIntPages
from sgl_kvxfer.mem_cache.tier_plan import TierStorePlan
from sgl_kvxfer.mem_cache.tiered_allocator import TieredSlotAllocator
from sgl_kvxfer.mem_cache.tiered_pool import TieredKVPool
from sgl_kvxfer.spectrum.budget import KVLayout, assignment_bytes, fp16_bytes
from sgl_kvxfer.spectrum.byte_budget import fit_byte_budget
from sgl_kvxfer.spectrum.formats import IntFormat, StoreFormats
from sgl_kvxfer.spectrum.layer_budget import DOWN, LOW, UP, LayerProfile, allocate, plan_store_formats
from sgl_kvxfer.spectrum.policies import create_tier_policy
from sgl_kvxfer.spectrum.policies.kivi import kivi_bits, kivi_cost
from sgl_kvxfer.spectrum.tiers import TIER_DROP, TIER_FP16, TIER_INT4, TIER_INT8

L, H, D, G, PAGE = 3, 2, 64, 32, 4


def kv(n, seed=0, layers=L):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, H, D, generator=gen), torch.randn(n, H, D, generator=gen)) for _ in range(layers)]


def make_pool(formats, n16=32, n8=8, n4=32):
    pool = TieredKVPool(64, L, H, D, torch.float32, "cpu", TierStorePlan(n16, n8, n4), group_size=G,
                        page_size=PAGE, formats=formats)
    return pool, TieredSlotAllocator(pool, "cpu")


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_kivi_pages_round_trip_per_channel_keys(bits):
    pages = ChannelKeyIntPages(bits, 4, PAGE, H, D, G, "cpu")
    k, v = kv(8, bits)[0]
    # an outlier channel: per-channel scales keep the other channels' error small
    k[:, :, 5] *= 50
    page, off = torch.arange(8) // PAGE, torch.arange(8) % PAGE
    pages.write(page, off, k, v)
    kk, vv = pages.read(page, off, torch.float32)
    span_k = k.amax(0) - k.amin(0)   # per channel over all tokens (>= each page's range)
    assert ((kk - k).abs() <= span_k / ((1 << bits) - 1) / 2 + 1e-3).all()
    vg = v.view(8, H, D // G, G)
    span_v = (vg.amax(-1) - vg.amin(-1)).repeat_interleave(G, -1)
    assert ((vv - v).abs() <= span_v / ((1 << bits) - 1) / 2 + 1e-3).all()
    assert pages.k.shape[-1] == D * bits // 8 and pages.k_scale.shape == (4, H, D)


def test_pool_layers_hold_their_own_formats_and_bytes():
    formats = StoreFormats.with_int4([IntFormat(4), IntFormat(8), IntFormat(2, "channel")])
    pool, alloc = make_pool(formats)
    data = kv(6)
    slots = alloc.alloc(6)
    for layer, (k, v) in enumerate(data):
        pool.set_kv(layer, slots, k, v)
    new, got = alloc.retier(slots, torch.full((6,), TIER_INT4, dtype=torch.int8))
    assert (got == TIER_INT4).all()
    cos = []
    for layer, (k, v) in enumerate(data):
        kk, _ = pool.get_kv(layer, new)
        assert torch.equal(pool.get_k_routed(layer, pool.route(new)), kk)
        cos.append(float(torch.nn.functional.cosine_similarity(kk, k, -1).mean()))
    assert cos[1] > 0.9999 > cos[0] > 0.99 and cos[2] < cos[0]  # int8 layer > int4 layer > int2c layer
    per_head = (32 + 8) * 2 + (64 + 8) * 2 + (16 + 2 * D * 2 / PAGE) + (16 + 2 * (D // G) * 2)
    assert pool.token_bytes(TIER_INT4) == pytest.approx(H * per_head)
    layout = KVLayout(L, H, D, G, formats=formats, page_size=PAGE)
    assert layout.token_bytes(TIER_INT4) == pytest.approx(pool.token_bytes(TIER_INT4))
    assert layout.token_bytes(TIER_INT8) == pool.token_bytes(TIER_INT8) == KVLayout(L, H, D, G).token_bytes(TIER_INT8)


def test_channel_store_moves_requantize_and_stay_close():
    formats = StoreFormats.with_int4([IntFormat(4, "channel")] * L)
    pool, alloc = make_pool(formats)
    data = kv(8, 3)
    slots = alloc.alloc(8)
    for layer, (k, v) in enumerate(data):
        pool.set_kv(layer, slots, k, v)
    new, _ = alloc.retier(slots, torch.full((8,), TIER_INT4, dtype=torch.int8))
    kept = new[3:]  # a holder keeping a suffix of the run sees its pages with holes
    relocated = alloc.repack(kept)
    assert not alloc.holed_pages(relocated).any()
    for layer, (k, _) in enumerate(data):
        a, _ = pool.get_kv(layer, relocated)
        assert float(torch.nn.functional.cosine_similarity(a, k[3:], -1).mean()) > 0.99
    with pytest.raises(NotImplementedError):
        pool.stored_codes(0, TIER_INT4, relocated)


def test_formats_are_given_at_construction_and_size_the_plan():
    from types import SimpleNamespace

    from sgl_kvxfer.config import EngineConfig
    from sgl_kvxfer.mem_cache import tier_store_formats, tier_store_plan

    formats = StoreFormats.with_int4([IntFormat(8)] + [IntFormat(4)] * (L - 1))
    pool, _ = make_pool(formats)
    assert pool.formats == formats and pool.stores[TIER_INT4][0].tier == TIER_INT8
    assert pool.stores[TIER_INT4][1].tier == TIER_INT4 and not hasattr(pool, "resize_int_stores")
    arch = SimpleNamespace(num_hidden_layers=L, num_key_value_heads=H, head_dim=D)
    cfg = EngineConfig(model_path="x", kv_tier_budget=0.2, kv_tier_policy="kivi", attention_backend="torch")
    fmt, alloc = tier_store_formats(cfg, arch, True)
    assert alloc is None and fmt.int4 == (IntFormat(2, "channel"),) * L
    uni = tier_store_plan(cfg, arch, 4096, torch.float16, True)
    cheap = tier_store_plan(cfg, arch, 4096, torch.float16, True, fmt)
    assert cheap.n4 > uni.n4  # int2c tokens are smaller: the same memory holds more of them


def test_kivi_policy_budget_and_format():
    layout = KVLayout(30, 3, 64, 64)
    assert kivi_cost(4, layout) == pytest.approx(36 / 128) and kivi_cost(2, layout) == pytest.approx(20 / 128)
    assert [kivi_bits(b, layout) for b in (0.6, 0.5, 0.3, 0.2, 0.1)] == [8, 4, 4, 2, 2]
    imp = torch.rand(1000)
    for b in (0.5, 0.3, 0.2, 0.1):
        policy = create_tier_policy("kivi", layout=layout, budget=b)
        fmt = policy.store_formats(b, layout)
        assert fmt.int4 == (IntFormat(policy.bits, "channel"),) * 30 and fmt.int8 == StoreFormats.uniform(30).int8
        blay = KVLayout(30, 3, 64, 64, formats=fmt)
        tiers, _ = fit_byte_budget(policy, imp, b, blay)
        assert assignment_bytes(tiers, blay) <= b * fp16_bytes(1000, blay) + 1e-6
        assert not (tiers == TIER_INT8).any()
        fp = (tiers == TIER_FP16).nonzero().squeeze(1)
        if fp.numel():  # the residual window is the newest tokens
            assert int(fp.min()) == 1000 - fp.numel()
        if b >= kivi_cost(2, layout):
            assert not (tiers == TIER_DROP).any()
        else:  # below 2-bit KIVI: the oldest go
            assert (tiers[:10] == TIER_DROP).all() and (tiers[-10:] == TIER_INT4).all()
    with pytest.raises(ValueError, match="int4"):
        create_tier_policy("kivi", layout=layout, budget=0.3).assign(imp, 0.3, 0, False)


def profile(up, down):
    return LayerProfile(len(up), tuple(up), tuple(down), 0.1)


def test_allocation_moves_bytes_to_sensitive_layers_at_equal_total():
    up_cost = sum(UP.head_bytes(64, 64, 64)) - sum(LOW.head_bytes(64, 64, 64))
    down_save = sum(LOW.head_bytes(64, 64, 64)) - sum(DOWN.head_bytes(64, 64, 64))
    # no spare bytes: each upgrade is paid by lowerings, only while it gains more than they cost
    p = profile([0.5, 0.01, 0.3, 0.0], [0.2, 0.001, 0.002, 0.003])
    a = allocate(p, 0.0, 1, 64, 64, 64)
    assert a.upgraded == (0,) and set(a.lowered) == {1, 2} and a.bytes_delta <= 1e-9
    assert a.formats[0] == UP and a.formats[3] == LOW
    assert a.predicted_gain == pytest.approx(0.5 - 0.003)
    # spare bytes from the uniform plan's int8 tokens pay upgrades first
    a = allocate(p, 2 * up_cost, 1, 64, 64, 64)
    assert a.upgraded == (0, 2) and a.lowered == () and a.bytes_delta <= 2 * up_cost
    # nothing gains: nothing moves
    a = allocate(profile([0.0, -1.0], [0.0, 0.0]), 10 * up_cost, 1, 64, 64, 64)
    assert a.formats == (LOW, LOW) and a.upgraded == a.lowered == ()
    assert down_save > 0


def test_plan_store_formats_and_byte_fit_at_equal_bytes():
    layout = KVLayout(4, 1, 64, 64)
    greedy = create_tier_policy("greedy")
    p = profile([0.5, 0.01, 0.3, 0.0], [0.2, 0.001, 0.002, 0.003])
    uniform, none = plan_store_formats(greedy, 0.3, "bytes", layout, 4, True, None)
    assert uniform.is_uniform and none is None
    formats, alloc = plan_store_formats(greedy, 0.3, "bytes", layout, 4, True, p)
    assert 0 in alloc.upgraded
    imp = torch.rand(800, generator=torch.Generator().manual_seed(0))
    lay = KVLayout(4, 1, 64, 64, formats=formats)
    tiers, _ = fit_byte_budget(greedy, imp, 0.3, lay, 4)
    assert assignment_bytes(tiers, lay) <= 0.3 * fp16_bytes(800, lay)
    kivi = create_tier_policy("kivi", layout=layout, budget=0.3)
    assert plan_store_formats(kivi, 0.3, "bytes", layout, 4, True, p)[0] == kivi.store_formats(0.3, layout)
    with pytest.raises(ValueError, match="layers"):
        plan_store_formats(greedy, 0.3, "bytes", KVLayout(5, 1, 64, 64), 4, True, p)


def test_profile_file_round_trip_and_bad_files(tmp_path):
    p = profile([0.5, 0.1], [0.2, 0.3])
    path = str(tmp_path / "p.json")
    p.save(path)
    assert LayerProfile.load(path) == p
    for bad in ({"num_layers": 2, "gain_up": [1.0], "loss_down": [1.0, 2.0]}, [1, 2], {"gain_up": []},
                {"num_layers": 1, "gain_up": ["NaN"], "loss_down": [0.0]}):
        with open(path, "w") as f:
            json.dump(bad, f)
        with pytest.raises(ValueError):
            LayerProfile.load(path)


def test_config_flags_validate(tmp_path):
    from sgl_kvxfer.config import EngineConfig, SchedulerConfig

    path = str(tmp_path / "p.json")
    profile([0.1], [0.1]).save(path)
    EngineConfig(kv_tier_budget=0.3, kv_layer_budget="profile", kv_layer_profile=path)
    EngineConfig(kv_tier_budget=0.3, kv_cold_tier=True, kv_promote_threshold=0.5, kv_promote_radius=0)
    bad = [dict(kv_layer_budget="profile"), dict(kv_layer_budget="layerwise"),
           dict(kv_layer_budget="profile", kv_layer_profile=str(tmp_path / "missing.json")),
           dict(kv_layer_profile=path), dict(kv_cold_tier=True, kv_tier_budget=1.0),
           dict(kv_promote_threshold=float("nan")), dict(kv_promote_threshold=0.0), dict(kv_promote_threshold=2.0),
           dict(kv_promote_interval=0), dict(kv_promote_layers=-1), dict(kv_promote_radius=-3),
           dict(kv_cold_tier_tokens=-1), dict(kv_promote_interval=2.5), dict(kv_promote_drop_run=-1),
           dict(kv_promote_drop_run=1.5), dict(kv_promote_drop_run=10 ** 9),
           dict(kv_promote_max_tokens=-1), dict(kv_promote_max_tokens=2.5), dict(kv_promote_max_tokens=float("nan")),
           dict(kv_tier_budget=0.3, kv_tier_policy="kivi", attention_backend="triton")]
    for kw in bad:
        kw = {"kv_tier_budget": 0.3, **kw}
        with pytest.raises(ValueError):
            EngineConfig(**kw)
    with open(path, "w") as f:
        f.write("{not json")
    with pytest.raises(ValueError, match="kv-layer-profile"):
        EngineConfig(kv_tier_budget=0.3, kv_layer_budget="profile", kv_layer_profile=path)
    with pytest.raises(ValueError, match="PD"):
        SchedulerConfig(engine=EngineConfig(kv_tier_budget=0.3, kv_cold_tier=True), disaggregation_mode="prefill",
                        disaggregation_transfer_backend="fake")
