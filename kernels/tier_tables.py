"""A decode step's per-tier block tables from the batch's sorted slot rows: two launches.

    tier_tables(keys, b8, b4, end, page) -> TieredBlockTables     (filled form, int32, width L)
    tier_tables_reference(...)                                     (torch: the same tensors)

keys   int32 [B, L], each row sorted ascending: the global slot ids of a request's live tokens
       (tiered_pool.py: fp16 ids in [1, b8), int8 in [b8, b4), int4 in [b4, end)), then `end`
       for every dropped token or column past the request (mem_cache/tiered_rows.py builds them)

Because ids are tier-major and page-major, a sorted row is three runs, [fp16 | int8 | int4],
and inside an int run the ids of one page are adjacent. Outputs (paged_layout.TieredBlockTables):

    fp16   tables[0][b, j] = keys[b, j] for j < n16, else 0;  fills[0][b, j] = (j < n16)
    int t  tables[t][b, r] = the r-th distinct page (id - base) // page of the run, fills[t][b, r]
           its tokens; entries r >= num_pages[t][b] are 0; lens[t][b] = the run's length

Two launches over blocks of BLOCK columns, grid (B, cdiv(L, BLOCK)), then no host sync:
  _tier_counts_kernel  per block: tokens of each tier and page starts of each int tier (a column
                       starts a run where the previous column holds another tier or page)
  (torch)              a cumsum of those counts over the blocks: each block's first rank, and
                       per row the tier lengths and page counts
  _tier_write_kernel   per block: the fp16 columns, each start's page at its rank (the block's
                       first plus the starts before it here) and each run's fill by two atomic
                       adds, -start at its start and end + 1 at its end (the two may sit in
                       different blocks; atomics commute)
Every block works at once: no program walks a whole row. Replaces the torch path's dozen
launches (cumsum, scatter, scatter_add, casts and masks per tier).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .paged_layout import TieredBlockTables

BLOCK = 1024


@triton.jit
def _block_marks(keys_ptr, stride_k, L, b8, b4, end, PAGE: tl.constexpr, BLOCK: tl.constexpr):
    """Columns j of this program's block and, per column: its key, int tier masks, page, and
    whether it starts / ends a page run of its int tier (the previous / next column holds another
    tier or another page, or there is none)."""
    b = tl.program_id(0)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = j < L
    row = keys_ptr + b * stride_k
    s = tl.load(row + j, mask=m, other=end)
    prev = tl.load(row + j - 1, mask=m & (j > 0), other=end)
    nxt = tl.load(row + j + 1, mask=m & (j + 1 < L), other=end)
    is16 = m & (s < b8)
    is8 = m & (s >= b8) & (s < b4)
    is4 = m & (s >= b4) & (s < end)
    base = tl.where(is8, b8, b4)
    page = (s - base) // PAGE
    # prev / next in the same tier as s: compare their pages; in another tier (or none): a run edge
    prev_same = tl.where(is8, (prev >= b8) & (prev < b4), (prev >= b4) & (prev < end)) & (j > 0)
    next_same = tl.where(is8, (nxt >= b8) & (nxt < b4), (nxt >= b4) & (nxt < end)) & (j + 1 < L)
    starts = (is8 | is4) & (~prev_same | ((prev - base) // PAGE != page))
    ends = (is8 | is4) & (~next_same | ((nxt - base) // PAGE != page))
    return b, j, m, s, is16, is8, is4, page, starts, ends


@triton.jit
def _tier_counts_kernel(keys_ptr, stride_k, L, b8, b4, end, counts_ptr, NB,
                        PAGE: tl.constexpr, BLOCK: tl.constexpr):
    """counts[b, k] = (fp16, int8, int4 tokens, int8, int4 page starts) of block k of row b."""
    b, j, m, s, is16, is8, is4, page, starts, ends = _block_marks(keys_ptr, stride_k, L, b8, b4, end, PAGE, BLOCK)
    out = counts_ptr + (b * NB + tl.program_id(1)) * 5
    tl.store(out, tl.sum(is16.to(tl.int32), 0))
    tl.store(out + 1, tl.sum(is8.to(tl.int32), 0))
    tl.store(out + 2, tl.sum(is4.to(tl.int32), 0))
    tl.store(out + 3, tl.sum((starts & is8).to(tl.int32), 0))
    tl.store(out + 4, tl.sum((starts & is4).to(tl.int32), 0))


@triton.jit
def _tier_write_kernel(keys_ptr, stride_k, L, b8, b4, end, counts_ptr, cum_ptr, NB,
                       t16_ptr, f16_ptr, t8_ptr, f8_ptr, t4_ptr, f4_ptr, stride_t,
                       PAGE: tl.constexpr, BLOCK: tl.constexpr):
    """Block k of row b: its fp16 columns, and each int page run's page at its rank (the starts
    of earlier blocks, cum - counts, plus those before it here) and fill (-start, end + 1)."""
    b, j, m, s, is16, is8, is4, page, starts, ends = _block_marks(keys_ptr, stride_k, L, b8, b4, end, PAGE, BLOCK)
    at = (b * NB + tl.program_id(1)) * 5
    out = b * stride_t
    tl.store(t16_ptr + out + j, tl.where(is16, s, 0), mask=m)
    tl.store(f16_ptr + out + j, is16.to(tl.int32), mask=m)
    _write_runs(t8_ptr + out, f8_ptr + out, tl.load(cum_ptr + at + 3) - tl.load(counts_ptr + at + 3),
                is8, starts, ends, page, j)
    _write_runs(t4_ptr + out, f4_ptr + out, tl.load(cum_ptr + at + 4) - tl.load(counts_ptr + at + 4),
                is4, starts, ends, page, j)


@triton.jit
def _write_runs(t_ptr, f_ptr, first, in_t, starts, ends, page, j):
    """One int tier's page runs of a block: rank = the block's first + the starts before the column
    here (a column's run, at its start and end alike); page at the start, fill by atomics."""
    st = starts & in_t
    rank = first + tl.cumsum(st.to(tl.int32), 0) - 1
    tl.store(t_ptr + rank, page, mask=st)
    tl.atomic_add(f_ptr + rank, -j, mask=st)
    tl.atomic_add(f_ptr + rank, j + 1, mask=ends & in_t)


def _check(keys: torch.Tensor, b8: int, b4: int, end: int, page: int) -> None:
    assert keys.dim() == 2 and keys.dtype == torch.int32 and keys.stride(1) == 1, (keys.shape, keys.dtype)
    assert 0 < b8 <= b4 <= end < 2**31 and page >= 1, (b8, b4, end, page)


def tier_tables(keys: torch.Tensor, b8: int, b4: int, end: int, page: int) -> TieredBlockTables:
    """The filled TieredBlockTables of sorted key rows (module docstring); no host sync."""
    _check(keys, b8, b4, end, page)
    B, L = keys.shape
    dev = keys.device
    nb = triton.cdiv(max(L, 1), BLOCK)
    t16, f16 = torch.empty((B, L), dtype=torch.int32, device=dev), torch.empty((B, L), dtype=torch.int32, device=dev)
    ints = torch.zeros((4, B, L), dtype=torch.int32, device=dev)  # t8, f8, t4, f4: unused entries stay 0
    counts = torch.zeros((B, nb, 5), dtype=torch.int32, device=dev)
    args = (keys, keys.stride(0), L, b8, b4, end)
    meta = dict(PAGE=page, BLOCK=BLOCK, num_warps=4)
    if B and L:
        _tier_counts_kernel[(B, nb)](*args, counts, nb, **meta)
    cum = counts.cumsum(1, dtype=torch.int32)
    if B and L:
        _tier_write_kernel[(B, nb)](*args, counts, cum, nb, t16, f16, ints[0], ints[1], ints[2], ints[3], L, **meta)
    total = cum[:, -1].t().contiguous()  # [5, B]: tokens per tier, then int8 / int4 pages
    return TieredBlockTables((t16, ints[0], ints[2]), (total[0], total[1], total[2]), (f16, ints[1], ints[3]),
                             (total[0], total[3], total[4]))


def tier_tables_reference(keys: torch.Tensor, b8: int, b4: int, end: int, page: int) -> TieredBlockTables:
    """Torch reference of tier_tables: tier ids by comparison, page starts by the change of page
    id, ranks by cumsum, pages and fills by scatter (one spare column takes the other tiers')."""
    _check(keys, b8, b4, end, page)
    s = keys.long()
    B, L = s.shape
    dev = s.device
    tier = (s >= b8).to(torch.int8) + (s >= b4).to(torch.int8) + (s >= end).to(torch.int8)
    is16 = tier == 0
    n16 = is16.sum(1, dtype=torch.int32)
    tables, lens, fills, num_pages = [torch.where(is16, s, 0).to(torch.int32)], [n16], [is16.to(torch.int32)], [n16]
    for t, base in ((1, b8), (2, b4)):
        in_t = tier == t
        pg = torch.where(in_t, s - base, 0) // page
        prev = torch.cat([torch.full((B, 1), -1, dtype=pg.dtype, device=dev), pg[:, :-1]], dim=1)
        prev_in = torch.cat([torch.zeros((B, 1), dtype=torch.bool, device=dev), in_t[:, :-1]], dim=1)
        starts = in_t & ((pg != prev) | ~prev_in)
        rank = torch.cumsum(starts.to(torch.int32), dim=1) - 1
        table = torch.zeros((B, L + 1), dtype=torch.int32, device=dev)
        table.scatter_(1, torch.where(starts, rank, L).long(), pg.to(torch.int32))
        fill = torch.zeros((B, L + 1), dtype=torch.int32, device=dev)
        fill.scatter_add_(1, torch.where(in_t, rank, L).long(), in_t.to(torch.int32))
        tables.append(table[:, :L])
        fills.append(fill[:, :L])
        lens.append(in_t.sum(1, dtype=torch.int32))
        num_pages.append(starts.sum(1, dtype=torch.int32))
    return TieredBlockTables(tuple(tables), tuple(lens), tuple(fills), tuple(num_pages))
