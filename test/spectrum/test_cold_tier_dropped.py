"""The cold tier brings dropped tokens back (CPU, no model): a dropped token keeps its exact fp16
K/V in host memory, comes back next to an int4 hit (radius rule), lands in a fresh fp16 slot that
decode attention reads from then on, and release gives every slot and host row back."""
import gc
from types import SimpleNamespace

import torch

from sgl_kvxfer.forward_batch import ForwardMode
from sgl_kvxfer.layers.attention.torch_backend import TorchAttentionBackend
from sgl_kvxfer.mem_cache.req_to_token import ReqToTokenPool
from sgl_kvxfer.mem_cache.tier_plan import TierStorePlan
from sgl_kvxfer.mem_cache.tiered_allocator import TieredSlotAllocator
from sgl_kvxfer.mem_cache.tiered_pool import TieredKVPool
from sgl_kvxfer.scheduler.cold_tier import ColdTier
from sgl_kvxfer.spectrum.tiers import TIER_DROP, TIER_FP16, TIER_INT4, TIER_INT8

L, HQ, H, D, PAGE, N = 3, 4, 2, 32, 8, 40
DROPPED = list(range(14, 18))  # a hit at 13 with radius 2 brings back 14 and 15, not 16 and 17


class Req:  # weak-referenceable, like the scheduler's Req
    def __init__(self, row, n):
        self.req_pool_idx, self.kv_len, self.finished_reason = row, n, None


def tier_map(fp16_at=()):
    tiers = torch.full((N,), TIER_INT4, dtype=torch.int8)
    tiers[:2], tiers[30:] = TIER_FP16, TIER_INT8
    tiers[DROPPED] = TIER_DROP
    tiers[list(fp16_at)] = TIER_FP16
    return tiers


def build(tiers, cold_tier=True, threshold=0.3, radius=2, capacity=64, drop_run=0):
    pool = TieredKVPool(128, L, H, D, torch.float32, "cpu", TierStorePlan(96, 32, 64), group_size=D, page_size=PAGE)
    alloc = TieredSlotAllocator(pool, "cpu")
    backend = TorchAttentionBackend(pool, HQ, H, D)
    table = ReqToTokenPool(4, 256)
    cold = None
    if cold_tier:
        runner = SimpleNamespace(kv_pool=pool, attn_backend=backend, max_running_requests=4, graph_runner=None)
        config = SimpleNamespace(kv_promote_threshold=threshold, kv_promote_interval=1, kv_promote_radius=radius,
                                 kv_cold_tier_tokens=capacity, kv_promote_layers=2, kv_promote_drop_run=drop_run)
        cold = ColdTier(config, runner, alloc, table, lambda tier, n: None)
    gen = torch.Generator().manual_seed(0)
    data = [(torch.randn(N, H, D, generator=gen), torch.randn(N, H, D, generator=gen)) for _ in range(L)]
    slots = alloc.alloc(N)
    for layer, (k, v) in enumerate(data):
        pool.set_kv(layer, slots, k, v)
    req = Req(0, N)
    if cold is not None:  # what EngineTiering does before each retier
        cold.keep_dropped(req, 0, slots, tiers)
    new, _ = alloc.retier(slots, tiers)
    table.write(0, 0, new)
    return SimpleNamespace(cold=cold, pool=pool, alloc=alloc, table=table, backend=backend, data=data, req=req,
                           row=new.clone())


def aim(cold, data, pos, scale=30.0):
    """Every probed layer's tapped query points each head at token `pos`'s key."""
    for layer in cold.layers:
        k = data[layer][0][pos]
        q = k.repeat_interleave(HQ // H, 0) / k.norm(dim=-1).repeat_interleave(HQ // H, 0)[:, None] * scale
        cold.taps[layer][0] = q


def decode(t, q):
    """One decode step of the request through the torch backend (a new token at position N, in a
    fresh fp16 slot given back afterwards): every layer's output [HQ, D]."""
    loc = t.alloc.alloc(1)
    t.table.write(0, N, loc)
    batch = SimpleNamespace(mode=ForwardMode.DECODE, req_to_token=t.table.table,
                            req_pool_indices=torch.tensor([0]), seq_lens_cpu=[N + 1], seq_lens=torch.tensor([N + 1]),
                            out_cache_loc=loc)
    t.backend.prepare_metadata(batch)
    outs = [t.backend.forward(q[None], t.data[layer][0][:1], t.data[layer][1][:1], layer, batch)[0]
            for layer in range(L)]
    t.table.write(0, N, torch.zeros(1, dtype=torch.int64))
    t.alloc.free(loc)
    return outs


def query_at(data, pos, scale=4.0):
    k = data[0][0][pos]
    return k.repeat_interleave(HQ // H, 0) * scale


def test_dropped_tokens_keep_exact_host_copies():
    t = build(tier_map())
    state = t.cold.states[t.req]
    assert sorted(state.dropped) == DROPPED and (t.row[DROPPED] == 0).all()
    rows = torch.tensor([state.dropped[p] for p in DROPPED])
    for layer, (k, v) in enumerate(t.data):
        assert torch.equal(t.cold.store.k_host[layer][rows], k[DROPPED])
        assert torch.equal(t.cold.store.v_host[layer][rows], v[DROPPED])
    store = t.cold.store.stats
    assert store["dropped_copies"] == len(DROPPED)
    assert store["dropped_bytes_d2h"] == 2 * L * len(DROPPED) * H * D * 4
    assert t.cold.store.rows_in_use == 24 + len(DROPPED)  # the int4 tokens (2..13, 18..29) and the dropped


def test_dropped_token_near_a_hit_comes_back_exact_and_is_attended():
    t = build(tier_map())
    used0, rows0 = t.alloc.used_counts(), t.cold.store.rows_in_use
    q = query_at(t.data, 14)
    before = decode(t, q)
    aim(t.cold, t.data, 13)
    t.cold.on_decode(SimpleNamespace(slices=[SimpleNamespace(req=t.req)]))
    now = t.table.read(0, N).cpu()
    stats = t.cold.stats
    assert stats["promoted_tokens"] == 5 and stats["restored_dropped"] == 2  # int4 11..13, dropped 14, 15
    assert stats["restored_dropped_bytes_h2d"] == 2 * 2 * L * H * D * 4
    assert (t.pool.tier_of(now[11:16]) == TIER_FP16).all() and (now[16:18] == 0).all()
    for layer, (k, v) in enumerate(t.data):  # exact fp16 values in the fresh slots
        kk, vv = t.pool.get_kv(layer, now[14:16])
        assert torch.equal(kk, k[14:16]) and torch.equal(vv, v[14:16])
    after = decode(t, q)
    # the same request where 11..15 were never demoted or dropped: identical attention output
    ref = build(tier_map(fp16_at=range(11, 16)), cold_tier=False)
    expect = decode(ref, q)
    for a, b, e in zip(before, after, expect):
        assert torch.allclose(b, e, atol=1e-6, rtol=0)
        assert not torch.allclose(a, e, atol=1e-3, rtol=0)  # the dropped token mattered
    t.cold.release_request(t.req)
    assert torch.equal(t.table.read(0, N).cpu(), t.row)  # slot 0 back where the tokens were dropped
    assert t.alloc.used_counts() == used0
    assert t.cold.store.rows_in_use == rows0 - len(DROPPED)  # the request's dropped copies are gone
    t.alloc.free(t.row)
    assert t.cold.store.rows_in_use == 0
    t.alloc.debug_check()


def test_dropped_tokens_far_from_a_hit_stay_dropped():
    t = build(tier_map(), radius=0)
    aim(t.cold, t.data, 13)
    t.cold.on_decode(SimpleNamespace(slices=[SimpleNamespace(req=t.req)]))
    assert t.cold.stats["restored_dropped"] == 0 and (t.table.read(0, N).cpu()[DROPPED] == 0).all()


def test_a_dropped_run_next_to_the_pick_comes_back_up_to_the_cap():
    from sgl_kvxfer.spectrum.decode_mass import extend_runs

    t = build(tier_map(), radius=2, drop_run=1)  # radius: 14, 15; the run: 16; the cap stops at 17
    aim(t.cold, t.data, 13)
    t.cold.on_decode(SimpleNamespace(slices=[SimpleNamespace(req=t.req)]))
    now = t.table.read(0, N).cpu()
    assert t.cold.stats["restored_dropped"] == 3 and (now[14:17] != 0).all() and int(now[17]) == 0
    t = build(tier_map(), radius=0, drop_run=8)  # the whole run 14..17 touches the hit at 13
    aim(t.cold, t.data, 13)
    t.cold.on_decode(SimpleNamespace(slices=[SimpleNamespace(req=t.req)]))
    now = t.table.read(0, N).cpu()
    assert t.cold.stats["restored_dropped"] == 4 and (t.pool.tier_of(now[13:18]) == TIER_FP16).all()
    for layer, (k, v) in enumerate(t.data):
        kk, vv = t.pool.get_kv(layer, now[14:18])
        assert torch.equal(kk, k[14:18]) and torch.equal(vv, v[14:18])
    used = t.alloc.used_counts()
    t.cold.release_request(t.req)
    assert torch.equal(t.table.read(0, N).cpu(), t.row) and t.alloc.used_counts()[TIER_FP16] == used[TIER_FP16] - 5
    picked = torch.tensor([0, 0, 1, 0, 0, 0, 0, 1, 0], dtype=torch.bool)
    run = torch.tensor([1, 1, 0, 1, 1, 1, 0, 0, 1], dtype=torch.bool)
    assert extend_runs(picked, run, 2).tolist() == [1, 1, 1, 1, 1, 0, 0, 1, 1]


def test_a_request_gone_without_release_frees_its_rows():
    t = build(tier_map())
    rows0 = t.cold.store.rows_in_use
    t.req = None
    gc.collect()
    t.cold.on_decode(SimpleNamespace(slices=[]))
    assert t.cold.store.rows_in_use == rows0 - len(DROPPED)


def test_full_host_store_copies_the_dropped_tokens_that_fit():
    t = build(tier_map(), capacity=2)  # the drops are copied before the int4 demotion: 14, 15 fit
    store = t.cold.store.stats
    assert store["dropped_copies"] == 2 and store["host_copies"] == 0 and store["host_full_skips"] == 2 + 24
    assert sorted(t.cold.states[t.req].dropped) == [14, 15]
    aim(t.cold, t.data, 13)  # 13 has no host copy: it is not a candidate, so nothing is hit
    t.cold.on_decode(SimpleNamespace(slices=[SimpleNamespace(req=t.req)]))
    assert t.cold.stats["restored_dropped"] == 0
    t.cold.release_request(t.req)
    assert t.cold.store.rows_in_use == 0


def test_without_the_cold_tier_nothing_changes():
    on = build(tier_map(), threshold=1.0)  # kept copies, never fires
    off = build(tier_map(), cold_tier=False)
    assert torch.equal(on.row, off.row) and off.pool.cold is None
    on.cold.on_decode(SimpleNamespace(slices=[SimpleNamespace(req=on.req)]))
    q = query_at(on.data, 20)
    for a, b in zip(decode(on, q), decode(off, q)):
        assert torch.equal(a, b)
