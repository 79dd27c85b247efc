"""The cold tier's scoring pass (scheduler/cold_tier.py wires it): the due rows and what they may
pick, their mass, the picks, the per-pass cap, and the pass's promotion copy.

Everything here is a module-level function over what it is given (the pool, the host store, the
request-to-token table, the tier's per-request state): no state of its own. The pass keeps the
due rows, candidates, masses and picks on the device as [n, W] tensors (W the longest row); the
host reads back only the picked positions (with their old ids, masses and cap scores).
"""
from __future__ import annotations

import torch

from sgl_kvxfer.spectrum.decode_mass import extend_runs_rows, pool_mass


def due_block(reqs: list, pool, store, table: torch.Tensor, states) -> tuple:
    """The rows of `reqs` on the device and what the pass may pick in them, all [n, W]:
        block   slot ids, 0 past each row's kv_len
        cand    int4 ids with a host copy, not promoted already (scored; a hit among them is promoted)
        near    dropped positions with a host copy, not promoted (never scored: a hit's neighbours)
        kept    promoted positions (never picked again; a hot one still brings its neighbours)
    and lens [n]. `table` is the request-to-token table, `states` the tier's req -> state map.
    Host work: the promoted and dropped positions of the requests that have any."""
    dev = pool._to_device
    width = max(r.kv_len for r in reqs)
    lens, idx = dev(torch.tensor([[r.kv_len for r in reqs], [r.req_pool_idx for r in reqs]], dtype=torch.int64))
    inside = torch.arange(width, device=table.device)[None, :] < lens[:, None]
    block = table[idx, :width].to(torch.int64).masked_fill_(~inside, 0)
    if store.row_of.numel():
        copies = dev(store.row_of >= 0)  # int4 ids with a host copy (the map lives on the host)
        cand = (block >= store.base) & copies[(block - store.base).clamp_(0, copies.numel() - 1)]
    else:  # no int4 store
        cand = torch.zeros(block.shape, dtype=torch.bool, device=block.device)
    near = torch.zeros_like(cand)
    kept = torch.zeros_like(cand)
    for mask, attr in ((near, "dropped"), (kept, "promoted")):
        at_row, at_pos = [], []
        for j, req in enumerate(reqs):
            state = states.get(req)
            if state is not None and getattr(state, attr):
                pos = torch.tensor(list(getattr(state, attr)), dtype=torch.int64)  # a set's or dict's keys
                pos = pos[pos < req.kv_len]
                at_row.append(torch.full((pos.numel(),), j, dtype=torch.int64))
                at_pos.append(pos)
        if at_pos:
            at = dev(torch.stack([torch.cat(at_row), torch.cat(at_pos)]))  # one host -> device copy
            mask[at[0], at[1]] = True
    near &= block == 0  # a dropped position not landed yet (a landed one has its fp16 slot)
    cand &= ~kept
    near &= ~kept
    return block, lens, cand, near, kept


def pass_mass(pool, taps: dict, layers: list[int], rows: torch.Tensor, block: torch.Tensor,
              lens: torch.Tensor, scale: float, kernel) -> torch.Tensor:
    """mass [n, W] float32: pool_mass over the probed `layers` (decode_mass.py) of the taps'
    rows `rows`: the scoring kernel reading the pool on CUDA, the pool's read path elsewhere
    (`kernel`: None where it applies, True / False forced)."""
    queries = {layer: taps[layer].index_select(0, rows) for layer in layers}
    return pool_mass(pool, layers, queries, block, lens, scale, kernel=kernel)


def select(reqs: list, block, mass, cand, near, kept, threshold: float, radius: int, drop_run: int) -> list:
    """The pass's picks on the device, then read back once: hits are candidates (or promoted
    positions) with mass >= threshold; a pick is a candidate or a dropped position within
    `radius` of a hit, plus (drop_run > 0) the dropped run contiguous with it, up to drop_run
    each side. -> [(req, positions, old ids, mass at them, cap score at them)] (CPU), the cap
    score being the largest hit mass within `radius` of the position."""
    hot = (mass >= threshold) & (cand | kept)
    eligible = cand | near
    r = radius
    if r > 0:
        pool1d = torch.nn.functional.max_pool1d
        pick = (pool1d(hot.float()[:, None, :], 2 * r + 1, 1, r)[:, 0] > 0) & eligible
        score = pool1d(torch.where(hot, mass, 0.0)[:, None, :], 2 * r + 1, 1, r)[:, 0]
    else:
        pick, score = hot & eligible, torch.where(hot, mass, 0.0)
    if drop_run:
        pick = extend_runs_rows(pick, near, drop_run)
    at = pick.nonzero()  # [K, 2] (row, position), row-major: each row's positions ascending
    if not at.numel():
        return []
    j, pos = at[:, 0], at[:, 1]
    # ONE device -> host copy for the picks: float64 holds the int64 ids (< 2^53) and the float32
    # masses exactly
    both = torch.stack([j.double(), pos.double(), block[j, pos].double(), mass[j, pos].double(),
                        score[j, pos].double()]).cpu()
    j, pos, old = both[:3].to(torch.int64)
    vals = both[3:].to(torch.float32)
    bounds = torch.bincount(j, minlength=len(reqs)).cumsum(0).tolist()
    picks, a = [], 0
    for n, b in enumerate(bounds):
        if b > a:
            picks.append((reqs[n], pos[a:b], old[a:b], vals[0, a:b], vals[1, a:b]))
        a = b
    return picks


def cap(picks: list, max_tokens: int) -> tuple[list, int]:
    """At most `max_tokens` positions per pass: each pick's positions go in stretches (runs of
    consecutive picked positions, a hit with its neighbours and dropped run), the stretches of
    the whole pass ranked by the largest mass of a hit in them; the stretches that do not fit
    are not marked promoted, so a later pass scores them again (nothing is lost for good,
    only delayed). A stretch larger than the cap alone is cut to the cap around its hit.
    -> (the picks kept, the number of positions that wait)."""
    # every stretch of the pass at once: elements are the picks' positions, concatenated
    sizes = [p[1].numel() for p in picks]
    total = sum(sizes)
    if total <= max_tokens:  # nothing waits: no stretch needs ranking
        return picks, 0
    pos = torch.cat([p[1] for p in picks])
    mass = torch.cat([p[3] for p in picks])
    score = torch.cat([p[4] for p in picks])  # the strongest hit within `radius` of each position
    owner = torch.repeat_interleave(torch.arange(len(picks)), torch.tensor(sizes))
    start = torch.ones(pos.numel(), dtype=torch.bool)
    start[1:] = (owner[1:] != owner[:-1]) | (pos[1:] != pos[:-1] + 1)
    sid = start.cumsum(0) - 1
    first = start.nonzero().squeeze(1)
    size = torch.bincount(sid, minlength=first.numel())
    best = torch.zeros(first.numel()).scatter_reduce_(0, sid, score, "amax")
    # strongest first; ties in pass order (a stable sort over stretches in pass order)
    order = torch.sort(-best, stable=True).indices
    cum = size[order].cumsum(0)
    whole = int((cum <= max_tokens).sum())
    keep = torch.zeros(first.numel(), dtype=torch.bool)
    keep[order[:whole]] = True
    kept = keep[sid]
    room = max_tokens - (int(cum[whole - 1]) if whole else 0)
    if room > 0 and whole < first.numel():  # cut the next stretch around its strongest position
        s0 = int(order[whole])
        a, b = int(first[s0]), int(first[s0]) + int(size[s0])
        top = a + int(torch.argmax(mass[a:b]))
        a = max(a, min(top - room // 2, b - room))
        kept[a:a + room] = True
    out, at = [], 0
    for (req, positions, old, m, sc), n in zip(picks, sizes):
        idx = kept[at:at + n].nonzero().squeeze(1)
        at += n
        if idx.numel():
            out.append((req, positions[idx], old[idx], m[idx], sc[idx]))
    return out, total - int(kept.sum())


def host_rows(store, dropped: dict, positions: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """The host rows holding the exact K/V of a promotion's `positions` (old ids `old`, CPU):
    a dropped position's (old id 0) is the request's own row (`dropped`: position -> row, from
    keep_dropped), an int4 id's is the store's row for it."""
    is_dropped = old == 0
    rows = torch.empty(positions.numel(), dtype=torch.int64)
    if bool((~is_dropped).any()):
        rows[~is_dropped] = store.rows_for(old[~is_dropped])
    if bool(is_dropped.any()):
        rows[is_dropped] = torch.tensor([dropped[p] for p in positions[is_dropped].tolist()], dtype=torch.int64)
    return rows


def copy_job(pool, store, side, copy, rows: torch.Tensor, new: torch.Tensor) -> None:
    """A pass's copy (CUDA: on the copy worker's thread, cold_copy.py): host rows `rows` gathered
    into one pinned staging buffer [2, layers, M, Hkv, D], one host -> device copy on the side
    stream `side`, one fp16 store write per layer at slots `new` (host or device ids), one event
    recorded on `copy`.
    `side` None (off CUDA): the store is written inline, no event."""
    cuda = side is not None
    stage = torch.empty((2, pool.num_layers, rows.numel(), pool.num_kv_heads, pool.head_dim), dtype=pool.dtype,
                        pin_memory=cuda)
    store.gather(rows, list(stage[0]), list(stage[1]))
    if not cuda:
        for layer in range(pool.num_layers):
            pool.set_kv_fp16(layer, new, stage[0, layer], stage[1, layer])
        return
    with torch.cuda.device(side.device), torch.cuda.stream(side):
        # device ids (the pass's one allocation) are used in place: the side stream waited for the
        # compute stream that made them
        dst = new if new.is_cuda else new.pin_memory().to(pool.device, non_blocking=True)
        dev = stage.to(pool.device, non_blocking=True)
        for layer in range(pool.num_layers):
            pool.set_kv_fp16(layer, dst, dev[0, layer], dev[1, layer])
        event = torch.cuda.Event()
        event.record(side)
    copy.keep = (stage, dst, dev)  # NOTE: alive until every landing of this pass (the copy reads them)
    copy.event = event
