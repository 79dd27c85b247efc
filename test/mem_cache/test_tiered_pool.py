"""Tiered pool family on CPU, no model: codec round trip per tier, slot routing, re-tiering,
byte accounting and store sizing, radix tiers, and masking of dropped tokens in attention."""
import pytest
import torch
import torch.nn.functional as F

from sgl_kvxfer.forward_batch import ForwardBatch, ForwardMode
from sgl_kvxfer.kernels.tier_codec import dequantize, quantize
from sgl_kvxfer.layers.attention.torch_backend import TorchAttentionBackend
from sgl_kvxfer.mem_cache.radix_cache import RadixCache
from sgl_kvxfer.mem_cache.tier_plan import TierStorePlan, plan_tier_stores
from sgl_kvxfer.mem_cache.tiered_allocator import TieredSlotAllocator
from sgl_kvxfer.mem_cache.tiered_pool import TieredKVPool
from sgl_kvxfer.spectrum.budget import KVLayout, assignment_bytes, fp16_bytes
from sgl_kvxfer.spectrum.byte_budget import assign_tiers, fit_byte_budget, planned_fractions, uses_int4
from sgl_kvxfer.spectrum.policies import TIER_POLICIES, create_tier_policy
from sgl_kvxfer.spectrum.tiers import TIER_DROP, TIER_FP16, TIER_INT4, TIER_INT8

L, H, D, G = 2, 2, 64, 32
PAGE = 4  # int-store page: small, so a few tokens span pages (the engine's is >= 16)


def make_pool(n16=16, n8=8, n4=8, dtype=torch.float32):
    pool = TieredKVPool(32, L, H, D, dtype, "cpu", TierStorePlan(n16, n8, n4), group_size=G, page_size=PAGE)
    return pool, TieredSlotAllocator(pool, "cpu")


def fill(pool, alloc, n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    slots = alloc.alloc(n)
    kv = [(torch.randn(n, H, D, generator=gen), torch.randn(n, H, D, generator=gen)) for _ in range(L)]
    for layer, (k, v) in enumerate(kv):
        pool.set_kv(layer, slots, k, v)
    return slots, kv


@pytest.mark.parametrize("tier", [TIER_FP16, TIER_INT8, TIER_INT4])
def test_round_trip_per_tier_matches_codec(tier):
    pool, alloc = make_pool()
    slots, kv = fill(pool, alloc, 6)
    new, got = alloc.retier(slots, torch.full((6,), tier, dtype=torch.int8))
    assert (got == tier).all() and (pool.tier_of(new) == tier).all()
    for layer, (k, v) in enumerate(kv):
        rk, rv = pool.get_kv(layer, new)
        if tier == TIER_FP16:
            assert torch.equal(rk, k) and torch.equal(rv, v)
            continue
        bits = 8 if tier == TIER_INT8 else 4
        assert torch.equal(rk, dequantize(*quantize(k, bits, G), bits, G, torch.float32))
        assert torch.equal(rv, dequantize(*quantize(v, bits, G), bits, G, torch.float32))
    alloc.debug_check()


def test_mixed_gather_any_shape_and_padding_row():
    pool, alloc = make_pool()
    slots, kv = fill(pool, alloc, 6)
    new, _ = alloc.retier(slots, torch.tensor([0, 1, 2, 1, 2, 0], dtype=torch.int8))
    k_all, _ = pool.get_kv(0, new)
    grid = torch.stack([new, torch.zeros_like(new)])  # [2, 6], second row = padding slot
    k_grid, v_grid = pool.get_kv(0, grid)
    assert k_grid.shape == (2, 6, H, D) and torch.equal(k_grid[0], k_all)
    assert not k_grid[1].any() and not v_grid[1].any()


def test_free_routing_slot0_and_fp16_reuse():
    pool, alloc = make_pool(n16=4, n8=4, n4=4)
    slots, _ = fill(pool, alloc, 4)
    assert alloc.available_size() == 0 and alloc.reclaimable(slots) == 4
    new, got = alloc.retier(slots, torch.tensor([1, 2, 3, 0], dtype=torch.int8))
    assert new[2] == 0 and got.tolist() == [1, 2, 3, 0]
    assert alloc.available_size() == 3  # three fp16 ids came back, the fp16 token stayed
    assert alloc.used_counts() == {TIER_FP16: 1, TIER_INT8: 1, TIER_INT4: 1}
    assert alloc.reclaimable(new) == 1 and alloc.count_tier(new, TIER_INT4) == 1
    alloc.free(new)  # slot 0 inside is skipped
    alloc.debug_check()
    assert alloc.available_size() == 4 and alloc.used_counts() == {0: 0, 1: 0, 2: 0}


def test_retier_never_raises_precision_and_falls_back_when_full():
    pool, alloc = make_pool(n16=16, n8=8, n4=4)
    slots, _ = fill(pool, alloc, 14)
    asked = []
    new, got = alloc.retier(slots, torch.full((14,), TIER_INT4, dtype=torch.int8),
                            make_room=lambda tier, n: asked.append((tier, n)))
    # 4 fit int4 (one page), 8 overflow into int8 (two pages), the last 2 stay fp16: in position order
    assert got.tolist() == [2] * 4 + [1] * 8 + [0] * 2 and asked == [(TIER_INT4, 10), (TIER_INT8, 2)]
    back, got2 = alloc.retier(new, torch.full((14,), TIER_FP16, dtype=torch.int8))
    assert torch.equal(back, new) and torch.equal(got2, got)
    # int tokens never move again (not even to a lower tier or to drop): that would punch a hole
    again, got3 = alloc.retier(new, torch.full((14,), TIER_DROP, dtype=torch.int8))
    assert torch.equal(again[:12], new[:12]) and (again[12:] == 0).all() and torch.equal(got3[:12], got[:12])
    alloc.debug_check()


def test_resident_bytes_per_token():
    pool, alloc = make_pool(n16=8, n8=8, n4=8, dtype=torch.bfloat16)
    full = pool.full_bytes_per_token()
    assert full == 2 * L * H * D * 2
    slots, _ = fill(pool, alloc, 8)
    assert pool.bytes_per_token() == full
    alloc.retier(slots, torch.full((8,), TIER_INT8, dtype=torch.int8))
    assert pool.bytes_per_token() / full == pytest.approx((D + 4 * D // G) / (2 * D))  # 0.5625


def test_plan_fits_memory_and_mix():
    b = (23040, 12960, 7200)  # SmolLM2 per-token bytes: bf16, int8, int4 (G=32)
    plan = plan_tier_stores(10000, b[0], b, (0.01, 0.74, 0.25, 0.0), staging=0.25)
    used = (plan.n16 + 1) * b[0] + plan.n8 * b[1] + plan.n4 * b[2]
    assert used <= 10000 * b[0] and used > 0.99 * 10000 * b[0]
    assert plan.n16 >= 2500 and plan.n8 == pytest.approx(3 * plan.n4, rel=0.05)
    assert plan.total > 10000  # the same memory holds more tokens


LAYOUT = KVLayout(30, 3, 64, 32)


@pytest.mark.parametrize("name", sorted(TIER_POLICIES))
@pytest.mark.parametrize("budget", [0.25, 0.3, 0.5, 0.55, 0.75])
def test_byte_budget_fits_every_policy(name, budget):
    policy = create_tier_policy(name)
    imp = torch.rand(500, generator=torch.Generator().manual_seed(1))
    tiers, cost_b = fit_byte_budget(policy, imp, budget, LAYOUT, 4, True, 0)
    assert assignment_bytes(tiers, LAYOUT) <= budget * fp16_bytes(500, LAYOUT) + 1e-6
    assert cost_b <= budget
    cost_tiers = assign_tiers(policy, imp, budget, LAYOUT, "cost", 4, True)
    assert torch.equal(cost_tiers, policy.assign(imp, budget, 4, True, 0))


def test_byte_budget_greedy_at_half():
    greedy = create_tier_policy("greedy")
    f16, f8, f4, fd = planned_fractions(greedy, 0.5, LAYOUT, "bytes", 0, True)
    assert (f16, fd) == (0.0, 0.0) and f8 == pytest.approx(0.75, abs=1e-3) and f4 == pytest.approx(0.25, abs=1e-3)
    assert planned_fractions(greedy, 0.5, LAYOUT, "cost", 0, True) == (0.0, 1.0, 0.0, 0.0)
    assert uses_int4(greedy) and not uses_int4(create_tier_policy("pdtrim"))
    assert not uses_int4(create_tier_policy("adaptive-2tier"))


def test_radix_records_tiers_and_evicts_by_store():
    pool, alloc = make_pool(n16=8, n8=8, n4=8)
    tree = RadixCache(alloc)
    slots, _ = fill(pool, alloc, 6)
    new, got = alloc.retier(slots, torch.tensor([0, 1, 1, 2, 3, 2], dtype=torch.int8))
    assert tree.insert([1, 2, 3, 4, 5, 6], new) == 0
    matched, node = tree.match_prefix([1, 2, 3, 4, 5, 6, 7])
    assert torch.equal(matched, new) and torch.equal(tree.match_tiers(node), got.to(torch.int8))
    free16 = alloc.available_size()
    # the leaf's two int4 ids were its page's only ones: the whole page (PAGE tokens) frees
    assert tree.evict(1, reclaim=alloc.page_reclaimer(TIER_INT4)) == PAGE
    assert alloc.available_size() == free16 + 1 and alloc.used_counts()[TIER_INT8] == 0
    alloc.debug_check()


def _decode_batch(row_slots):
    table = torch.zeros((1, 16), dtype=torch.int64)
    table[0, : row_slots.numel()] = row_slots
    n = row_slots.numel()
    return ForwardBatch(mode=ForwardMode.DECODE, input_ids=torch.zeros(1, dtype=torch.int64),
                        positions=torch.tensor([n - 1]), out_cache_loc=row_slots[-1:], req_pool_indices=torch.tensor([0]),
                        seq_lens=torch.tensor([n]), extend_prefix_lens=[n - 1], extend_seq_lens=[1], seq_lens_cpu=[n],
                        logits_positions=torch.tensor([0]), req_to_token=table)


def test_dropped_tokens_are_masked_not_zeroed():
    pool, alloc = make_pool()
    backend = TorchAttentionBackend(pool, num_q_heads=4, num_kv_heads=H, head_dim=D)
    slots, kv = fill(pool, alloc, 6)
    new, _ = alloc.retier(slots[:5], torch.tensor([0, 3, 0, 3, 0], dtype=torch.int8))
    row = torch.cat([new, slots[5:]])  # the newest token (its KV written by forward) stays
    q = torch.randn(1, 4, D, generator=torch.Generator().manual_seed(2))
    k_new, v_new = kv[0][0][5:], kv[0][1][5:]
    batch = _decode_batch(row)
    backend.prepare_metadata(batch)
    out = backend.forward(q, k_new, v_new, 0, batch)
    keep = [0, 2, 4, 5]
    k, v = kv[0][0][keep], kv[0][1][keep]
    ref = F.scaled_dot_product_attention(q[:, :, None, :], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         enable_gqa=True)[:, :, 0]
    assert torch.allclose(out, ref, atol=1e-5)
    zk, zv = kv[0][0].clone(), kv[0][1].clone()
    zk[[1, 3]] = 0
    zv[[1, 3]] = 0
    zeroed = F.scaled_dot_product_attention(q[:, :, None, :], zk.transpose(0, 1)[None], zv.transpose(0, 1)[None],
                                            enable_gqa=True)[:, :, 0]
    assert not torch.allclose(out, zeroed, atol=1e-3)


def test_config_flags_come_from_the_policy_registry():
    import argparse

    from sgl_kvxfer.config import EngineConfig, ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    action = next(a for a in parser._actions if a.dest == "kv_tier_policy")
    assert tuple(action.choices) == tuple(TIER_POLICIES)
    args = parser.parse_args(["--kv-tier-budget", "0.5", "--kv-tier-policy", "pdtrim", "--kv-budget-unit", "cost"])
    engine = ServerArgs.from_cli_args(args).engine
    assert (engine.kv_tier_budget, engine.kv_tier_policy, engine.kv_budget_unit) == (0.5, "pdtrim", "cost")
    assert engine.tiering_enabled and engine.resolved_attention_backend == "torch"
    with pytest.raises(ValueError):
        EngineConfig(kv_tier_budget=0.5, kv_tier_policy="nope")
    with pytest.raises(ValueError):
        EngineConfig(kv_tier_budget=0.5, page_size=16)
    assert not EngineConfig().tiering_enabled


def test_to_device_many_keeps_order_shapes_and_dtypes():
    """move's one staged copy: each tensor comes back equal, in its place, shape and dtype."""
    from sgl_kvxfer.mem_cache.tiered_pool import TieredKVPool

    xs = [torch.arange(5), torch.tensor([7, 3], dtype=torch.int32), torch.empty(0, dtype=torch.int64),
          torch.arange(6).view(2, 3), torch.tensor([9], dtype=torch.int32)]
    pool = TieredKVPool.__new__(TieredKVPool)  # only its device matters here
    pool.device = "cpu"
    out = pool._to_device_many(xs)
    assert len(out) == len(xs)
    for x, y in zip(xs, out):
        assert y.dtype == x.dtype and y.shape == x.shape and torch.equal(x, y)
    assert pool._to_device_many([]) == []


def test_tiered_default_backend_is_triton_on_cuda_only_where_its_kernels_apply():
    from sgl_kvxfer.config import EngineConfig

    assert EngineConfig(device="cuda", kv_tier_budget=0.5).resolved_attention_backend == "triton"
    assert EngineConfig(device="cuda", kv_tier_budget=0.5, dtype="bfloat16").resolved_attention_backend == "triton"
    assert EngineConfig(device="cuda", kv_tier_budget=0.5, dtype="float32").resolved_attention_backend == "torch"
    assert EngineConfig(device="cuda", kv_tier_budget=0.5, kv_tier_policy="kivi").resolved_attention_backend == "torch"
    assert EngineConfig(device="cpu", kv_tier_budget=0.5, dtype="bfloat16").resolved_attention_backend == "torch"
    assert EngineConfig(device="cuda", kv_tier_budget=0.5, attention_backend="torch").resolved_attention_backend == "torch"
