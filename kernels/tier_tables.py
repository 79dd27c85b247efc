"""A decode step's per-tier block tables from the batch's sorted slot rows: one launch.

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

Grid (B, 3), one program per (request, tier). Each first counts the row's three runs (a pass over
the row: the runs' bounds are where the tier ids change, and every program needs its own), then
writes its tier: the fp16 program copies the run, an int program walks its run in blocks, marks
where a page starts (its page differs from the previous id's) and ends, ranks the starts with a
running count, stores each start's page at its rank and adds (end + 1 - start) to the rank's fill
with two atomic adds (-start at the start, end + 1 at the end: the two may sit in different
blocks, and atomics commute). Replaces the torch path's dozen launches (cumsum, scatter,
scatter_add, casts and masks per tier), which at 16k x 8 tokens took ~0.3 ms of a decode step.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .paged_layout import TieredBlockTables

BLOCK = 1024


@triton.jit
def _tier_tables_kernel(keys_ptr, stride_k, L, b8, b4, end,
                        t16_ptr, f16_ptr, t8_ptr, f8_ptr, t4_ptr, f4_ptr, stride_t, lens_ptr, npages_ptr, B,
                        PAGE: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    tier = tl.program_id(1)
    row = keys_ptr + b * stride_k
    offs = tl.arange(0, BLOCK)
    n16 = tl.full([], 0, tl.int32)
    n8 = tl.full([], 0, tl.int32)
    n4 = tl.full([], 0, tl.int32)
    for j0 in range(0, L, BLOCK):  # the three runs' lengths
        j = j0 + offs
        s = tl.load(row + j, mask=j < L, other=end)
        n16 += tl.sum((s < b8).to(tl.int32), 0)
        n8 += tl.sum(((s >= b8) & (s < b4)).to(tl.int32), 0)
        n4 += tl.sum(((s >= b4) & (s < end)).to(tl.int32), 0)
    out = b * stride_t
    if tier == 0:
        for j0 in range(0, L, BLOCK):
            j = j0 + offs
            m = j < L
            s = tl.load(row + j, mask=m, other=0)
            is16 = j < n16
            tl.store(t16_ptr + out + j, tl.where(is16, s, 0), mask=m)
            tl.store(f16_ptr + out + j, is16.to(tl.int32), mask=m)
        tl.store(lens_ptr + b, n16)
        tl.store(npages_ptr + b, n16)
    else:
        if tier == 1:
            lo = n16
            hi = n16 + n8
            base = b8
            t_ptr = t8_ptr
            f_ptr = f8_ptr
        else:
            lo = n16 + n8
            hi = n16 + n8 + n4
            base = b4
            t_ptr = t4_ptr
            f_ptr = f4_ptr
        pages = tl.full([], 0, tl.int32)
        for j0 in range(lo, hi, BLOCK):
            j = j0 + offs
            m = j < hi
            page = (tl.load(row + j, mask=m, other=base) - base) // PAGE
            has_prev = m & (j > lo)
            has_next = m & (j + 1 < hi)
            prev = (tl.load(row + j - 1, mask=has_prev, other=base) - base) // PAGE
            nxt = (tl.load(row + j + 1, mask=has_next, other=base) - base) // PAGE
            starts = m & (~has_prev | (page != prev))
            ends = m & (~has_next | (page != nxt))
            rank = pages + tl.cumsum(starts.to(tl.int32), 0) - 1
            tl.store(t_ptr + out + rank, page, mask=starts)
            tl.atomic_add(f_ptr + out + rank, -j, mask=starts)
            tl.atomic_add(f_ptr + out + rank, j + 1, mask=ends)
            pages += tl.sum(starts.to(tl.int32), 0)
        tl.store(lens_ptr + tier * B + b, hi - lo)
        tl.store(npages_ptr + tier * B + b, pages)


def _check(keys: torch.Tensor, b8: int, b4: int, end: int, page: int) -> None:
    assert keys.dim() == 2 and keys.dtype == torch.int32 and keys.stride(1) == 1, (keys.shape, keys.dtype)
    assert 0 < b8 <= b4 <= end < 2**31 and page >= 1, (b8, b4, end, page)


def tier_tables(keys: torch.Tensor, b8: int, b4: int, end: int, page: int) -> TieredBlockTables:
    """The filled TieredBlockTables of sorted key rows (module docstring); no host sync."""
    _check(keys, b8, b4, end, page)
    B, L = keys.shape
    dev = keys.device
    t16, f16 = torch.empty((B, L), dtype=torch.int32, device=dev), torch.empty((B, L), dtype=torch.int32, device=dev)
    ints = torch.zeros((4, B, L), dtype=torch.int32, device=dev)  # t8, f8, t4, f4: unused entries stay 0
    counts = torch.empty((2, 3, B), dtype=torch.int32, device=dev)  # lens, num_pages per tier
    if B and L:
        _tier_tables_kernel[(B, 3)](keys, keys.stride(0), L, b8, b4, end, t16, f16, ints[0], ints[1], ints[2],
                                    ints[3], L, counts[0], counts[1], B, PAGE=page, BLOCK=BLOCK, num_warps=4)
    else:
        counts.zero_()
    lens, npages = counts[0], counts[1]
    return TieredBlockTables((t16, ints[0], ints[2]), (lens[0], lens[1], lens[2]), (f16, ints[1], ints[3]),
                             (npages[0], npages[1], npages[2]))


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
