"""The cold tier (`--kv-cold-tier`): int4 and dropped tokens that decode attends near come back to fp16.

When tiering demotes a token to int4, the pool's HostColdStore keeps its exact fp16 K/V in host
memory (mem_cache/host_cold_store.py), as long as the int4 id lives. When it drops a token
(slot 0 in the row, no id), `keep_dropped` copies the token's fp16 K/V into a host row first;
that row belongs to the request (`_ReqState.dropped`: position -> row) until release_request.
During decode, every `kv_promote_interval` steps:

    score    the query the attention backend tapped in `kv_promote_layers` layers (q of the step
             just run, rows [0, B)) against the keys of each request's row (int tiers
             dequantized): mass[j] = max over probed layers and heads of p(j) (spectrum/decode_mass.py;
             on CUDA kernels/cold_mass.py reads the pool in place)
    pick     hits: int4 positions with a host copy whose mass >= kv_promote_threshold; then every
             eligible position within kv_promote_radius of a hit: int4 ones with a host copy, and
             dropped ones with a host copy (they have no key on the device, so they are never
             scored: only a neighbouring hit brings them back); with kv_promote_drop_run > 0, the
             dropped run contiguous with what is picked comes along, up to that many each side;
             a promoted position that is still hot is a hit too (it brings neighbours it left),
             never picked again itself
    cap      kv_promote_max_tokens > 0: at most that many positions per pass, the stretches near
             the strongest hits first; what waits is not marked promoted, so a later pass takes it
    issue    fresh fp16 slots; the host rows of every promotion of the pass gathered into one
             pinned staging buffer; on CUDA a side stream copies it to the device in one copy and
             writes the fp16 store, then records one event; on CUDA the gather and the enqueueing
             run on a copy worker thread (cold_copy.py), the scheduler thread goes on
    land     before the next decode forward (or any later hook) that finds the event done, the
             requests' rows are rewritten to the new slots (never waits: a copy not done stays
             pending): every landing request planned together on the host (one set of tensor ops
             finds the page holes of all their rows), then ONE pool.move for all their page
             repairs and ONE table write for all their row entries

Host syncs: a step with no pass due and nothing pending runs no torch op in these hooks. A pass
keeps the due rows, candidates, masses and picks on the device as [n, W] tensors and reads back
the candidate counts, then the picked positions (with old ids, masses, cap scores); a landing
hook reads the rows it rewrites in one copy.

A landed dropped position's row entry goes from 0 to an fp16 slot: the attention backends mask
slot 0 per forward from the row, so it is attended from the next step on.

Rows and ownership. The request keeps BORROWING the slots it was given (radix-cache prompt tokens,
its own demoted tokens); a promotion points its row at slots it OWNS instead:

    row[pos]:  original slot (borrowed, or 0 if dropped)  ->  promoted fp16 slot (owned)
    the row's tokens past the first hole of an int page it now sees holed  ->  owned copies on
                                         fresh pages (codes bit for bit; the row keeps the page's
                                         head [0, hole), so the prefix-fill invariant of
                                         mem_cache/README.md section 7 keeps holding for the row)

`release_request` (the scheduler calls it before the request's KV is cached or freed) frees every
owned slot and writes the original slots back, so the radix cache and the allocator see exactly
the row they handed out (slot 0 where a token was dropped): a promotion is private to one
request and lasts as long as it does. It frees the request's dropped-token host rows too; those
of a request collected without release_request are queued by a weakref finalizer and freed at
the next hook. Only the scheduler thread touches this state.
"""
from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, field
from weakref import WeakKeyDictionary

import torch

from sgl_kvxfer.mem_cache.host_cold_store import HostColdStore
from sgl_kvxfer.scheduler.cold_copy import CopyWorker, PromotionCopy
from sgl_kvxfer.spectrum.decode_mass import extend_runs_rows, pool_mass
from sgl_kvxfer.spectrum.query_taps import install_query_taps, probe_layers
from sgl_kvxfer.spectrum.tiers import TIER_DROP, TIER_FP16, TIER_INT4, TIER_INT8

logger = logging.getLogger(__name__)


@dataclass
class _Pending:
    req: object
    positions: torch.Tensor   # CPU int64
    old: torch.Tensor         # the int4 ids scored (CPU)
    new: torch.Tensor         # fp16 ids the copy fills (CPU)
    event: PromotionCopy | None = None  # the pass's copy (cold_copy.py); None: merged for landing


@dataclass
class _ReqState:
    original: dict = field(default_factory=dict)  # position -> the slot the request was given
    promoted: set = field(default_factory=set)    # positions promoted (or in flight)
    dropped: dict = field(default_factory=dict)   # dropped position -> its host row (owned by this request)
    finalizer: object = None                      # frees `dropped` if the request vanishes unreleased


class ColdTier:
    def __init__(self, config, runner, allocator, table, make_room, ranking: list[int] | None = None):
        pool = runner.kv_pool
        self.pool, self.allocator, self.table, self.make_room = pool, allocator, table, make_room
        self.threshold, self.interval = config.kv_promote_threshold, config.kv_promote_interval
        self.radius = config.kv_promote_radius
        self.drop_run = getattr(config, "kv_promote_drop_run", 0)
        self.max_tokens = getattr(config, "kv_promote_max_tokens", 0)  # per pass, 0: no cap
        capacity = config.kv_cold_tier_tokens or pool.memory_tokens
        self.store = HostColdStore(capacity, pool.num_layers, pool.num_kv_heads, pool.head_dim, pool.dtype,
                                   pool.base(TIER_INT4), pool.num_slots(TIER_INT4), pool.device)
        pool.cold = self.store
        self.runner, self.scale = runner, runner.attn_backend.scale
        taps = runner.attn_backend.query_taps  # installed by the runner before its graphs (query_taps.py)
        self.layers, self.taps = (sorted(taps), taps) if taps else ([], None)
        if not taps:  # a runner built without them (tests): no graphs to keep in step
            self.set_probe_layers(probe_layers(pool.num_layers, config.kv_promote_layers, ranking))
        self.cuda = str(pool.device).startswith("cuda")
        self.side = torch.cuda.Stream(device=pool.device) if self.cuda else None
        self.worker = CopyWorker(threaded=self.cuda)  # CUDA: the host gather off the scheduler thread
        self.states: WeakKeyDictionary = WeakKeyDictionary()
        self.decode_steps: WeakKeyDictionary = WeakKeyDictionary()  # req -> decode steps seen
        self.pending: list[_Pending] = []
        # global id -> owned by a request's row (promoted slots and page-repair copies; one owner each)
        self._owned = torch.zeros(pool.id_end, dtype=torch.bool)
        self._orphans: list[dict] = []  # `dropped` maps of requests collected without release_request
        self.enabled = True  # False: no scoring (benchmarks compare on one engine; copies still kept)
        self.kernel = None  # the scoring kernel: None where it applies (pool_mass), True / False forced
        self.stats = {"scoring_passes": 0, "scored_tokens": 0, "promotions": 0, "promoted_tokens": 0,
                      "promoted_bytes_h2d": 0, "repacked_tokens": 0, "deferred": 0, "no_room": 0, "cancelled": 0,
                      "landed": 0, "stale": 0, "restored_dropped": 0, "restored_dropped_bytes_h2d": 0,
                      "staging_copies": 0, "capped_tokens": 0, "repack_moves": 0}

    def set_probe_layers(self, layers: list[int]) -> None:
        """Tap the decode queries of `layers` (replaces the taps). Only where no CUDA graph was
        captured: a graph's copies into the taps are fixed at capture (spectrum/query_taps.py)."""
        pool, runner = self.pool, self.runner
        if not layers or any(not 0 <= layer < pool.num_layers for layer in layers):
            raise ValueError(f"probe layers must be in [0, {pool.num_layers}), got {layers}")
        if getattr(runner, "graph_runner", None) is not None and sorted(layers) != self.layers:
            raise ValueError("the probe layers are fixed once CUDA graphs are captured: choose them at start-up "
                             "(--kv-promote-layers, --kv-layer-profile)")
        self.taps = install_query_taps(runner.attn_backend, layers, runner.max_running_requests, pool.dtype,
                                       pool.device)
        self.layers = sorted(layers)

    # ------------------------------------------------------------------ dropped tokens
    def keep_dropped(self, req, start: int, slots: torch.Tensor, tiers: torch.Tensor) -> None:
        """Before `slots` (row positions [start, start + len), position order) are re-tiered to
        `tiers`: the fp16 tokens about to be dropped get host copies of their exact K/V, owned by
        `req` until release_request. Call it before the retier that frees their ids."""
        slots = slots.reshape(-1).cpu()
        drop = (self.pool.tier_of(slots) == TIER_FP16) & (tiers.reshape(-1).cpu() == TIER_DROP)
        if not bool(drop.any()):
            return
        idx = drop.nonzero().squeeze(1)
        rows = self.store.keep_dropped(self.pool.k16, self.pool.v16, slots[idx])
        ok = rows >= 0
        if not bool(ok.any()):
            return
        state = self._state(req)
        state.dropped.update(zip((idx[ok] + start).tolist(), rows[ok].tolist()))

    def _state(self, req) -> _ReqState:
        state = self.states.get(req)
        if state is None:
            state = self.states[req] = _ReqState()
            # NOTE: the callback only queues the map (GC may run it anywhere); the scheduler
            # thread frees its rows at its next hook
            state.finalizer = weakref.finalize(req, self._orphans.append, state.dropped)
        return state

    def _free_orphans(self) -> None:
        while self._orphans:
            rows = self._orphans.pop()
            if rows:
                self.store.free_rows(torch.tensor(list(rows.values()), dtype=torch.int64))

    # ------------------------------------------------------------------ the decode hook
    def on_decode(self, batch) -> None:
        """After a decode step: land finished copies, score the requests due (their first decode
        step, then every `interval`), land what is already there (CPU: all of it)."""
        self._free_orphans()
        self._land()
        if not self.enabled:
            return
        due = []
        for i, s in enumerate(batch.slices):
            n = self.decode_steps.get(s.req, 0)
            self.decode_steps[s.req] = n + 1
            if n % self.interval == 0:
                due.append(i)
        if due:
            self._score(batch, due)
            self._land()

    def _score(self, batch, due: list[int]) -> None:
        """One pass over the due requests, on the pool's device: the rows, their candidates, the
        masses and the picks are [n, W] device tensors (W the longest row); the host reads back
        only the candidate counts and the picked positions (with their old ids, masses and cap
        scores): a fixed number of small device -> host copies a pass, none of them [n, W]."""
        live = [i for i in due if batch.slices[i].req.req_pool_idx is not None
                and batch.slices[i].req.finished_reason is None]
        if not live:
            return
        reqs = [batch.slices[i].req for i in live]
        block, lens, cand, near, kept = self._due_block(reqs)
        counts = cand.sum(dim=1).cpu()  # one device -> host copy: requests with nothing to score drop out
        if not bool(counts.any()):
            return
        self.stats["scoring_passes"] += 1
        self.stats["scored_tokens"] += int(counts.sum())
        mass = self._mass(self.pool._to_device(torch.tensor(live, dtype=torch.int64)), block, lens)
        # a request without candidates is left out whole (its promoted hot tokens bring nothing)
        has = self.pool._to_device(counts > 0)[:, None]
        picks = self._select(reqs, block, mass, cand & has, near & has, kept & has)
        if picks and self.max_tokens:
            picks = self._cap(picks)
        if picks:
            self._issue([p[:3] for p in picks])

    def _due_block(self, reqs: list) -> tuple:
        """The rows of `reqs` on the device and what the pass may pick in them, all [n, W]:
            block   slot ids, 0 past each row's kv_len
            cand    int4 ids with a host copy, not promoted already (scored; a hit among them is promoted)
            near    dropped positions with a host copy, not promoted (never scored: a hit's neighbours)
            kept    promoted positions (never picked again; a hot one still brings its neighbours)
        and lens [n]. Host work: the promoted and dropped positions of the requests that have any."""
        pool, store, table = self.pool, self.store, self.table.table
        dev = pool._to_device
        width = max(r.kv_len for r in reqs)
        lens = dev(torch.tensor([r.kv_len for r in reqs], dtype=torch.int64))
        idx = dev(torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64))
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
                state = self.states.get(req)
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

    def _mass(self, rows: torch.Tensor, block: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        """mass [n, W] float32: pool_mass over the probed layers (decode_mass.py) of the taps'
        rows `rows`: the scoring kernel reading the pool on CUDA, the pool's read path elsewhere."""
        queries = {layer: self.taps[layer].index_select(0, rows) for layer in self.layers}
        return pool_mass(self.pool, self.layers, queries, block, lens, self.scale, kernel=self.kernel)

    def _select(self, reqs: list, block, mass, cand, near, kept) -> list:
        """The pass's picks on the device, then read back once: hits are candidates (or promoted
        positions) with mass >= threshold; a pick is a candidate or a dropped position within
        `radius` of a hit, plus (drop_run > 0) the dropped run contiguous with it, up to drop_run
        each side. -> [(req, positions, old ids, mass at them, cap score at them)] (CPU), the cap
        score being the largest hit mass within `radius` of the position."""
        hot = (mass >= self.threshold) & (cand | kept)
        eligible = cand | near
        r = self.radius
        if r > 0:
            pool1d = torch.nn.functional.max_pool1d
            pick = (pool1d(hot.float()[:, None, :], 2 * r + 1, 1, r)[:, 0] > 0) & eligible
            score = pool1d(torch.where(hot, mass, 0.0)[:, None, :], 2 * r + 1, 1, r)[:, 0]
        else:
            pick, score = hot & eligible, torch.where(hot, mass, 0.0)
        if self.drop_run:
            pick = extend_runs_rows(pick, near, self.drop_run)
        at = pick.nonzero()  # [K, 2] (row, position), row-major: each row's positions ascending
        if not at.numel():
            return []
        j, pos = at[:, 0], at[:, 1]
        ints = torch.stack([j, pos, block[j, pos]]).cpu()  # two device -> host copies for the picks
        vals = torch.stack([mass[j, pos], score[j, pos]]).cpu()
        j, pos, old = ints
        bounds = torch.bincount(j, minlength=len(reqs)).cumsum(0).tolist()
        picks, a = [], 0
        for n, b in enumerate(bounds):
            if b > a:
                picks.append((reqs[n], pos[a:b], old[a:b], vals[0, a:b], vals[1, a:b]))
            a = b
        return picks

    def _cap(self, picks: list) -> list:
        """At most `max_tokens` positions per pass: each pick's positions go in stretches (runs of
        consecutive picked positions, a hit with its neighbours and dropped run), the stretches of
        the whole pass ranked by the largest mass of a hit in them; the stretches that do not fit
        are not marked promoted, so a later pass scores them again (nothing is lost for good,
        only delayed). A stretch larger than the cap alone is cut to the cap around its hit."""
        # every stretch of the pass at once: elements are the picks' positions, concatenated
        sizes = [p[1].numel() for p in picks]
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
        total = pos.numel()
        if total <= self.max_tokens:
            return picks
        # strongest first; ties in pass order (a stable sort over stretches in pass order)
        order = torch.sort(-best, stable=True).indices
        cum = size[order].cumsum(0)
        whole = int((cum <= self.max_tokens).sum())
        keep = torch.zeros(first.numel(), dtype=torch.bool)
        keep[order[:whole]] = True
        kept = keep[sid]
        room = self.max_tokens - (int(cum[whole - 1]) if whole else 0)
        if room > 0 and whole < first.numel():  # cut the next stretch around its strongest position
            s0 = int(order[whole])
            a, b = int(first[s0]), int(first[s0]) + int(size[s0])
            top = a + int(torch.argmax(mass[a:b]))
            a = max(a, min(top - room // 2, b - room))
            kept[a:a + room] = True
        self.stats["capped_tokens"] += total - int(kept.sum())
        out, at = [], 0
        for (req, positions, old, m, sc), n in zip(picks, sizes):
            idx = kept[at:at + n].nonzero().squeeze(1)
            at += n
            if idx.numel():
                out.append((req, positions[idx], old[idx], m[idx], sc[idx]))
        return out

    def _read_block(self, reqs: list) -> torch.Tensor:
        """The rows of `reqs` on the host as one block [n, max kv_len], in one device -> host copy;
        slot 0 past each row's kv_len."""
        table = self.table.table
        width = max(r.kv_len for r in reqs)
        idx = torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64)
        block = table[idx.to(table.device), :width].cpu()
        lens = torch.tensor([r.kv_len for r in reqs], dtype=torch.int64)
        return block.masked_fill_(torch.arange(width)[None, :] >= lens[:, None], 0)

    # ------------------------------------------------------------------ promotion
    def _issue(self, picks: list) -> None:
        """Promote every (req, positions, old ids) of one scoring pass together: fresh fp16 slots per
        request, their host rows, then ONE copy job for the pass (_copy_job: one pinned staging
        buffer, one host -> device copy, one fp16 store write per layer, one event), run on the
        copy worker's thread on CUDA (cold_copy.py), so the host gather does not hold up the
        scheduler; every request's pending landing waits on that copy."""
        if not self.store.ready():  # the newest host copies are still in flight: next pass
            self.stats["deferred"] += len(picks)
            return
        pool = self.pool
        batch = []  # (req, positions, old, new CPU, host rows, restored dropped count)
        for req, positions, old in picks:
            m = positions.numel()
            if self.allocator.available_size() < m:
                self.make_room(TIER_FP16, m)
            new = self.allocator.alloc(m)
            if new is None:
                self.stats["no_room"] += 1
                continue
            state = self._state(req)
            dropped = old == 0  # their rows are the request's (keep_dropped), the rest the int4 ids'
            rows = torch.empty(m, dtype=torch.int64)
            if bool((~dropped).any()):
                rows[~dropped] = self.store.rows_for(old[~dropped])
            if bool(dropped.any()):
                rows[dropped] = torch.tensor([state.dropped[p] for p in positions[dropped].tolist()],
                                             dtype=torch.int64)
            batch.append((req, positions, old, new.cpu(), rows, int(dropped.sum())))
        if not batch:
            return
        if self.cuda:  # the new slots' last users come first
            self.side.wait_stream(torch.cuda.current_stream(pool.device))
        copy = PromotionCopy()
        host_rows, new_all = torch.cat([b[4] for b in batch]), torch.cat([b[3] for b in batch])
        self.worker.submit(copy, lambda c: self._copy_job(c, host_rows, new_all))
        token_bytes = 2 * pool.num_layers * pool.num_kv_heads * pool.head_dim * pool.k16[0].element_size()
        for req, positions, old, new, _, n_drop in batch:
            m = positions.numel()
            self._state(req).promoted.update(positions.tolist())
            self.pending.append(_Pending(req, positions, old, new, copy))
            self.stats["promotions"] += 1
            self.stats["promoted_tokens"] += m
            self.stats["promoted_bytes_h2d"] += m * token_bytes
            self.stats["restored_dropped"] += n_drop
            self.stats["restored_dropped_bytes_h2d"] += n_drop * token_bytes
        self.stats["staging_copies"] += 1

    def _copy_job(self, copy: PromotionCopy, rows: torch.Tensor, new: torch.Tensor) -> None:
        """A pass's copy (CUDA: on the worker thread): host rows `rows` gathered into one pinned
        staging buffer [2, layers, M, Hkv, D], one host -> device copy on the side stream, one
        fp16 store write per layer at slots `new`, one event."""
        pool = self.pool
        stage = torch.empty((2, pool.num_layers, rows.numel(), pool.num_kv_heads, pool.head_dim), dtype=pool.dtype,
                            pin_memory=self.cuda)
        self.store.gather(rows, list(stage[0]), list(stage[1]))
        if not self.cuda:
            for layer in range(pool.num_layers):
                pool.set_kv_fp16(layer, new, stage[0, layer], stage[1, layer])
            return
        with torch.cuda.device(self.side.device), torch.cuda.stream(self.side):
            dst = new.pin_memory().to(pool.device, non_blocking=True)
            dev = stage.to(pool.device, non_blocking=True)
            for layer in range(pool.num_layers):
                pool.set_kv_fp16(layer, dst, dev[0, layer], dev[1, layer])
            event = torch.cuda.Event()
            event.record(self.side)
        copy.keep = (stage, dst, dev)  # NOTE: alive until every landing of this pass (the copy reads them)
        copy.event = event

    def wait_copies(self) -> None:
        """Block until every pending promotion's copy job has run (tests, shutdown); landing
        still happens at the next hook."""
        for p in self.pending:
            if p.event is not None:
                p.event.wait()

    def land(self) -> None:
        """Apply every promotion whose copy has completed (never waits). The scheduler calls it
        before each decode forward too, so a copy issued after step N can serve step N + 1."""
        self._land()

    def _land(self) -> None:
        if not self.pending:  # the common step: no torch op at all
            return
        waiting, ready, done = [], [], {}  # event id -> query() answer: a pass's promotions share one
        for p in self.pending:
            if p.event is not None:
                key = id(p.event)
                if key not in done:
                    done[key] = p.event.query()
                if not done[key]:
                    waiting.append(p)
                    continue
            ready.append(p)
        self.pending = waiting
        if not ready:
            return
        # one landing per request (a request with several ready promotions lands them together);
        # their positions are disjoint: a position in flight is in `promoted`, never picked again
        merged: dict[int, _Pending] = {}
        for p in ready:
            q = merged.get(id(p.req))
            if q is None:
                merged[id(p.req)] = _Pending(p.req, p.positions, p.old, p.new)
            else:
                q.positions, q.old, q.new = (torch.cat([a, b]) for a, b in
                                             ((q.positions, p.positions), (q.old, p.old), (q.new, p.new)))
        live = []
        for p in merged.values():  # released meanwhile: release_request freed what it owned
            if p.req.req_pool_idx is not None and self.states.get(p.req) is not None:
                live.append(p)
            else:
                self.allocator.free(p.new)
        if not live:
            return
        plans = self._plan(live, self._read_block([p.req for p in live]))  # one device -> host copy
        if not plans:
            return
        # every request's page repair in ONE pool.move (codes bit for bit, one pass over the
        # layers), then every row entry in ONE table write; the owned slots the rewrite replaces
        # are freed after both are enqueued, so no copy of this landing can reuse them
        src = torch.cat([plan[5] for plan in plans])
        if src.numel():
            self.pool.move(src, torch.cat([plan[6] for plan in plans]))
            self.stats["repack_moves"] += 1
            self.stats["repacked_tokens"] += src.numel()
        self._rewrite(plans)

    def _plan(self, live: list, block: torch.Tensor) -> list:
        """Host-side plan of a landing, every request at once: each row's promoted positions -> the
        new fp16 slots, and the int tokens of pages the row would then see with a hole (the Triton
        kernels read an int page as its slots [0, fill): mem_cache/README.md section 7) past the
        first hole -> owned copies on fresh pages of their own (one alloc per tier and request, so
        each request holds a prefix of every page it touches). A request without room for its copies changes
        nothing and its positions may be scored again. `live`: the landing's merged promotions,
        one per request, its row block[j, :kv_len] on the host (_read_block).
        -> [(req, state, positions to write, their new slots, their entries now, repack src,
        repack dst)]. The holed pages of all rows come from one set of tensor ops (_holed_rows);
        only the copy-slot allocation runs per request."""
        sizes = torch.tensor([p.positions.numel() for p in live])
        j = torch.repeat_interleave(torch.arange(len(live)), sizes)
        pos = torch.cat([p.positions for p in live])
        new = torch.cat([p.new for p in live])
        cur = block[j, pos]
        same = cur == torch.cat([p.old for p in live])
        if not bool(same.all()):  # the row moved under us (should not happen while it runs)
            self.stats["stale"] += int((~same).sum())
            self.allocator.free(new[~same])
            j, pos, new, cur = j[same], pos[same], new[same], cur[same]
        after = block.clone()
        after[j, pos] = new
        hj, hpos = self._holed_rows(j, cur, after)
        p_end = torch.bincount(j, minlength=len(live)).cumsum(0).tolist()
        h_end = torch.bincount(hj, minlength=len(live)).cumsum(0).tolist()
        plans, pa, ha = [], 0, 0
        for n, p in enumerate(live):
            pb, hb = p_end[n], h_end[n]
            positions, slots, holed = pos[pa:pb], new[pa:pb], hpos[ha:hb]
            pa, ha = pb, hb
            if not positions.numel():
                continue
            old = after[n, holed]
            copies = self._copy_slots(old)
            state = self.states[p.req]
            if copies is None:
                self.stats["no_room"] += 1
                self.allocator.free(slots)
                state.promoted.difference_update(positions.tolist())  # may be scored again
                continue
            self.stats["landed"] += positions.numel()
            at = torch.cat([positions, holed])
            plans.append((p.req, state, at, torch.cat([slots, copies]), block[n, at], old, copies))
        return plans

    def _page_keys(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(page key, offset in page) of int ids, int8 pages numbered first, then int4's
        (the pool's page_offset per store, in one key space)."""
        b8, b4, page = self.pool.base(TIER_INT8), self.pool.base(TIER_INT4), self.pool.page_size
        is4 = ids >= b4
        r = torch.where(is4, ids - b4, ids - b8)
        return r // page + is4 * (-(-(b4 - b8) // page)), r % page

    def _holed_rows(self, j: torch.Tensor, replaced: torch.Tensor, after: torch.Tensor) -> tuple:
        """(row, position) of the int tokens of `after` (rows [n, W], host) that must move for
        each row to hold a prefix of every int page again, rows ascending, positions ascending
        within a row, after rows `j` gave up ids `replaced`. Each row held a prefix [0, count)
        of every page it touches (mem_cache/README.md section 7), so on a page it took ids from
        it still holds [0, h), h the smallest offset it gave up there: only its tokens past h
        move (to fresh pages), the head stays where it is. Only the pages the rows took ids
        from are looked at; every row at once."""
        b8 = self.pool.base(TIER_INT8)
        empty = torch.zeros(0, dtype=torch.int64)
        hit = replaced >= b8
        if not bool(hit.any()):
            return empty, empty
        span = self.pool.id_end  # > every page key: row * span + key never collides
        gave, gave_off = self._page_keys(replaced[hit])
        touched, inv = (j[hit] * span + gave).unique(return_inverse=True)
        head = torch.full((touched.numel(),), self.pool.page_size, dtype=torch.int64)
        head.scatter_reduce_(0, inv, gave_off, "amin")  # h per (row, page) touched
        rj, rpos = (after >= b8).nonzero(as_tuple=True)
        key, off = self._page_keys(after[rj, rpos])
        key = rj * span + key
        at = torch.searchsorted(touched, key).clamp_(max=touched.numel() - 1)
        move = (touched[at] == key) & (off > head[at])
        return rj[move], rpos[move]

    def _copy_slots(self, old: torch.Tensor) -> torch.Tensor | None:
        """Fresh ids for int tokens `old` (position order): their tier's pages, else fp16 slots;
        None (nothing kept) when the pool has no room for them."""
        tiers, new, got_all = self.pool.tier_of(old), old.clone(), []
        for tier in (TIER_INT8, TIER_INT4):
            idx = (tiers == tier).nonzero().squeeze(1)
            if not idx.numel():
                continue
            if self.allocator.available_tier(tier) < idx.numel():
                self.make_room(tier, idx.numel())
            got = self.allocator.alloc_tier(tier, idx.numel()).cpu()
            got_all.append(got)
            if got.numel() < idx.numel():  # the store is short: the rest as fp16 (exact dequantized)
                short = idx.numel() - got.numel()
                if self.allocator.available_size() < short:
                    self.make_room(TIER_FP16, short)
                fp = self.allocator.alloc(short)
                if fp is None:
                    self.allocator.free(torch.cat(got_all))
                    return None
                got = torch.cat([got, fp.cpu()])
                got_all.append(fp.cpu())
            new[idx] = got
        return new

    def _rewrite(self, plans: list) -> None:
        """Point every plan's row positions at its owned slots in one table write (one host ->
        device copy of the indices, non-blocking from pinned memory on CUDA); the owned slots they
        replace are freed. Ownership is one host bool per global id (`_owned`: an id is owned by
        at most one request), so no per-entry Python runs here but the dict update of the
        original slots."""
        plans = [p for p in plans if p[2].numel()]
        if not plans:
            return
        at = torch.cat([p[2] for p in plans])
        slots = torch.cat([p[3] for p in plans])
        cur = torch.cat([p[4] for p in plans])
        who = torch.repeat_interleave(torch.arange(len(plans)), torch.tensor([p[2].numel() for p in plans]))
        was_owned = self._owned[cur]
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
        self._owned[drop] = False
        self._owned[slots] = True
        table = self.table.table
        rows = torch.tensor([p[0].req_pool_idx for p in plans], dtype=torch.int64)[who]
        index = torch.stack([rows, at, slots])
        if self.cuda:
            index = index.pin_memory().to(table.device, non_blocking=True)
        else:
            index = index.to(table.device)
        table[index[0], index[1]] = index[2].to(table.dtype)
        if drop.numel():
            self.allocator.free(drop)

    # ------------------------------------------------------------------ end of a request
    def release_request(self, req) -> None:
        """Before the request's KV is cached or freed: cancel its copies in flight, free what it
        owns and write back the slots it was given."""
        keep = []
        for p in self.pending:
            if p.req is not req:
                keep.append(p)
                continue
            if p.event is not None:  # NOTE: the copy may still write p.new: wait for its job, order the reuse
                p.event.wait(torch.cuda.current_stream(self.pool.device) if self.cuda else None)
            self.allocator.free(p.new)
            self.stats["cancelled"] += 1
        self.pending = keep
        self.decode_steps.pop(req, None)  # a retracted request starts over when it is re-admitted
        state = self.states.pop(req, None)
        if state is not None:  # the dropped tokens' host copies die with the row
            state.finalizer.detach()
            if state.dropped:
                self.store.free_rows(torch.tensor(list(state.dropped.values()), dtype=torch.int64))
        self._free_orphans()
        if state is None or not state.original or req.req_pool_idx is None:
            return
        positions = torch.tensor(list(state.original.keys()), dtype=torch.int64)
        slots = torch.tensor(list(state.original.values()), dtype=torch.int64)
        order = positions.argsort()  # position order (the owned slots are freed in it)
        table = self.table.table
        dev = torch.stack([positions[order], slots[order]]).to(table.device)
        owned = table[req.req_pool_idx, dev[0]].cpu()
        table[req.req_pool_idx, dev[0]] = dev[1].to(table.dtype)
        self._owned[owned] = False
        self.allocator.free(owned)

    def server_info(self) -> dict:
        return {**self.stats, **self.store.stats, "host_rows_in_use": self.store.rows_in_use,
                "host_capacity": self.store.capacity, "pending": len(self.pending), "probe_layers": self.layers,
                "threshold": self.threshold, "interval": self.interval, "radius": self.radius,
                "drop_run": self.drop_run, "max_tokens": self.max_tokens}
