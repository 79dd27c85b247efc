"""Paged int stores of the TieredKVPool on CPU: page accounting, position-order allocation, the
prefix-fill invariant under radix sharing / dedup / eviction, filled block tables against a
slow reference, and the tiered backend's graph plan (no host sync, fixed shapes)."""
import contextlib
import random
from types import SimpleNamespace

import pytest
import torch

from sgl_kvxfer.forward_batch import ForwardBatch, ForwardMode
from sgl_kvxfer.kernels.paged_layout import gather_request_kv
from sgl_kvxfer.mem_cache.req_to_token import ReqToTokenPool
from sgl_kvxfer.mem_cache.tier_plan import TierStorePlan
from sgl_kvxfer.mem_cache.tiered_allocator import TieredSlotAllocator
from sgl_kvxfer.mem_cache.tiered_pool import TieredKVPool
from sgl_kvxfer.mem_cache.tiered_rows import tier_block_tables, tier_layer_view
from sgl_kvxfer.scheduler.kv_lifecycle import KVLifecycle
from sgl_kvxfer.spectrum.tiers import TIER_DROP, TIER_FP16, TIER_INT4, TIER_INT8

L, H, D = 2, 2, 32


def make(n16=64, n8=64, n4=64, page=4, dtype=torch.float16, group=D):
    pool = TieredKVPool(64, L, H, D, dtype, "cpu", TierStorePlan(n16, n8, n4), group_size=group, page_size=page)
    return pool, TieredSlotAllocator(pool, "cpu")


def tag_kv(pool, slots, tags):
    """K = V = the tag in every channel: exact in every tier at G = D (a constant group)."""
    x = tags.to(pool.dtype)[:, None, None].expand(len(tags), H, D).contiguous()
    for layer in range(L):
        pool.set_kv(layer, slots, x, x)


def read_tags(pool, slots, layer=0):
    return pool.get_kv(layer, slots)[0][:, 0, 0].float()


# ---------------------------------------------------------------------------------- allocator
def test_alloc_tier_fills_fresh_pages_in_order_and_frees_pages_when_empty():
    pool, alloc = make(n8=16, n4=8, page=4)
    assert alloc.available_tier(TIER_INT8) == 16 and pool.num_pages(TIER_INT8) == 4
    a = alloc.alloc_tier(TIER_INT8, 6)  # pages p, q: 4 + 2 (q's tail unused)
    pages, offs = pool.page_offset(TIER_INT8, a)
    assert offs.tolist() == [0, 1, 2, 3, 0, 1] and pages[0] == pages[3] and pages[4] == pages[5] != pages[0]
    assert alloc.available_tier(TIER_INT8) == 8  # whole free pages only
    assert alloc.used_counts()[TIER_INT8] == 6
    b = alloc.alloc_tier(TIER_INT8, 100)  # short: what whole free pages hold
    assert b.numel() == 8 and alloc.available_tier(TIER_INT8) == 0
    alloc.free(a[:5])  # page p empties, page q keeps one live id
    assert alloc.available_tier(TIER_INT8) == 4
    c = alloc.alloc_tier(TIER_INT8, 4)
    assert set(pool.page_offset(TIER_INT8, c)[0].tolist()) == {int(pages[0])}  # only the emptied page
    alloc.debug_check()
    alloc.free(torch.cat([a[5:], b, c]))
    assert alloc.available_tier(TIER_INT8) == 16 and alloc.used_counts()[TIER_INT8] == 0
    alloc.debug_check()


def test_alloc_tier_appends_to_a_wholly_held_page_only():
    """A run may continue the last page of its holder's previous run (its free tail first, then
    fresh pages), so the holder still sees that page as [0, fill); a page whose ids were partly
    freed, or that was freed and handed out again, takes no append."""
    pool, alloc = make(n8=16, n4=8, page=4)
    a = alloc.alloc_tier(TIER_INT8, 2)  # page p: slots 0, 1
    b = alloc.alloc_tier(TIER_INT8, 3, append_to=int(a[-1]))  # p: 2, 3, then a fresh page q: 0
    pa, oa = pool.page_offset(TIER_INT8, a)
    pb, ob = pool.page_offset(TIER_INT8, b)
    assert ob.tolist() == [2, 3, 0] and pb[0] == pb[1] == pa[0] and pb[2] != pa[0]
    assert alloc.tail_room(TIER_INT8, int(b[-1])) == 3 and alloc.tail_room(TIER_INT8, int(a[0])) == 0  # p is full
    alloc.free(b[2:])  # q empties and is free again: no append to a free page
    assert alloc.tail_room(TIER_INT8, int(b[2])) == 0
    e = alloc.alloc_tier(TIER_INT8, 3)  # page r: slots 0, 1, 2
    assert alloc.tail_room(TIER_INT8, int(e[-1])) == 1
    alloc.free(e[1:])  # r keeps slot 0 live but handed out 0..2: appending at 3 would leave a hole
    assert alloc.tail_room(TIER_INT8, int(e[0])) == 0
    assert alloc.alloc_tier(TIER_INT8, 1, append_to=int(e[0])).tolist() != [int(e[0]) + 3]
    alloc.debug_check()


def test_retier_runs_continue_pages_and_move_once(monkeypatch):
    pool, alloc = make(n16=64, n8=32, n4=32, page=4)
    moves = []
    real = pool.move
    monkeypatch.setattr(pool, "move", lambda s, d: (moves.append(len(s)), real(s, d)))
    first = alloc.alloc(3)
    new1, _ = alloc.retier(first, torch.full((3,), TIER_INT8, dtype=torch.int8))
    runs = [(alloc.alloc(2), torch.full((2,), TIER_INT8, dtype=torch.int8), {TIER_INT8: int(new1[-1])}),
            (alloc.alloc(5), torch.tensor([1, 2, 1, 2, 0], dtype=torch.int8))]
    (n2, g2), (n3, g3) = alloc.retier_runs(runs)
    assert moves == [3, 6]  # one move for both runs
    p1, o1 = pool.page_offset(TIER_INT8, new1)
    p2, o2 = pool.page_offset(TIER_INT8, n2)
    assert o2.tolist() == [3, 0] and p2[0] == p1[0] and p2[1] != p1[0]  # continued, then a fresh page
    p3, _ = pool.page_offset(TIER_INT8, n3[g3 == TIER_INT8])
    assert not set(p3.tolist()) & set(p2.tolist() + p1.tolist())  # another holder: its own pages
    alloc.debug_check()


def test_double_free_of_an_int_id_is_caught():
    pool, alloc = make(page=4)
    a = alloc.alloc_tier(TIER_INT4, 3)
    alloc.free(a)
    alloc.free(a[:1])
    with pytest.raises(AssertionError):
        alloc.debug_check()


def test_retier_allocates_each_tier_in_position_order():
    pool, alloc = make(page=4)
    slots = alloc.alloc(24)
    tag_kv(pool, slots, torch.arange(1, 25))
    tiers = torch.tensor([random.Random(3).choice([0, 1, 2, 3]) for _ in range(24)], dtype=torch.int8)
    new, got = alloc.retier(slots, tiers)
    for t in (TIER_INT8, TIER_INT4):
        ids = new[got == t]
        assert torch.equal(ids, ids.sort().values)  # increasing with position: pages filled in order
        r = ids - pool.base(t)
        assert torch.equal(r % 4, torch.arange(ids.numel()) % 4)  # dense: page after page from slot 0
    assert not alloc.holed_pages(new).any()
    live = new != 0
    assert torch.equal(read_tags(pool, new[live]), torch.arange(1, 25)[live].float())
    alloc.debug_check()


def test_repack_moves_a_kept_suffix_to_fresh_pages_bit_exact():
    pool, alloc = make(page=4, group=16)
    slots = alloc.alloc(10)
    gen = torch.Generator().manual_seed(0)
    for layer in range(L):
        pool.set_kv(layer, slots, torch.randn(10, H, D, generator=gen), torch.randn(10, H, D, generator=gen))
    new, _ = alloc.retier(slots, torch.full((10,), TIER_INT4, dtype=torch.int8))
    kept = new[5:]  # a holder keeps a suffix of the run (the tree held positions 0..4 already)
    before = [pool.stored_codes(layer, TIER_INT4, kept) for layer in range(L)]
    alloc.free(new[:5])
    assert alloc.holed_pages(kept).tolist() == [True, True, True, False, False]  # page 2 is its own prefix
    moved = alloc.repack(kept)
    assert torch.equal(moved[3:], kept[3:]) and not alloc.holed_pages(moved).any()
    for layer in range(L):
        assert all(torch.equal(a, b) for a, b in zip(before[layer], pool.stored_codes(layer, TIER_INT4, moved)))
    alloc.free(moved)
    assert alloc.used_counts()[TIER_INT4] == 0
    alloc.debug_check()


# ------------------------------------------------------------- prefix-fill under the radix cache
def _req(tokens):
    return SimpleNamespace(fill_ids=list(tokens), req_pool_idx=None, prefix_len=0, kv_len=0, last_node=None,
                           num_retractions=0, cached_tokens=0, share_prefix=True,
                           prefix_match_limit=lambda: len(tokens) - 1)


def _tag(tokens, p):
    return float(hash(tuple(tokens[:p + 1])) % 1000 + 1)  # the KV of a position: a function of its prefix


def _check_holders(pool, alloc, kv, running):
    """Every running row and every radix path sees each int page as slots [0, fill); tags read
    back through get_kv and through the filled tables both match the prompts."""
    rows = []
    for req in running:
        row = kv.req_to_token.read(req.req_pool_idx, req.kv_len).clone()
        assert not alloc.holed_pages(row).any()
        want = torch.tensor([_tag(req.fill_ids, p) for p in range(req.kv_len)])
        live = row != 0
        assert torch.equal(read_tags(pool, row[live]), want[live])
        rows.append((row, want[live]))
    stack = [(kv.tree.root, torch.empty(0, dtype=torch.int64))]
    while stack:
        node, path = stack.pop()
        for child in node.children.values():
            p = torch.cat([path, child.value])
            assert not alloc.holed_pages(p).any()
            stack.append((child, p))
    if rows:  # tables over all running rows vs their tags (a multiset: order inside tiers is free)
        width = max(r.numel() for r, _ in rows) + 3
        table = torch.zeros((len(rows), width), dtype=torch.int64)
        for i, (r, _) in enumerate(rows):
            table[i, :r.numel()] = r
        tables = tier_block_tables(pool, table, torch.tensor([r.numel() for r, _ in rows]))
        layer = tier_layer_view(pool, 0)
        for i, (_, want) in enumerate(rows):
            k, _ = gather_request_kv(layer, tables, i)
            assert torch.equal(k[:, 0, 0].sort().values, want.sort().values)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_prefix_fill_invariant_under_sharing_dedup_and_eviction(seed):
    rng = random.Random(seed)
    pool, alloc = make(n16=160, n8=96, n4=96, page=4)
    kv = KVLifecycle(alloc, ReqToTokenPool(8, 64, "cpu"), use_radix=True)
    stems = [[rng.randrange(1, 50) for _ in range(rng.randrange(3, 14))] for _ in range(3)]
    running, tails = [], {}
    for step in range(40):
        op = rng.random()
        if 0.45 <= op < 0.55 and running:  # decode: new private tokens, demoted continuing their last pages
            req = rng.choice(running)
            k = rng.randrange(1, 6)
            if req.kv_len + k > 60:
                continue
            slots = kv.alloc([req], [k], [req.kv_len])
            if slots is None:
                continue
            req.fill_ids += [rng.randrange(1, 50) for _ in range(k)]
            kv.req_to_token.write(req.req_pool_idx, req.kv_len, slots)
            tag_kv(pool, slots, torch.tensor([_tag(req.fill_ids, p) for p in range(req.kv_len, req.kv_len + k)]))
            tiers = torch.tensor([rng.choice([0, 1, 2]) for _ in range(k)], dtype=torch.int8)
            (new, got), = alloc.retier_runs([(slots, tiers, tails.get(id(req)))], kv.make_room_tier)
            kv.req_to_token.write(req.req_pool_idx, req.kv_len, new)
            t = tails.setdefault(id(req), {})
            for tier in (TIER_INT8, TIER_INT4):
                ids = new[(new != slots) & (got == tier)]
                if ids.numel():
                    t[tier] = int(ids[-1])
            req.kv_len += k
        elif op < 0.45 and len(running) < 5:  # admit and prefill a request; tier its private run
            tokens = rng.choice(stems) + [rng.randrange(1, 50) for _ in range(rng.randrange(1, 12))]
            req = _req(tokens)
            assert kv.admit(req)
            n = len(tokens)
            slots = kv.alloc([req], [n - req.prefix_len], [req.prefix_len])
            if slots is None:
                kv.release(req)
                continue
            kv.req_to_token.write(req.req_pool_idx, req.prefix_len, slots)
            req.kv_len = n
            tag_kv(pool, slots, torch.tensor([_tag(tokens, p) for p in range(req.prefix_len, n)]))
            tiers = torch.tensor([rng.choice([0, 1, 1, 2, 2, 3]) for _ in range(n - req.prefix_len)], dtype=torch.int8)
            new, _ = alloc.retier(slots, tiers, kv.make_room_tier)
            kv.req_to_token.write(req.req_pool_idx, req.prefix_len, new)
            running.append(req)
        elif op < 0.7 and running:  # a prompt done: share it (dedup against what others cached first)
            req = running.pop(rng.randrange(len(running)))
            tails.pop(id(req), None)  # shared now: later runs start fresh pages (as after the engine's prefill)
            kv.cache(req, finished=rng.random() < 0.5)
            if req.req_pool_idx is not None:
                running.append(req)
        elif op < 0.85 and running:  # finish one
            req = running.pop(rng.randrange(len(running)))
            kv.cache(req, finished=True)
        else:  # memory pressure
            kv.tree.evict(rng.randrange(1, 20), reclaim=alloc.page_reclaimer(rng.choice([TIER_INT8, TIER_INT4])))
        _check_holders(pool, alloc, kv, running)
        alloc.debug_check()
    for req in running:
        kv.cache(req, finished=True)
    kv.flush()
    alloc.debug_check()
    assert alloc.used_counts() == {TIER_FP16: 0, TIER_INT8: 0, TIER_INT4: 0}


# -------------------------------------------------------------------- tables vs slow reference
def _reference_tables(pool, row, n):
    """Per tier: fp16 ids, and (distinct pages in ascending order, tokens per page)."""
    ids = [int(s) for s in row[:n] if int(s) != 0]
    out = {TIER_FP16: sorted(s for s in ids if s < pool.base(TIER_INT8))}
    for t in (TIER_INT8, TIER_INT4):
        hi = pool.base(TIER_INT4) if t == TIER_INT8 else pool.id_end
        pages = [(s - pool.base(t)) // pool.page_size for s in ids if pool.base(t) <= s < hi]
        out[t] = (sorted(set(pages)), {p: pages.count(p) for p in set(pages)})
    return out


@pytest.mark.parametrize("seed", [0, 1])
def test_block_tables_match_a_slow_reference(seed):
    rng = random.Random(seed)
    pool, alloc = make(n16=128, n8=128, n4=128, page=4)
    B, W = 5, 40
    table = torch.zeros((B, W), dtype=torch.int64)
    base = alloc.alloc(30)
    tag_kv(pool, base, torch.arange(1, 31))
    shared, _ = alloc.retier(base, torch.tensor([rng.choice([0, 1, 2, 3]) for _ in range(30)], dtype=torch.int8))
    lens = []
    for b in range(B):
        m = rng.randrange(0, 31)  # a shared prefix of one run ...
        own = alloc.alloc(rng.randrange(1, 10))  # ... then a private run of the request
        tag_kv(pool, own, torch.full((own.numel(),), 7.0))
        own, _ = alloc.retier(own, torch.tensor([rng.choice([0, 1, 2, 3]) for _ in range(own.numel())], dtype=torch.int8))
        row = torch.cat([shared[:m], own])
        table[b, :row.numel()] = row
        table[b, row.numel():] = shared[rng.randrange(30)]  # stale columns
        lens.append(row.numel() - rng.randrange(0, 2))  # sometimes the last column is not a key yet
    tables = tier_block_tables(pool, table, torch.tensor(lens))
    for b in range(B):
        ref = _reference_tables(pool, table[b], lens[b])
        n16 = len(ref[TIER_FP16])
        assert int(tables.lens[TIER_FP16][b]) == n16 and tables.tables[TIER_FP16][b, :n16].tolist() == ref[TIER_FP16]
        assert tables.fills[TIER_FP16][b].sum() == n16
        for t in (TIER_INT8, TIER_INT4):
            pages, count = ref[t]
            npg = int(tables.num_pages[t][b])
            assert npg == len(pages) and tables.tables[t][b, :npg].tolist() == pages
            assert tables.fills[t][b, :npg].tolist() == [count[p] for p in pages]
            assert int(tables.lens[t][b]) == sum(count.values()) and int(tables.fills[t][b].sum()) == sum(count.values())


# ------------------------------------------------------------------------------ graph plan
@contextlib.contextmanager
def no_host_sync():
    """Fail on any tensor -> Python value conversion (what a CUDA graph cannot capture)."""
    names = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__")
    saved = {n: getattr(torch.Tensor, n) for n in names}

    def boom(*_a, **_k):
        raise AssertionError("host sync in a graph plan")
    try:
        for n in names:
            setattr(torch.Tensor, n, boom)
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.Tensor, n, f)


def _batch(table, rows, lens, loc, width=None):
    B = len(rows)
    return ForwardBatch(
        mode=ForwardMode.DECODE, input_ids=torch.zeros(B, dtype=torch.int64), positions=torch.tensor(lens) - 1,
        out_cache_loc=loc, req_pool_indices=torch.tensor(rows), seq_lens=torch.tensor(lens),
        extend_prefix_lens=[n - 1 for n in lens], extend_seq_lens=[1] * B,
        seq_lens_cpu=[width] * B if width else list(lens), logits_positions=torch.arange(B), req_to_token=table)


def test_graph_plan_has_no_host_sync_and_matches_the_eager_plan():
    from sgl_kvxfer.layers.attention import create_attention_backend

    pool, alloc = make(n16=96, n8=64, n4=64, page=16, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    table = torch.zeros((4, 48), dtype=torch.int64)
    full = [40, 29, 0]
    for row, n in enumerate(full):
        if not n:
            continue
        s = alloc.alloc(n)
        for layer in range(L):
            pool.set_kv(layer, s, *(torch.randn(n, H, D, generator=gen) for _ in range(2)))
        moved, _ = alloc.retier(s[:-4], torch.randint(0, 4, (n - 4,), generator=gen).to(torch.int8))
        table[row, :n] = torch.cat([moved, s[-4:]])
    backend = create_attention_backend("triton", kv_pool=pool, num_q_heads=4, num_kv_heads=H, head_dim=D)
    assert backend.supports_cuda_graph
    q = torch.randn(3, 4, D, generator=gen).to(torch.bfloat16)
    k = v = torch.randn(3, H, D, generator=gen).to(torch.bfloat16)
    rows = [0, 1, 3]  # row 3: a padding row (seq_len 0), as the graph runner's
    for lens in ([38, 27, 0], [40, 29, 0]):  # two steps into the same fixed-width plan
        loc = torch.stack([table[0, lens[0] - 1], table[1, lens[1] - 1], torch.tensor(pool.scratch_slot)])
        graph = _batch(table, rows, lens, loc, width=48)
        with no_host_sync():
            backend.prepare_graph_metadata(graph, 48)
        tg = graph.attn_metadata.tables
        assert all(x.shape == (3, 48) for x in tg.tables + tg.fills)
        eager = _batch(table, rows[:2], lens[:2], loc[:2])
        backend.prepare_metadata(eager)
        out_g = backend.forward(q, k, v, 0, graph)
        out_e = backend.forward(q[:2], k[:2], v[:2], 0, eager)
        torch.testing.assert_close(out_g[:2], out_e, atol=0, rtol=0)
        assert not out_g[2].any()  # a padding row attends nothing
