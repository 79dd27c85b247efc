"""The scoring pass on the device: the run extension taken per row at once matches extend_runs, and
the scoring kernel (kernels/cold_mass.py, the Triton interpreter on CPU) promotes the same tokens,
with the same counters, as the pool's torch read path, and the landing's page repair through the
relocation kernel (kernels/tier_relocate.py) leaves the same codes."""
from types import SimpleNamespace

import pytest
import torch

from sgl_kvxfer.layers.attention.torch_backend import TorchAttentionBackend
from sgl_kvxfer.mem_cache.req_to_token import ReqToTokenPool
from sgl_kvxfer.mem_cache.tier_plan import TierStorePlan
from sgl_kvxfer.mem_cache.tiered_allocator import TieredSlotAllocator
from sgl_kvxfer.mem_cache.tiered_pool import TieredKVPool
from sgl_kvxfer.scheduler.cold_land import holed_rows
from sgl_kvxfer.scheduler.cold_tier import ColdTier
from sgl_kvxfer.spectrum.decode_mass import extend_runs, extend_runs_rows
from sgl_kvxfer.spectrum.tiers import TIER_DROP, TIER_FP16, TIER_INT4, TIER_INT8

L, HQ, H, D, PAGE, N = 3, 4, 2, 32, 8, 64
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the kernels under the Triton interpreter


class Req:  # weak-referenceable, like the scheduler's Req
    def __init__(self, row, n):
        self.req_pool_idx, self.kv_len, self.finished_reason = row, n, None


@pytest.mark.parametrize("seed", range(6))
def test_run_extension_per_row_matches_extend_runs(seed):
    g = torch.Generator().manual_seed(seed)
    picked = torch.rand(5, 40, generator=g) < 0.08
    run = torch.rand(5, 40, generator=g) < 0.6
    for cap in (0, 1, 2, 5, 64):
        got = extend_runs_rows(picked, run, cap)
        for b in range(5):
            assert got[b].tolist() == extend_runs(picked[b], run[b], cap).tolist(), (seed, cap, b)


def _build(kernel: bool, max_tokens: int, drop_run: int):
    pool = TieredKVPool(256, L, H, D, torch.float32, DEVICE, TierStorePlan(200, 64, 128), group_size=D,
                        page_size=PAGE)
    pool._fused_relocate = kernel  # the landing's page repair through tier_relocate.py too (as on CUDA)
    alloc = TieredSlotAllocator(pool, DEVICE)
    runner = SimpleNamespace(kv_pool=pool, attn_backend=TorchAttentionBackend(pool, HQ, H, D),
                             max_running_requests=4, graph_runner=None)
    config = SimpleNamespace(kv_promote_threshold=0.05, kv_promote_interval=1, kv_promote_radius=1,
                             kv_cold_tier_tokens=128, kv_promote_layers=2, kv_promote_drop_run=drop_run,
                             kv_promote_max_tokens=max_tokens)
    table = ReqToTokenPool(4, 256, DEVICE)
    cold = ColdTier(config, runner, alloc, table, lambda tier, n: None)
    cold.kernel = kernel
    gen = torch.Generator().manual_seed(1)
    reqs = []
    for r, n in enumerate((N, N - 9)):
        data = [(torch.randn(n, H, D, generator=gen).to(DEVICE), torch.randn(n, H, D, generator=gen).to(DEVICE))
                for _ in range(L)]
        slots = alloc.alloc(n)
        for layer, (k, v) in enumerate(data):
            pool.set_kv(layer, slots, k, v)
        tiers = torch.full((n,), TIER_INT4, dtype=torch.int8)
        tiers[:2], tiers[n - 6:] = TIER_FP16, TIER_INT8
        tiers[20:24] = TIER_DROP
        req = Req(r, n)
        cold.keep_dropped(req, 0, slots, tiers)
        new, _ = alloc.retier(slots.cpu(), tiers)
        table.write(r, 0, new.to(DEVICE))
        # each request's query: its heads point at a few keys (strong and weak hits)
        for layer in cold.layers:
            q = (torch.randn(HQ, D, generator=gen) * 0.5).to(DEVICE)
            for h, pos in enumerate((19, 33, 40 + r, 7)):
                k = data[layer][0][pos][h * H // HQ]
                q[h] += k / k.norm() * (9.0 - 1.5 * h)
            cold.taps[layer][r] = q
        reqs.append(req)
    return cold, reqs


def _step(cold, batch):
    """One decode hook, then every copy it issued landed (on CUDA the copy runs on a worker thread)."""
    cold.on_decode(batch)
    cold.wait_copies()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    cold.land()
    assert not cold.pending


@pytest.mark.parametrize("max_tokens,drop_run", [(0, 0), (5, 0), (0, 3)])
def test_kernel_promotes_what_the_torch_path_promotes(max_tokens, drop_run):
    runs = []
    for kernel in (False, True):
        cold, reqs = _build(kernel, max_tokens, drop_run)
        batch = SimpleNamespace(slices=[SimpleNamespace(req=r) for r in reqs])
        for _ in range(3):
            _step(cold, batch)
        promoted = [sorted(cold.states[r].promoted) for r in reqs]
        rows = [cold.table.table[r.req_pool_idx, :r.kv_len].clone() for r in reqs]
        keys = [cold.pool.get_kv(layer, row)[0] for layer in range(L) for row in rows]
        runs.append((promoted, keys, {k: cold.stats[k] for k in ("scoring_passes", "scored_tokens", "promoted_tokens",
                                                           "landed", "capped_tokens", "restored_dropped",
                                                           "repacked_tokens")}))
        for r in reqs:
            cold.release_request(r)
        cold.allocator.debug_check()
    (p0, k0, s0), (p1, k1, s1) = runs
    assert p0 == p1 and s0 == s1
    assert all(torch.equal(a, b) for a, b in zip(k0, k1))  # every row reads the same keys after the repairs
    assert s0["promoted_tokens"] > 0 and any(p0) and s0["repacked_tokens"] > 0  # promotes, repairs pages
    if max_tokens:
        assert s0["capped_tokens"] > 0
    if drop_run:
        assert s0["restored_dropped"] > 0


@pytest.mark.parametrize("seed", range(4))
def test_landing_moves_only_the_tails_past_each_hole(seed):
    """The landing plan, every row of a landing at once: after promotions punch holes in int
    pages, moving the tokens it names (to fresh ids) leaves each row holding a prefix of every
    page again (holed_pages finds nothing), it names only tokens of pages holed_pages flags, and
    of those only the ones past the page's first hole (the head stays)."""
    cold, reqs = _build(False, 0, 0)
    block = cold._read_block(reqs)  # the landing plan works on host rows
    g = torch.Generator().manual_seed(seed)
    after, js, replaced, flagged = block.clone(), [], [], 0
    for j, r in enumerate(reqs):
        row = block[j, :r.kv_len]
        assert not cold.allocator.holed_pages(row).any()
        positions = torch.randperm(row.numel(), generator=g)[:1 + seed * 3 + j].sort().values
        after[j, positions] = 1 + torch.arange(positions.numel())  # any fp16 ids
        js.append(torch.full((positions.numel(),), j))
        replaced.append(row[positions])
        flagged += int(cold.allocator.holed_pages(after[j, :r.kv_len]).sum())
    got_j, got_pos = holed_rows(cold.pool, torch.cat(js), torch.cat(replaced), after)
    assert bool((got_j[1:] > got_j[:-1]).logical_or(got_pos[1:] > got_pos[:-1]).all())  # row-major order
    for j, r in enumerate(reqs):
        row = after[j, :r.kv_len].clone()
        moved = got_pos[got_j == j]
        flags = cold.allocator.holed_pages(row)
        assert bool(flags[moved].all())  # only tokens of holed pages move
        row[moved] = 1  # moved off their pages (any fp16 id)
        assert not cold.allocator.holed_pages(row).any()
    assert got_pos.numel() <= flagged
    if seed:
        assert 0 < got_pos.numel() < flagged  # holes were punched and page heads stayed
    for r in reqs:
        cold.release_request(r)


@pytest.mark.parametrize("b8,b4,page", [(100, 100 + 64 * 3, 64), (100, 150, 16), (7, 55, 12), (0, 40, 8)])
def test_page_keys_and_holed_rows_match_a_per_page_walk(b8, b4, page):
    """page_keys numbers int8 pages first, then int4's from the next key (aligned or not, power
    of two page or not); holed_rows names, row-major, exactly the tokens a walk over each
    (row, page given up) names: those on the page past the smallest offset the row gave up
    there. Rows that gave up no int id (or only fp16 ids) name nothing."""
    from sgl_kvxfer.scheduler.cold_land import page_keys
    from sgl_kvxfer.spectrum.tiers import TIER_INT4, TIER_INT8

    id_end = b4 + 6 * page + 5
    pool = SimpleNamespace(page_size=page, id_end=id_end,
                           base=lambda t: {TIER_INT8: b8, TIER_INT4: b4}[t])
    ids = torch.arange(b8, id_end)
    key, off = page_keys(pool, ids)
    is4 = ids >= b4
    want_off = torch.where(is4, ids - b4, ids - b8) % page
    want_key = torch.where(is4, (ids - b4) // page + -(-(b4 - b8) // page), (ids - b8) // page)
    assert torch.equal(key, want_key) and torch.equal(off, want_off)
    g = torch.Generator().manual_seed(page)
    for trial in range(6):
        n, w = 4, 40
        after = torch.randint(1, id_end, (n, w), generator=g)
        after[:, ::5] = 0  # dropped / padding
        k = int(torch.randint(1, 12, (1,), generator=g))
        j = torch.randint(0, n - 1, (k,), generator=g)  # the last row never gives anything up
        replaced = torch.randint(1, id_end, (k,), generator=g)
        got_j, got_pos = holed_rows(pool, j, replaced, after)
        want = []
        for r in range(n):
            heads = {}
            for jj, rep in zip(j.tolist(), replaced.tolist()):
                if jj == r and rep >= b8:
                    kk, oo = (int(x) for x in page_keys(pool, torch.tensor([rep])))
                    heads[kk] = min(heads.get(kk, page), oo)
            for pos in range(w):
                s = int(after[r, pos])
                if s >= b8:
                    kk, oo = (int(x) for x in page_keys(pool, torch.tensor([s])))
                    if kk in heads and oo > heads[kk]:
                        want.append((r, pos))
        assert list(zip(got_j.tolist(), got_pos.tolist())) == want


def test_copies_on_a_worker_thread_land_what_inline_copies_land():
    """The promotion copy job off the scheduler thread (as on CUDA): once its job ran, the
    landing is the one the inline copy gives."""
    from sgl_kvxfer.scheduler.cold_copy import CopyWorker

    runs = []
    for threaded in (False, True):
        cold, reqs = _build(False, 5, 3)
        cold.worker = CopyWorker(threaded=threaded)
        batch = SimpleNamespace(slices=[SimpleNamespace(req=r) for r in reqs])
        for _ in range(3):
            _step(cold, batch)
        assert not cold.pending
        rows = [cold.table.table[r.req_pool_idx, :r.kv_len].clone() for r in reqs]
        runs.append(([sorted(cold.states[r].promoted) for r in reqs], dict(cold.stats),
                     [cold.pool.get_kv(layer, row)[0] for layer in range(L) for row in rows]))
        for r in reqs:
            cold.release_request(r)
        cold.allocator.debug_check()
    (p0, s0, k0), (p1, s1, k1) = runs
    assert p0 == p1 and s0 == s1 and s0["landed"] > 0
    assert all(torch.equal(a, b) for a, b in zip(k0, k1))


def test_a_copy_job_that_fails_raises_at_landing_and_release_waits_for_the_job():
    import threading

    from sgl_kvxfer.scheduler.cold_copy import CopyWorker, PromotionCopy

    worker = CopyWorker(threaded=True)
    gate, ran = threading.Event(), []
    slow = PromotionCopy()
    worker.submit(slow, lambda c: (gate.wait(5), ran.append(1)))
    assert not slow.query()  # the job has not run: not landable
    gate.set()
    slow.wait()
    assert ran == [1] and slow.query()
    bad = PromotionCopy()
    worker.submit(bad, lambda c: 1 / 0)
    bad.wait()
    with pytest.raises(RuntimeError, match="promotion copy failed"):
        bad.query()


def _cap_reference(picks, max_tokens):
    """The cap as a loop over stretches (the rule in cold_score.cap's docstring)."""
    ranked = []
    for n, (_, positions, _, m, score) in enumerate(picks):
        cut = (positions[1:] != positions[:-1] + 1).nonzero().squeeze(1) + 1
        bounds = [0, *cut.tolist(), positions.numel()]
        for a, b in zip(bounds[:-1], bounds[1:]):
            ranked.append((-float(score[a:b].max()), n, a, b))
    total = sum(b - a for _, _, a, b in ranked)
    if total <= max_tokens:
        return picks, 0
    ranked.sort()
    room, keep = max_tokens, [[] for _ in picks]
    for _, n, a, b in ranked:
        if room <= 0:
            break
        if b - a > room:
            top = a + int(torch.argmax(picks[n][3][a:b]))
            a = max(a, min(top - room // 2, b - room))
            b = a + room
        keep[n].extend(range(a, b))
        room -= b - a
    out = [(p[0], p[1][sorted(k)], p[2][sorted(k)]) for p, k in zip(picks, keep) if k]
    return out, total - (max_tokens - room)


@pytest.mark.parametrize("seed", range(8))
def test_cap_matches_the_stretch_loop(seed):
    g = torch.Generator().manual_seed(seed)
    picks = []
    for n in range(4):
        positions = torch.rand(60, generator=g).lt(0.4).nonzero().squeeze(1)
        m = torch.rand(positions.numel(), generator=g)
        score = (torch.rand(positions.numel(), generator=g) * 4).round() / 4  # ties between stretches
        picks.append((f"req{n}", positions, positions + 1000, m, score))
    cold, reqs = _build(False, 0, 0)
    for cap in (1, 7, 30, 80, 1000):
        cold.max_tokens, cold.stats["capped_tokens"] = cap, 0
        got = cold._cap(picks)
        want, capped = _cap_reference(picks, cap)
        assert [(p[0], p[1].tolist(), p[2].tolist()) for p in got] == [(w[0], w[1].tolist(), w[2].tolist()) for w in want]
        assert cold.stats["capped_tokens"] == capped
