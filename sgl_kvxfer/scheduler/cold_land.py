"""The cold tier's landing (scheduler/cold_tier.py wires it): once a pass's copy is done, the
rows of every landing request are planned together on the host, their page repairs run as ONE
pool.move and their row entries as ONE table write.

Module-level functions over what they are given (the pool, its allocator, the request-to-token
table, the tier's per-request state and counters); no state of their own.

Rows and ownership (cold_tier.py's docstring): a promotion points the row at slots the request
OWNS; the row's tokens past the first hole of an int page it now sees holed move to owned copies
on fresh pages (codes bit for bit), so the row keeps the page's head [0, hole) and the
prefix-fill invariant of mem_cache/README.md section 7 keeps holding for it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from sgl_kvxfer.scheduler.cold_copy import PromotionCopy
from sgl_kvxfer.spectrum.tiers import TIER_FP16, TIER_INT4, TIER_INT8


@dataclass
class Pending:
    """One request's promotion of one pass, from its issue until it lands or is cancelled."""
    req: object
    positions: torch.Tensor   # CPU int64
    old: torch.Tensor         # the int4 ids scored (CPU)
    new: torch.Tensor         # fp16 ids the copy fills (CPU)
    event: PromotionCopy | None = None  # the pass's copy (cold_copy.py); None: merged for landing


def ready_landings(pending: list[Pending]) -> tuple[list[Pending], list[Pending]]:
    """Split `pending` by whether its copy is done (never waits; one query() per pass's copy)
    -> (still waiting, the ready ones merged into one Pending per request, event None)."""
    waiting, ready, done = [], [], {}  # event id -> query() answer: a pass's promotions share one
    for p in pending:
        if p.event is not None:
            key = id(p.event)
            if key not in done:
                done[key] = p.event.query()
            if not done[key]:
                waiting.append(p)
                continue
        ready.append(p)
    # one landing per request (a request with several ready promotions lands them together);
    # their positions are disjoint: a position in flight is in `promoted`, never picked again
    merged: dict[int, Pending] = {}
    for p in ready:
        q = merged.get(id(p.req))
        if q is None:
            merged[id(p.req)] = Pending(p.req, p.positions, p.old, p.new)
        else:
            q.positions, q.old, q.new = (torch.cat([a, b]) for a, b in
                                         ((q.positions, p.positions), (q.old, p.old), (q.new, p.new)))
    return waiting, list(merged.values())


def read_block(table: torch.Tensor, reqs: list) -> torch.Tensor:
    """The rows of `reqs` in the request-to-token `table` on the host as one block
    [n, max kv_len], in one device -> host copy (a sync on CUDA); slot 0 past each row's kv_len.
    The landing reads host mirrors instead; this seeds one that a pass did not (and tests)."""
    width = max(r.kv_len for r in reqs)
    idx = torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64)
    block = table[idx.to(table.device), :width].cpu()
    lens = torch.tensor([r.kv_len for r in reqs], dtype=torch.int64)
    return block.masked_fill_(torch.arange(width)[None, :] >= lens[:, None], 0)


def mirror_block(rows: list[torch.Tensor]) -> torch.Tensor:
    """The landing requests' host row mirrors (cold_tier._ReqState.row) as one block [n, max len],
    slot 0 past each mirror's end: positions the mirror never saw are fp16 decode tokens, which
    the plan treats like slot 0 (it only looks at the int ids and at the promoted positions)."""
    width = max(r.numel() for r in rows)
    block = torch.zeros((len(rows), width), dtype=torch.int64)
    for n, r in enumerate(rows):
        block[n, :r.numel()] = r
    return block


@dataclass
class Holes:
    """The host part of a landing plan (find_holes): for the merged promotions `live`, the
    promoted entries (row j, position pos, new slot, current id cur) and the int tokens past the
    first hole of each page they touch (row hj, position hpos), rows ascending; `after` is the
    row block with the promoted entries rewritten, `block` as it was."""
    live: list
    block: torch.Tensor
    after: torch.Tensor
    j: torch.Tensor
    pos: torch.Tensor
    new: torch.Tensor
    hj: torch.Tensor
    hpos: torch.Tensor


def find_holes(live: list, block: torch.Tensor, pool, stats: dict) -> tuple[Holes, torch.Tensor]:
    """Host-only first half of a landing plan, every request at once: no allocator call, no
    device tensor, so it can run while the decode forward replays. `live`: the merged promotions
    (one per request), their rows block[n] on the host (mirror_block). Entries whose row no
    longer holds the scored id are stale (counted): -> (Holes, the stale entries' new slots,
    for the caller to free later)."""
    sizes = torch.tensor([p.positions.numel() for p in live])
    j = torch.repeat_interleave(torch.arange(len(live)), sizes)
    pos = torch.cat([p.positions for p in live])
    new = torch.cat([p.new for p in live])
    cur = block[j, pos]
    same = cur == torch.cat([p.old for p in live])
    stale = new[:0]
    if not bool(same.all()):  # the row moved under us (should not happen while it runs)
        stats["stale"] += int((~same).sum())
        stale = new[~same]
        j, pos, new, cur = j[same], pos[same], new[same], cur[same]
    after = block.clone()
    after[j, pos] = new
    hj, hpos = holed_rows(pool, j, cur, after)
    return Holes(live, block, after, j, pos, new, hj, hpos), stale


def plan_copies(holes: Holes, pool, allocator, make_room, states, stats: dict) -> list:
    """Second half of a landing plan: fresh ids for each request's holed tokens (one alloc per
    tier and request, so each request holds a prefix of every page it touches). A request without
    room for its copies changes nothing and its positions may be scored again. `states` the tier's
    req -> state map, `stats` its counters (no_room, landed are counted here).
    -> [(req, state, positions to write, their new slots, their entries now, repack src,
    repack dst)]."""
    live, j, hj = holes.live, holes.j, holes.hj
    p_end = torch.bincount(j, minlength=len(live)).cumsum(0).tolist()
    h_end = torch.bincount(hj, minlength=len(live)).cumsum(0).tolist()
    plans, pa, ha = [], 0, 0
    for n, p in enumerate(live):
        pb, hb = p_end[n], h_end[n]
        positions, slots, holed = holes.pos[pa:pb], holes.new[pa:pb], holes.hpos[ha:hb]
        pa, ha = pb, hb
        if not positions.numel():
            continue
        old = holes.after[n, holed]
        copies = copy_slots(old, pool, allocator, make_room)
        state = states[p.req]
        if copies is None:
            stats["no_room"] += 1
            allocator.free(slots)
            state.promoted.difference_update(positions.tolist())  # may be scored again
            continue
        stats["landed"] += positions.numel()
        at = torch.cat([positions, holed])
        plans.append((p.req, state, at, torch.cat([slots, copies]), holes.block[n, at], old, copies))
    return plans


def page_keys(pool, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(page key, offset in page) of int ids, int8 pages numbered first, then int4's
    (the pool's page_offset per store, in one key space). Where the int8 store is a whole
    number of pages (the pools the engine builds) the int4 pages follow on with no gap, so the
    key is one shift of (id - base(INT8)); a power-of-two page takes shifts and masks."""
    b8, b4, page = pool.base(TIER_INT8), pool.base(TIER_INT4), pool.page_size
    r = ids - b8
    pad = -(b4 - b8) % page  # int4 ids move up by this to start on a page boundary
    if pad:
        r = r + (ids >= b4) * pad
    if page & (page - 1) == 0:
        return r >> (page.bit_length() - 1), r & (page - 1)
    return r // page, r % page


def holed_rows(pool, j: torch.Tensor, replaced: torch.Tensor, after: torch.Tensor) -> tuple:
    """(row, position) of the int tokens of `after` (rows [n, W], host) that must move for
    each row to hold a prefix of every int page again, rows ascending, positions ascending
    within a row, after rows `j` gave up ids `replaced`. Each row held a prefix [0, count)
    of every page it touches (mem_cache/README.md section 7), so on a page it took ids from
    it still holds [0, h), h the smallest offset it gave up there: only its tokens past h
    move (to fresh pages), the head stays where it is. Every row at once, dense: h per
    (row that gave up an int id, page key) in one small table (PAGE where untouched, so
    nothing there moves), read by every position of those rows in one gather; rows that
    gave up no int id are not looked at."""
    b8 = pool.base(TIER_INT8)
    empty = torch.zeros(0, dtype=torch.int64)
    hit = replaced >= b8
    if not bool(hit.any()):
        return empty, empty
    page = pool.page_size
    gave, gave_off = page_keys(pool, replaced[hit])
    rows, inv = j[hit].unique(return_inverse=True)  # the rows that gave up int ids, ascending
    keys = int(page_keys(pool, torch.tensor([pool.id_end - 1]))[0][0]) + 1  # page keys are [0, keys)
    head = torch.full((rows.numel() * keys,), page, dtype=torch.int64)
    head.scatter_reduce_(0, inv * keys + gave, gave_off, "amin")
    sub = after.index_select(0, rows)
    is_int = sub >= b8
    key, off = page_keys(pool, sub.clamp_(min=b8))
    at = torch.arange(rows.numel())[:, None] * keys + key
    move = is_int & (off > head[at])
    rj, rpos = move.nonzero(as_tuple=True)
    return rows[rj], rpos


def copy_slots(old: torch.Tensor, pool, allocator, make_room) -> torch.Tensor | None:
    """Fresh ids for int tokens `old` (position order): their tier's pages, else fp16 slots;
    None (nothing kept) when the pool has no room for them."""
    tiers, new, got_all = pool.tier_of(old), old.clone(), []
    for tier in (TIER_INT8, TIER_INT4):
        idx = (tiers == tier).nonzero().squeeze(1)
        if not idx.numel():
            continue
        if allocator.available_tier(tier) < idx.numel():
            make_room(tier, idx.numel())
        got = allocator.alloc_tier(tier, idx.numel(), host=True)  # no device round trip (a sync on CUDA)
        got_all.append(got)
        if got.numel() < idx.numel():  # the store is short: the rest as fp16 (exact dequantized)
            short = idx.numel() - got.numel()
            if allocator.available_size() < short:
                make_room(TIER_FP16, short)
            fp = allocator.alloc(short)
            if fp is None:
                allocator.free(torch.cat(got_all))
                return None
            got = torch.cat([got, fp.cpu()])
            got_all.append(fp.cpu())
        new[idx] = got
    return new


def repair_pages(pool, plans: list, stats: dict) -> None:
    """Every plan's page repair in ONE pool.move (codes bit for bit, one pass over the layers);
    counted in stats (repack_moves, repacked_tokens)."""
    src = torch.cat([plan[5] for plan in plans])
    if src.numel():
        pool.move(src, torch.cat([plan[6] for plan in plans]))
        stats["repack_moves"] += 1
        stats["repacked_tokens"] += src.numel()


def copies_fit(holes: Holes, pool, allocator) -> bool:
    """Whether plan_copies can take every holed token's copy from its own int store's free pages
    as they are now (each request on fresh pages of its own), with no make_room and no fp16
    fallback: then the whole landing is host bookkeeping plus launches, no sync."""
    if not holes.hj.numel():
        return True
    tiers = pool.tier_of(holes.after[holes.hj, holes.hpos])
    page = pool.page_size
    for tier in (TIER_INT8, TIER_INT4):
        per_req = torch.bincount(holes.hj[tiers == tier], minlength=len(holes.live))
        if int((-(-per_req // page)).sum()) * page > allocator.available_tier(tier):
            return False
    return True


def rewrite_rows(plans: list, owned: torch.Tensor, table: torch.Tensor, allocator, cuda: bool) -> torch.Tensor:
    """Point every plan's row positions at its owned slots in one write of the request-to-token
    `table` (one host -> device copy of the indices, non-blocking from pinned memory on CUDA);
    -> the owned slots they replace, for the caller to free (after the write is enqueued; the
    allocator's free may sync, so a landing run during the forward defers it). Ownership is one host bool per global id (`owned`:
    an id is owned by at most one request; updated here), so no per-entry Python runs here but
    the dict update of the original slots."""
    plans = [p for p in plans if p[2].numel()]
    if not plans:
        return torch.zeros(0, dtype=torch.int64)
    at = torch.cat([p[2] for p in plans])
    slots = torch.cat([p[3] for p in plans])
    cur = torch.cat([p[4] for p in plans])
    who = torch.repeat_interleave(torch.arange(len(plans)), torch.tensor([p[2].numel() for p in plans]))
    was_owned = owned[cur]
    # the entries a request was given: kept to write back at release. A position already in
    # `original` holds an owned slot now, so it is never overwritten.
    given = ~was_owned
    given_at, given_cur = at[given].tolist(), cur[given].tolist()
    a = 0
    for (_, state, *_), n in zip(plans, torch.bincount(who[given], minlength=len(plans)).tolist()):
        fresh = dict(zip(given_at[a:a + n], given_cur[a:a + n]))
        a += n
        fresh.update((k, state.original[k]) for k in fresh.keys() & state.original.keys())
        state.original.update(fresh)
    drop = cur[was_owned]
    owned[drop] = False
    owned[slots] = True
    rows = torch.tensor([p[0].req_pool_idx for p in plans], dtype=torch.int64)[who]
    index = torch.stack([rows, at, slots])
    if cuda:
        index = index.pin_memory().to(table.device, non_blocking=True)
    else:
        index = index.to(table.device)
    table[index[0], index[1]] = index[2].to(table.dtype)
    return drop
