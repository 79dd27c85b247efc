"""tier_tables (a decode step's per-tier block tables, one launch) vs its torch reference: rows
of every tier mix, pages split across the kernel's blocks, single-token pages, empty tiers and
requests, padding; and through mem_cache.tiered_rows on real pool rows."""
import random

import pytest
import torch

import sgl_kvxfer.kernels.tier_tables as tt
from sgl_kvxfer.kernels.tier_tables import tier_tables, tier_tables_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _rows(B, L, b8, b4, end, page, seed, p_drop=0.2):
    """Sorted int32 key rows: per request a random mix of fp16 ids, int8 / int4 page runs (some
    pages partial, some of one token) and `end` padding."""
    rng = random.Random(seed)
    rows = []
    for b in range(B):
        n = rng.randrange(0, L + 1) if b else L  # the first row full, others any length (0 too)
        ids = set()
        while len(ids) < n:
            t = rng.choice((0, 1, 2))
            if t == 0:
                ids.add(rng.randrange(1, b8))
            else:
                lo, hi = (b8, b4) if t == 1 else (b4, end)
                p0 = lo + page * rng.randrange((hi - lo) // page)
                for k in range(rng.randrange(1, page + 1)):  # a prefix of the page
                    if len(ids) < n:
                        ids.add(p0 + k)
        keys = sorted(ids) + [end] * (L - n)
        rows.append(keys)
    return torch.tensor(rows, dtype=torch.int32, device=DEVICE)


def _assert_same(got, want):
    for name in ("tables", "lens", "fills", "num_pages"):
        for t, (g, w) in enumerate(zip(getattr(got, name), getattr(want, name))):
            assert g.dtype == torch.int32 and g.shape == w.shape, (name, t, g.shape, w.shape)
            assert torch.equal(g.cpu(), w.cpu()), (name, t, g, w)


@pytest.mark.parametrize("B,L,page,block", [
    (3, 40, 4, 1024),    # one block per run
    (4, 300, 8, 16),     # runs and pages across many blocks
    (2, 64, 1, 8),       # page 1: every int token its own page
    (5, 17, 16, 4),      # pages longer than a block
])
def test_matches_reference(monkeypatch, B, L, page, block):
    monkeypatch.setattr(tt, "BLOCK", block)
    b8, b4, end = 50, 50 + 40 * page, 50 + 80 * page
    keys = _rows(B, L, b8, b4, end, page, seed=B * L + page)
    got = tier_tables(keys, b8, b4, end, page)
    _assert_same(got, tier_tables_reference(keys, b8, b4, end, page))
    for t in (1, 2):  # unused entries are zeros; fills sum to the run
        for b in range(B):
            n = int(got.num_pages[t][b])
            assert got.tables[t][b, n:].abs().sum() == 0 and got.fills[t][b, n:].abs().sum() == 0
            assert int(got.fills[t][b].sum()) == int(got.lens[t][b])


def test_single_tier_rows_and_all_padding():
    b8, b4, end, page = 10, 30, 50, 4
    rows = [[1, 2, 3] + [end] * 5,            # fp16 only
            [b8, b8 + 1, b8 + 4] + [end] * 5,  # int8 only: a 2-token page, a 1-token page
            [b4 + 1, b4 + 2, b4 + 3, b4 + 8] + [end] * 4,
            [end] * 8]
    keys = torch.tensor(rows, dtype=torch.int32, device=DEVICE)
    got = tier_tables(keys, b8, b4, end, page)
    _assert_same(got, tier_tables_reference(keys, b8, b4, end, page))
    assert got.num_pages[1].tolist() == [0, 2, 0, 0] and got.fills[1][1, :2].tolist() == [2, 1]
    assert got.tables[2][2, :2].tolist() == [0, 2] and got.fills[2][2, :2].tolist() == [3, 1]
    assert got.lens[0].tolist() == [3, 0, 0, 0]


def test_checks():
    keys = torch.zeros((2, 4), dtype=torch.int64, device=DEVICE)
    with pytest.raises(AssertionError):
        tier_tables(keys, 1, 2, 3, 4)  # int64 keys
    with pytest.raises(AssertionError):
        tier_tables(keys.int(), 5, 2, 3, 4)  # bases out of order


def test_block_tables_of_pool_rows_match_reference_path():
    """mem_cache.tiered_rows on pool rows (dropped slots, stale columns past seq_len): the kernel's
    tables equal the torch path's."""
    from sgl_kvxfer.mem_cache import tiered_rows
    from sgl_kvxfer.mem_cache.tier_plan import TierStorePlan
    from sgl_kvxfer.mem_cache.tiered_pool import TieredKVPool

    pool = TieredKVPool(64, 1, 2, 32, torch.float16, DEVICE, TierStorePlan(64, 64, 64), group_size=32, page_size=4)
    rng = random.Random(3)
    B, L = 4, 48
    slots = torch.tensor([[rng.choice([0, rng.randrange(1, pool.id_end)]) for _ in range(L)] for _ in range(B)])
    lens = torch.tensor([L, 30, 1, 0])
    slots, lens = slots.to(DEVICE), lens.to(DEVICE)
    keys = torch.where((torch.arange(L, device=DEVICE)[None] < lens[:, None]) & (slots != 0), slots,
                       pool.id_end).int().sort(dim=1).values
    want = tier_tables_reference(keys, pool.base(1), pool.base(2), pool.id_end, pool.page_size)
    _assert_same(tier_tables(keys, pool.base(1), pool.base(2), pool.id_end, pool.page_size), want)
    _assert_same(tiered_rows.tier_block_tables(pool, slots, lens), want)
