"""The cold tier on CPU, no model: host copies at demotion, scoring a tapped decode query,
promotion to exact fp16, the prefix-fill repair, and giving the row back."""
from types import SimpleNamespace

import pytest
import torch

from sgl_kvxfer.layers.attention.torch_backend import TorchAttentionBackend
from sgl_kvxfer.mem_cache.req_to_token import ReqToTokenPool
from sgl_kvxfer.mem_cache.tier_plan import TierStorePlan
from sgl_kvxfer.mem_cache.tiered_allocator import TieredSlotAllocator
from sgl_kvxfer.mem_cache.tiered_pool import TieredKVPool
from sgl_kvxfer.scheduler.cold_tier import ColdTier
from sgl_kvxfer.spectrum.decode_mass import expand_hits, head_max_mass
from sgl_kvxfer.spectrum.query_taps import probe_layers
from sgl_kvxfer.spectrum.tiers import TIER_FP16, TIER_INT4, TIER_INT8

L, HQ, H, D, PAGE, N = 3, 4, 2, 32, 8, 40


class Req:  # weak-referenceable, like the scheduler's Req
    def __init__(self, row, n):
        self.req_pool_idx, self.kv_len, self.finished_reason = row, n, None


def setup(threshold=0.3, radius=1, interval=1, capacity=64, fused=False, max_tokens=0):
    pool = TieredKVPool(128, L, H, D, torch.float32, "cpu", TierStorePlan(96, 32, 64), group_size=D, page_size=PAGE)
    pool._fused_quantize = fused  # True: fp16 -> int through the quantize-and-store kernel (as on CUDA)
    alloc = TieredSlotAllocator(pool, "cpu")
    backend = TorchAttentionBackend(pool, HQ, H, D)
    runner = SimpleNamespace(kv_pool=pool, attn_backend=backend, max_running_requests=4, graph_runner=None)
    config = SimpleNamespace(kv_promote_threshold=threshold, kv_promote_interval=interval, kv_promote_radius=radius,
                             kv_cold_tier_tokens=capacity, kv_promote_layers=2,
                             kv_promote_max_tokens=max_tokens)
    table = ReqToTokenPool(4, 256)
    cold = ColdTier(config, runner, alloc, table, lambda tier, n: None)
    gen = torch.Generator().manual_seed(0)
    data = [(torch.randn(N, H, D, generator=gen), torch.randn(N, H, D, generator=gen)) for _ in range(L)]
    slots = alloc.alloc(N)
    for layer, (k, v) in enumerate(data):
        pool.set_kv(layer, slots, k, v)
    tiers = torch.full((N,), TIER_INT4, dtype=torch.int8)
    tiers[:2], tiers[30:] = TIER_FP16, TIER_INT8  # sinks fp16, a few int8
    new, _ = alloc.retier(slots, tiers)
    req = Req(0, N)
    table.write(0, 0, new)
    return cold, pool, alloc, table, data, req, new.clone()


def aim(cold, data, pos, scale=30.0):
    """Every probed layer's tapped query points each head at token `pos`'s key."""
    for layer in cold.layers:
        k = data[layer][0][pos]  # [H, D]
        q = k.repeat_interleave(HQ // H, 0) / k.norm(dim=-1).repeat_interleave(HQ // H, 0)[:, None] * scale
        cold.taps[layer][0] = q


def test_mass_and_neighbours():
    q = torch.zeros(HQ, D)
    q[0, 0] = 50.0
    keys = torch.zeros(5, H, D)
    keys[3, 0, 0] = 1.0
    m = head_max_mass(q, keys, 1.0)
    assert m.argmax() == 3 and float(m[3]) > 0.99
    assert float(head_max_mass(q, keys, 1.0, torch.tensor([1, 1, 1, 0, 1], dtype=torch.bool))[3]) == 0.0
    hot = torch.tensor([0, 0, 1, 0, 0, 0], dtype=torch.bool)
    ok = torch.tensor([1, 1, 1, 1, 0, 1], dtype=torch.bool)
    assert expand_hits(hot, ok, 2).tolist() == [True, True, True, True, False, False]
    assert probe_layers(30, 2) == [10, 20] and probe_layers(30, 3, [7, 1, 2, 9]) == [1, 2, 7]


@pytest.mark.parametrize("fused", [False, True])
def test_demotion_keeps_host_copies_and_frees_them(fused):
    if fused:  # the kernel path CUDA takes, under Triton's CPU interpreter
        if torch.cuda.is_available():  # turning the interpreter on mid-process would break every later GPU test
            pytest.skip("the interpreter variant runs on CPU hosts; a GPU host compiles the kernel "
                        "(test_promotion_on_cuda_is_async_and_exact)")
        from sgl_kvxfer.utils.triton_cpu import use_interpreter_on_cpu

        use_interpreter_on_cpu("cpu")
    cold, pool, alloc, table, data, req, row = setup(fused=fused)
    assert cold.store.stats["host_copies"] == 28  # the int4 tokens: positions 2..29
    rows = cold.store.rows_for(row[2:30])
    assert (rows >= 0).all()
    for layer, (k, v) in enumerate(data):
        assert torch.equal(cold.store.k_host[layer][rows], k[2:30])
    alloc.free(row)
    assert cold.store.rows_in_use == 0


def test_promotion_lands_exact_fp16_and_row_is_given_back():
    cold, pool, alloc, table, data, req, row = setup()
    used0 = alloc.used_counts()
    aim(cold, data, 13)
    batch = SimpleNamespace(slices=[SimpleNamespace(req=req)])
    cold.on_decode(batch)
    now = table.read(0, N).cpu()
    assert cold.stats["promoted_tokens"] == 3 and cold.stats["landed"] == 3
    assert (pool.tier_of(now[12:15]) == TIER_FP16).all()
    for layer, (k, v) in enumerate(data):  # the promoted tokens are exact
        kk, vv = pool.get_kv(layer, now[12:15])
        assert torch.equal(kk, k[12:15]) and torch.equal(vv, v[12:15])
        kk, _ = pool.get_kv(layer, now[:12])  # the rest reads as before (bit-exact page copies)
        k0, _ = pool.get_kv(layer, row[:12])
        assert torch.equal(kk, k0)
    assert not alloc.holed_pages(now).any()  # the row sees every int page as slots [0, fill)
    assert cold.stats["repacked_tokens"] > 0
    # a second pass does not promote the same tokens again
    cold.on_decode(batch)
    assert cold.stats["promoted_tokens"] == 3
    cold.release_request(req)
    assert torch.equal(table.read(0, N).cpu(), row)
    assert alloc.used_counts() == used0
    alloc.debug_check()


def test_threshold_one_never_promotes_and_interval_skips_steps():
    cold, pool, alloc, table, data, req, row = setup(threshold=1.0)
    aim(cold, data, 13, scale=1.0)
    cold.on_decode(SimpleNamespace(slices=[SimpleNamespace(req=req)]))
    assert cold.stats["promoted_tokens"] == 0 and cold.stats["scoring_passes"] == 1
    cold, pool, alloc, table, data, req, row = setup(interval=3)
    aim(cold, data, 20)
    batch = SimpleNamespace(slices=[SimpleNamespace(req=req)])
    for _ in range(4):
        cold.on_decode(batch)
    assert cold.stats["scoring_passes"] == 2  # steps 1 and 4 of the request


def test_full_host_store_copies_what_fits():
    cold, pool, alloc, table, data, req, row = setup(capacity=10)
    assert cold.store.stats["host_copies"] == 10 and cold.store.stats["host_full_skips"] == 18
    aim(cold, data, 25)  # no copy for position 25: nothing to promote
    cold.on_decode(SimpleNamespace(slices=[SimpleNamespace(req=req)]))
    assert cold.stats["promoted_tokens"] == 0


def cuda_setup():
    """A CUDA tiered pool whose N tokens all sit in int4 (one request's row), and its cold tier:
    (pool, alloc, table, cold, the tokens' K = V, their int4 ids, the request)."""
    pool = TieredKVPool(128, L, H, D, torch.float16, "cuda", TierStorePlan(96, 32, 64), group_size=D, page_size=PAGE)
    alloc = TieredSlotAllocator(pool, "cuda")
    runner = SimpleNamespace(kv_pool=pool, attn_backend=TorchAttentionBackend(pool, HQ, H, D), max_running_requests=4,
                             graph_runner=None)
    config = SimpleNamespace(kv_promote_threshold=0.3, kv_promote_interval=1, kv_promote_radius=0,
                             kv_cold_tier_tokens=64, kv_promote_layers=2)
    table = ReqToTokenPool(4, 256, "cuda")
    cold = ColdTier(config, runner, alloc, table, lambda tier, n: None)
    k = torch.randn(N, H, D, device="cuda", dtype=torch.float16)
    slots = alloc.alloc(N)
    for layer in range(L):
        pool.set_kv(layer, slots, k, k)
    new, _ = alloc.retier(slots.cpu(), torch.full((N,), TIER_INT4, dtype=torch.int8))
    table.write(0, 0, new.cuda())
    return pool, alloc, table, cold, k, new, Req(0, N)


def assert_landed_exact(cold, pool, table, k, new, req):
    """Position 7 landed once, back in fp16 with its exact K; releasing the row gives back its
    int4 ids (`new`), as before the promotion."""
    now = table.read(0, N).cpu()
    assert cold.stats["landed"] == 1 and int(pool.tier_of(now[7:8])) == TIER_FP16
    kk, _ = pool.get_kv(0, now[7:8].cuda())
    assert torch.equal(kk, k[7:8])
    cold.release_request(req)
    assert torch.equal(table.read(0, N).cpu(), new.cpu())


@pytest.mark.gpu
def test_promotion_on_cuda_is_async_and_exact():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pool, alloc, table, cold, k, new, req = cuda_setup()
    for layer in cold.layers:
        cold.taps[layer][0] = (k[7] / k[7].norm(dim=-1, keepdim=True) * 30).repeat_interleave(HQ // H, 0)
    batch = SimpleNamespace(slices=[SimpleNamespace(req=req)])
    cold.on_decode(batch)
    cold.wait_copies()  # the copy job runs on the worker thread
    torch.cuda.synchronize()
    from sgl_kvxfer.kernels.tier_relocate import relocate_codes

    where = [t.cuda() for t in pool.page_offset(TIER_INT4, new[:1].cpu())]
    relocate_codes(pool.stores[TIER_INT4][0], *where, *where)  # compiled before the window below (a no-op move)
    torch.cuda.synchronize()
    torch.cuda._sleep(1_000_000_000)  # a long "forward" on the compute stream
    busy = torch.cuda.Event()
    busy.record()
    cold.prepare()  # as the scheduler does while the next forward runs: planned and applied behind it
    assert not busy.query()  # it did not wait for the device
    assert cold._prepared is None and cold.stats["landed"] == 1
    cold.land_prepared()  # after that forward: the deferred frees
    assert_landed_exact(cold, pool, table, k, new, req)


def test_a_held_pass_reads_the_taps_of_its_step_and_holds_the_landing():
    """hold (the next step launches before this one is applied, scheduler/overlap.py): the pass
    reads the taps as they were at hold, not what the next forward writes into them, and the
    landing hooks of the next forward's window and of this step's apply (prepare, land_prepared)
    land nothing until the pass has run."""
    cold, pool, alloc, table, data, req, row = setup(interval=1)
    batch = SimpleNamespace(slices=[SimpleNamespace(req=req)])
    aim(cold, data, 13)
    cold._score(batch, [0])  # a promotion waiting to land (off CUDA its copy is done at once)
    assert len(cold.pending) == 1 and cold.stats["landed"] == 0
    aim(cold, data, 22)  # this step's queries
    cold.hold(batch)
    aim(cold, data, 5)  # the next forward's queries overwrite the taps
    cold.prepare()
    cold.land_prepared()
    assert len(cold.pending) == 1 and cold.stats["landed"] == 0 and cold._prepared is None
    cold.on_decode(batch)  # the held pass; off CUDA on_decode lands in program order
    assert cold._held is None and not cold.pending
    assert cold.states[req].promoted == {12, 13, 14, 21, 22, 23} and cold.stats["landed"] == 6
    cold.hold(SimpleNamespace(slices=[]))  # nothing due: nothing held
    assert cold._held is None
    cold.release_request(req)
    assert torch.equal(table.read(0, N).cpu(), row)
    alloc.debug_check()


@pytest.mark.gpu
def test_held_pass_on_cuda_runs_beside_the_next_forward():
    """CUDA: a pass held before the next launch (as Scheduler._step_overlapped does) reads the
    taps copied at hold, runs on the side stream and reads its picks back while a long kernel
    (the next forward, which overwrites the taps) still runs on the compute stream; its fp16 ids
    reach the host behind that kernel; the promotion then lands exact."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pool, alloc, table, cold, k, new, req = cuda_setup()
    batch = SimpleNamespace(slices=[SimpleNamespace(req=req)])

    def aim_cuda(pos):
        for layer in cold.layers:
            cold.taps[layer][0] = (k[pos] / k[pos].norm(dim=-1, keepdim=True) * 30).repeat_interleave(HQ // H, 0)
    block, lens, *_ = cold._due_block([req])
    cold._mass(pool._to_device(torch.tensor([0])), block, lens)  # the scoring kernel compiled before the window
    torch.cuda.synchronize()
    aim_cuda(7)  # this step's queries
    cold.hold(batch)
    aim_cuda(20)  # the next forward's, on the compute stream behind hold's copy
    torch.cuda._sleep(1_000_000_000)  # the rest of that forward
    busy = torch.cuda.Event()
    busy.record()
    cold.prepare()  # the next forward's window: held, no landing
    cold.on_decode(batch)
    assert not busy.query()  # the pass read back without waiting for the compute stream
    assert cold.stats["promotions"] == 1 and cold.states[req].promoted == {7}
    cold.wait_copies()
    torch.cuda.synchronize()
    cold.prepare()
    cold.land_prepared()
    assert_landed_exact(cold, pool, table, k, new, req)


def test_no_room_for_the_page_repair_keeps_the_row():
    cold, pool, alloc, table, data, req, row = setup()
    # int stores: allocate every free page; fp16: leave exactly the 3 slots the promotion takes
    for tier in (TIER_INT8, TIER_INT4):
        alloc.alloc_tier(tier, alloc.available_tier(tier))
    hog = alloc.alloc(alloc.available_size() - 3)
    used = alloc.used_counts()
    aim(cold, data, 13)
    cold.on_decode(SimpleNamespace(slices=[SimpleNamespace(req=req)]))
    assert cold.stats["no_room"] == 1 and cold.stats["landed"] == 0
    assert torch.equal(table.read(0, N).cpu(), row) and alloc.used_counts() == used
    assert not cold.states[req].promoted  # scored again at a later pass
    alloc.free(hog)
    cold.on_decode(SimpleNamespace(slices=[SimpleNamespace(req=req)]))  # interval 1: scored again, now it fits
    assert cold.stats["landed"] == 3


class _CountTorchOps(torch.overrides.TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.ops.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


def _second_request(cold, pool, alloc, table, data, pos_row=1):
    """Another request on table row `pos_row` with the same K/V and tiers as setup's."""
    slots = alloc.alloc(N)
    for layer, (k, v) in enumerate(data):
        pool.set_kv(layer, slots, k, v)
    tiers = torch.full((N,), TIER_INT4, dtype=torch.int8)
    tiers[:2], tiers[30:] = TIER_FP16, TIER_INT8
    new, _ = alloc.retier(slots, tiers)
    table.write(pos_row, 0, new)
    return Req(pos_row, N), new.clone()


def test_a_pass_stages_every_promotion_in_one_copy_and_idle_steps_run_no_torch_op():
    """The cold tier must not stall decode: a scoring pass over several requests batches its
    host traffic (one host-store gather and one fp16 store write per layer for all of them; the
    pass reads no row block to the host, only the landing does), and a step with no pass due and
    nothing pending runs no torch op at all in the decode hook."""
    cold, pool, alloc, table, data, req, row = setup(interval=4)
    req2, row2 = _second_request(cold, pool, alloc, table, data)
    aim(cold, data, 13)
    for layer in cold.layers:  # the second request's query points at the same key
        cold.taps[layer][1] = cold.taps[layer][0]
    calls = {"gather": 0, "set_kv_fp16": 0, "mirror_block": 0, "read_block": 0, "move": 0}
    for obj, name in ((cold.store, "gather"), (pool, "set_kv_fp16"), (cold, "_mirror_block"), (cold, "_read_block"),
                      (pool, "move")):
        real = getattr(obj, name)

        def counted(*a, _real=real, _name=name.lstrip("_"), **kw):
            calls[_name] += 1
            return _real(*a, **kw)

        setattr(obj, name, counted)
    batch = SimpleNamespace(slices=[SimpleNamespace(req=req), SimpleNamespace(req=req2)])
    cold.on_decode(batch)  # step 0 of both: a pass
    assert cold.stats["scoring_passes"] == 1 and cold.stats["promotions"] == 2 and cold.stats["landed"] == 6
    assert cold.stats["staging_copies"] == 1
    assert calls["gather"] == 1 and calls["set_kv_fp16"] == L
    assert calls["mirror_block"] == 1 and calls["read_block"] == 0  # the landing rows from the host mirrors
    # both rows' page repairs (12..14 punch holes in int4 pages) in one move over the layers
    assert calls["move"] == 1 and cold.stats["repack_moves"] == 1 and cold.stats["repacked_tokens"] > 0
    for r, rid in ((req, 0), (req2, 1)):  # both promotions landed exact
        now = table.read(rid, N).cpu()
        assert (pool.tier_of(now[12:15]) == TIER_FP16).all()
        for layer, (k, _) in enumerate(data):
            assert torch.equal(pool.get_kv(layer, now[12:15])[0], k[12:15])
        assert not alloc.holed_pages(now).any()
    with _CountTorchOps() as mode:  # steps 1..3: no pass due, nothing pending
        for _ in range(3):
            cold.prepare()
            cold.land_prepared()
            cold.on_decode(batch)
            cold.land()
    assert mode.ops == [] and cold.stats["scoring_passes"] == 1
    for r in (req, req2):
        cold.release_request(r)
    assert torch.equal(table.read(0, N).cpu(), row) and torch.equal(table.read(1, N).cpu(), row2)
    alloc.debug_check()


def test_cap_promotes_the_strongest_stretch_first_and_keeps_the_rest_for_later():
    """kv_promote_max_tokens bounds a pass: the stretch around the strongest hit goes first, cut
    to the cap around its hit; what is left is not marked promoted, so later passes take it (the
    promoted hit, still hot, brings its neighbours)."""
    cold, pool, alloc, table, data, req, row = setup(radius=1, max_tokens=2)
    g = HQ // H
    for layer in cold.layers:  # kv head 0's query heads at 13 (strong), kv head 1's at 22 (weaker)
        q = torch.zeros(HQ, D)
        for h, (pos, scale) in enumerate(((13, 40.0), (22, 15.0))):
            k = data[layer][0][pos][h]
            q[h * g:(h + 1) * g] = k / k.norm() * scale
        cold.taps[layer][0] = q
    batch = SimpleNamespace(slices=[SimpleNamespace(req=req)])
    cold.on_decode(batch)
    assert cold.stats["landed"] == 2 and cold.stats["capped_tokens"] == 1 + 3  # 12..14 cut to 2, 21..23 left
    assert 13 in cold.states[req].promoted and len(cold.states[req].promoted) == 2
    now = table.read(0, N).cpu()
    assert not alloc.holed_pages(now).any()
    # the repaired page's int4 copies (14, 15 moved off the holed page) share the host rows of
    # the ids they copy, so they stay promotable
    assert (pool.tier_of(now[14:16]) == TIER_INT4).all() and (cold.store.rows_for(now[14:16]) >= 0).all()
    for _ in range(3):  # later passes: the rest, at most 2 a pass
        before = cold.stats["landed"]
        cold.on_decode(batch)
        assert cold.stats["landed"] - before <= 2
        assert not alloc.holed_pages(table.read(0, N).cpu()).any()
    now = table.read(0, N).cpu()
    for pos in (12, 13, 14, 21, 22, 23):  # every one back at fp16, exact: promoted, or repaired
        assert int(pool.tier_of(now[pos:pos + 1])) == TIER_FP16
    assert {13, 22} <= cold.states[req].promoted
    for layer, (k, _) in enumerate(data):
        assert torch.equal(pool.get_kv(layer, now[[13, 22]])[0], k[[13, 22]])
    cold.release_request(req)
    assert torch.equal(table.read(0, N).cpu(), row)
    alloc.debug_check()


def test_batched_mass_is_each_rows_own_softmax():
    """The pass scores every due request in one padded block: row b of the batched mass equals
    the single-request mass over its own keys, whatever the padding holds."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(3, HQ, D, generator=gen)
    keys = torch.randn(3, 7, H, D, generator=gen)
    lens = [7, 4, 1]
    valid = torch.arange(7)[None, :] < torch.tensor(lens)[:, None]
    valid[0, 2] = False  # a dropped key inside a row
    keys[1, 4:] = 1e3  # padding that would dominate a softmax it leaked into
    m = head_max_mass(q, keys, 0.5, valid)
    for b, n in enumerate(lens):
        ref = head_max_mass(q[b], keys[b, :n], 0.5, valid[b, :n])
        assert torch.allclose(m[b, :n], ref, atol=1e-6) and (m[b, n:] == 0).all()
    assert float(m[0, 2]) == 0.0


class _NotDone:
    def __init__(self):
        self.done = False

    def query(self):
        return self.done


def test_landing_is_planned_on_host_mirrors_that_follow_demotion():
    """prepare() (while the decode forward runs) plans the landing from the host mirror of the
    row alone and, where the repair copies fit the int stores' free pages, applies it: no read of
    the device table, no fp16 allocation, no free (all may sync on CUDA); else it leaves the plan
    to land_prepared() (after the forward). The mirror follows the landing's rewrite and decode demotion's (note_rows; queued while the
    snapshot is still being copied), so a later landing on tokens demoted after the first pass
    is exact and leaves no holed page."""
    cold, pool, alloc, table, data, req, row = setup(interval=1)
    aim(cold, data, 13)
    batch = SimpleNamespace(slices=[SimpleNamespace(req=req)])
    cold._score(batch, [0])  # issue only (off CUDA the copy is done at once)
    state = cold.states[req]
    assert state.row is not None and torch.equal(state.row[:N], row)

    def forbidden(*a, **k):
        raise AssertionError("prepare must not touch the allocator or the device table")

    saved = {name: getattr(alloc, name) for name in ("alloc", "free", "available_size")}
    for name in saved:
        setattr(alloc, name, forbidden)
    cold._read_block = forbidden
    cold.prepare()
    for name, real in saved.items():
        setattr(alloc, name, real)
    del cold._read_block
    assert cold._prepared is None and cold.stats["landed"] == 3  # landed in the forward's window
    cold.land_prepared()
    now = table.read(0, N).cpu()
    assert cold.stats["landed"] == 3 and (pool.tier_of(now[12:15]) == TIER_FP16).all()
    assert torch.equal(state.row[:N], now) and not alloc.holed_pages(now).any()

    # decode: 8 new tokens, then demoted to int4 while the next pass's snapshot would still be in flight
    gen = torch.Generator().manual_seed(1)
    extra = [(torch.randn(8, H, D, generator=gen), torch.randn(8, H, D, generator=gen)) for _ in range(L)]
    slots = alloc.alloc(8)
    for layer, (k, v) in enumerate(extra):
        pool.set_kv(layer, slots, k, v)
    table.write(0, N, slots)
    req.kv_len = N + 8
    fake = _NotDone()
    state.row_copy = fake  # as on CUDA: the mirror's snapshot is not in yet, writes queue
    new, _ = alloc.retier(slots, torch.full((8,), TIER_INT4, dtype=torch.int8))
    table.write(0, N, new)
    cold.note_rows(req, N, new)
    assert len(state.patches) == 1
    data2 = [(torch.cat([k, k2]), torch.cat([v, v2])) for (k, v), (k2, v2) in zip(data, extra)]
    aim(cold, data2, N + 3)
    cold._score(batch, [0])
    assert cold.stats["promoted_tokens"] == 6
    cold.prepare()
    assert cold._prepared is None and cold.stats["landed"] == 3  # waits for the snapshot's copy
    fake.done = True
    hog = {tier: alloc.alloc_tier(tier, alloc.available_tier(tier)) for tier in (TIER_INT8, TIER_INT4)}
    cold.prepare()  # the repair copies do not fit the free int pages: planned, left for after the forward
    assert cold._prepared is not None and cold.stats["landed"] == 3
    for ids in hog.values():
        alloc.free(ids)
    cold.land_prepared()
    now = table.read(0, N + 8).cpu()
    assert cold.stats["landed"] == 6 and not alloc.holed_pages(now).any()
    assert torch.equal(state.row[:N + 8], now)
    for layer, (k, v) in enumerate(data2):
        kk, vv = pool.get_kv(layer, now[N + 2:N + 5])
        assert torch.equal(kk, k[N + 2:N + 5]) and torch.equal(vv, v[N + 2:N + 5])
    cold.release_request(req)
    alloc.debug_check()
