"""The cold tier (`--kv-cold-tier`): int4 and dropped tokens that decode attends near come back to fp16.

When tiering demotes a token to int4, the pool's HostColdStore keeps its exact fp16 K/V in host
memory (mem_cache/host_cold_store.py), as long as the int4 id lives. When it drops a token
(slot 0 in the row, no id), `keep_dropped` copies the token's fp16 K/V into a host row first;
that row belongs to the request (`_ReqState.dropped`: position -> row) until release_request.
During decode, every `kv_promote_interval` steps (score, pick, cap and issue: cold_score.py; land:
cold_land.py; this class wires them and holds the state):

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
    land     once the event is done, the requests' rows are rewritten to the new slots (never
             waits: a copy not done stays pending). prepare(), while the next decode forward
             replays: every landing request planned together from the host mirrors of their rows
             (one set of tensor ops finds the page holes of all of them; no device read), then,
             where the repair copies fit the free int pages, the repair copies' ids, ONE pool.move
             for all their page repairs and ONE table write for all their row entries, enqueued
             behind the forward. land_prepared(), after that forward and before its demotion: a
             plan that did not fit, and the deferred frees. Off CUDA, on_decode lands inline.

Host syncs: a step with no pass due and nothing pending runs no torch op in these hooks. A pass
keeps the due rows, candidates, masses and picks on the device as [n, W] tensors and reads back
the candidate counts, then the picked positions (with old ids, masses, cap scores); the rows a
landing plans from are host mirrors (_ReqState.row): a snapshot the side stream copies with the
pass's copy, then every row write applied on the host too (landings, note_rows from demotion).

Overlapped decode (scheduler/overlap.py): a pass due on step N runs while step N + 1 is in
flight. hold() copies N's taps before N + 1 launches and keeps landings back until the pass has
read back; on CUDA the pass's device work runs on its own stream after that copy, so its reads
wait for its own kernels, not for N + 1's forward; the pass's fp16 ids reach the host through a
non-blocking copy (_host_ids) that every reader of them waits for.

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
from contextlib import nullcontext
from dataclasses import dataclass, field
from weakref import WeakKeyDictionary

import torch

from sgl_kvxfer.mem_cache.host_cold_store import HostColdStore
from sgl_kvxfer.scheduler.cold_copy import CopyWorker, PromotionCopy
from sgl_kvxfer.scheduler.cold_land import (Holes, Pending, copies_fit, find_holes, mirror_block, plan_copies,
                                             read_block, ready_landings, repair_pages, rewrite_rows)
from sgl_kvxfer.scheduler.cold_score import cap, copy_job, due_block, host_rows, pass_mass, select
from sgl_kvxfer.spectrum.query_taps import install_query_taps, probe_layers
from sgl_kvxfer.spectrum.tiers import TIER_DROP, TIER_FP16, TIER_INT4

logger = logging.getLogger(__name__)


@dataclass
class _ReqState:
    original: dict = field(default_factory=dict)  # position -> the slot the request was given
    promoted: set = field(default_factory=set)    # positions promoted (or in flight)
    dropped: dict = field(default_factory=dict)   # dropped position -> its host row (owned by this request)
    finalizer: object = None                      # frees `dropped` if the request vanishes unreleased
    # the host mirror of the row (landing plans read it, never the device table): a snapshot of
    # the row taken by the first pass that promotes in it, then every write to the row applied
    # on the host too (landings here, decode demotion through note_rows). Until `row_copy` (the
    # pass's copy, whose side stream also copies the snapshot) has completed, `row` may still be
    # filling and writes queue in `patches`.
    row: torch.Tensor | None = None
    row_copy: PromotionCopy | None = None
    patches: list = field(default_factory=list)   # (start, ids) written while the snapshot fills


@dataclass
class _HeldPass:
    """What a scoring pass due on decode step `batch` reads that the step launched behind it
    overwrites, taken before that launch (ColdTier.hold)."""
    batch: object
    rows: dict      # id(req) -> its row in the taps (the launch order; the apply drops void rows)
    taps: dict      # layer -> [B, Hq, D] copy of the taps' rows [0, B), made on the compute stream
    after: object   # CUDA event recorded right behind that copy (None off CUDA)


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
        # a held pass's own stream (hold), apart from the copies on `side`, so its read-backs wait
        # for its kernels alone; high priority: it runs beside the next forward and the host waits
        # for it, so its few small kernels take SMs ahead of that forward's blocks
        self.score_stream = torch.cuda.Stream(device=pool.device, priority=-1) if self.cuda else None
        self.worker = CopyWorker(threaded=self.cuda)  # CUDA: the host gather off the scheduler thread
        self.states: WeakKeyDictionary = WeakKeyDictionary()
        self.decode_steps: WeakKeyDictionary = WeakKeyDictionary()  # req -> decode steps seen
        self.pending: list[Pending] = []
        # a landing planned on the host while the decode forward replays (prepare), applied after
        # it (land): its plan, and the slots to free once the allocator may run again
        self._prepared: Holes | None = None
        self._free_later: list[torch.Tensor] = []
        self._hooked = False  # the scheduler calls prepare() during its decode forwards
        # a pass due on the step being applied while the next one is in flight (hold): no
        # landing runs from hold until that pass has read its rows back (on_decode)
        self._held: _HeldPass | None = None
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
        """After a decode step (and its demotion): score the requests due (their first decode
        step, then every `interval`). Off CUDA (copies are synchronous) it lands finished copies
        before and after; on CUDA landing is planned while the next forward replays (prepare)
        and applied after it (land_prepared), never here, except after a pass held for `batch`
        (hold): that pass reads the held taps and, on CUDA, runs on `score_stream`; the hold
        ends with it, and the landing it kept back runs right after it."""
        held, self._held = self._held, None
        held = held if held is not None and held.batch is batch else None
        self._free_orphans()
        if not self.cuda:
            self._land()
        if self.enabled:
            due = []
            for i, s in enumerate(batch.slices):
                n = self.decode_steps.get(s.req, 0)
                self.decode_steps[s.req] = n + 1
                if n % self.interval == 0:
                    due.append(i)
            if due:
                self._score(batch, due, held)
                if not self.cuda:
                    self._land()
        if held is not None and self.cuda:
            # what prepare and land_prepared skipped while held, enqueued behind the next forward
            # (attended from the step after it, as a landing in that forward's window is)
            self._land()

    def pass_due(self, batch) -> bool:
        """Whether on_decode(batch) would run a scoring pass: some unfinished request of the
        step reaches its first decode step or a multiple of `interval` (reads state only)."""
        if not self.enabled:
            return False
        steps, interval = self.decode_steps, self.interval
        return any(s.req.finished_reason is None and steps.get(s.req, 0) % interval == 0 for s in batch.slices)

    def hold(self, batch) -> None:
        """Decode step `batch` is launched and the next step is about to launch before it is
        applied (scheduler/overlap.py). Where a pass falls due on `batch`, keep what it reads:

            taps   the next forward overwrites them: the rows [0, B) of every probed layer's tap
                   are copied now, on the compute stream behind `batch`'s forward and ahead of
                   the next one, and an event is recorded behind the copy (`after`)
            rows   the next forward only appends one token per request at its kv_len, which the
                   pass masks out; a landing rewrites ids of old positions, so none runs from
                   here until the pass has read back: prepare and land_prepared skip, and
                   on_decode lands right after the pass, behind the next forward (off CUDA all
                   of it runs in program order). On CUDA the pass runs on `score_stream`
                   after `after`, beside the next forward, and its host reads wait for its own
                   kernels only

        NOTE: what else runs between `after` and the pass touches no id of a live row: the next
        forward writes its new slots; the step's finished requests' final demotion and release
        rewrite their own rows and free their own ids (borrowed prompt ids stay locked by the
        live requests in the radix cache); decode demotion of a running request drains the step
        (EngineTiering.apply_drains), so it never runs here."""
        if not self.pass_due(batch):
            self._held = None
            return
        if self._prepared is not None:
            # a plan of the last forward's window that did not fit: it goes in now (behind
            # `batch`'s forward, before any demotion of its apply rewrites a row it read)
            self._land()
        n = len(batch.slices)
        taps = {layer: self.taps[layer][:n].clone() for layer in self.layers}
        after = None
        if self.cuda:
            after = torch.cuda.Event()
            after.record(torch.cuda.current_stream(self.pool.device))
        self._held = _HeldPass(batch, {id(s.req): i for i, s in enumerate(batch.slices)}, taps, after)

    def _score(self, batch, due: list[int], held: _HeldPass | None = None) -> None:
        """One pass over the due requests, on the pool's device: the rows, their candidates, the
        masses and the picks are [n, W] device tensors (W the longest row); the host reads back
        only the candidate counts and the picked positions (with their old ids, masses and cap
        scores): a fixed number of small device -> host copies a pass, none of them [n, W].
        `held` (hold): the taps copied before the next launch, and on CUDA the pass's device
        work on `score_stream` after them; the promotions are issued on the compute stream."""
        live = [i for i in due if batch.slices[i].req.req_pool_idx is not None
                and batch.slices[i].req.finished_reason is None]
        if not live:
            return
        reqs = [batch.slices[i].req for i in live]
        taps = self.taps if held is None else held.taps
        rows = live if held is None else [held.rows[id(r)] for r in reqs]
        with self._pass_stream(held):
            block, lens, cand, near, kept = self._due_block(reqs)
            counts = cand.sum(dim=1).cpu()  # one device -> host copy: requests with nothing to score drop out
            if not bool(counts.any()):
                return
            self.stats["scoring_passes"] += 1
            self.stats["scored_tokens"] += int(counts.sum())
            mass = self._mass(self.pool._to_device(torch.tensor(rows, dtype=torch.int64)), block, lens, taps)
            # a request without candidates is left out whole (its promoted hot tokens bring nothing)
            has = self.pool._to_device(counts > 0)[:, None]
            picks = self._select(reqs, block, mass, cand & has, near & has, kept & has)
        if picks and self.max_tokens:
            picks = self._cap(picks)
        if picks:
            self._issue([p[:3] for p in picks], block, {id(r): j for j, r in enumerate(reqs)})

    def _pass_stream(self, held: _HeldPass | None):
        """Where a pass's device work runs: the current stream, or (a held pass on CUDA)
        `score_stream` once the held taps are copied. NOTE: every tensor the pass makes is
        allocated while that stream is current, so its memory is reused only in its order; the
        held taps come from the compute stream and are marked used by it. The pass's last
        read-back synchronizes the stream, so what the promotion reads of it later (the block,
        for the row mirror's snapshot on `side`) is complete."""
        if held is None or not self.cuda:
            return nullcontext()
        self.score_stream.wait_event(held.after)
        for t in held.taps.values():
            t.record_stream(self.score_stream)
        return torch.cuda.stream(self.score_stream)

    # the pass's pieces (cold_score.py); benchmarks/throughput/cold_tier_breakdown.py times them by name
    def _due_block(self, reqs: list) -> tuple:
        """block, lens, cand, near, kept of the due `reqs` (cold_score.due_block)."""
        return due_block(reqs, self.pool, self.store, self.table.table, self.states)

    def _mass(self, rows: torch.Tensor, block: torch.Tensor, lens: torch.Tensor, taps: dict | None = None
              ) -> torch.Tensor:
        """mass [n, W] of the rows `rows` of `taps` (default: the live taps) over the probed
        layers (cold_score.pass_mass)."""
        return pass_mass(self.pool, self.taps if taps is None else taps, self.layers, rows, block, lens, self.scale,
                         self.kernel)

    def _select(self, reqs: list, block, mass, cand, near, kept) -> list:
        """The pass's picks, read back once (cold_score.select)."""
        return select(reqs, block, mass, cand, near, kept, self.threshold, self.radius, self.drop_run)

    def _cap(self, picks: list) -> list:
        """At most `max_tokens` positions per pass, strongest stretches first (cold_score.cap);
        what waits is counted in `capped_tokens` and not marked promoted."""
        picks, capped = cap(picks, self.max_tokens)
        self.stats["capped_tokens"] += capped
        return picks

    def _mirror_block(self, states: list) -> torch.Tensor:
        """The landing rows from their host mirrors (cold_land.mirror_block): no device read."""
        return mirror_block([self._row(state) for state in states])

    def _read_block(self, reqs: list) -> torch.Tensor:
        """The rows of `reqs` read from the device table (cold_land.read_block; a sync on CUDA)."""
        return read_block(self.table.table, reqs)

    # ------------------------------------------------------------------ host row mirrors
    def _snapshot(self, reqs: list, block: torch.Tensor, rows: list[int], copy: PromotionCopy) -> None:
        """Host mirrors for `reqs` (rows `rows` of the pass's device `block`) that have none: one
        copy of those rows to the host, on CUDA pinned and non-blocking on the side stream ahead
        of the pass's copy, so `copy`'s event covers it (the scheduler thread never waits)."""
        if not reqs:
            return
        idx = torch.tensor(rows, dtype=torch.int64)
        if self.cuda:
            snap = torch.empty((len(rows), block.shape[1]), dtype=torch.int64, pin_memory=True)
            # behind the compute stream (the caller made side wait for it), where `block` was made,
            # or after the held pass's stream, which its read-back synchronized; NOTE: read after
            # this thread drops it
            block.record_stream(self.side)
            with torch.cuda.stream(self.side):
                snap.copy_(block.index_select(0, self.pool._to_device(idx)), non_blocking=True)
        else:
            snap, copy = block.index_select(0, idx).cpu(), None
        for n, req in enumerate(reqs):
            state = self._state(req)
            state.row, state.row_copy, state.patches = snap[n], copy, []

    def _row(self, state: _ReqState) -> torch.Tensor:
        """The state's row mirror, its queued writes applied once its snapshot is in (the caller
        checked the snapshot's copy is done)."""
        if state.row_copy is not None:
            state.row_copy = None
            state.row = state.row.clone()  # off the pinned snapshot block: it grows on its own
            for start, ids in state.patches:
                self._write_mirror(state, start, ids)
            state.patches = []
        return state.row

    @staticmethod
    def _write_mirror(state: _ReqState, start: int, ids: torch.Tensor) -> None:
        end = start + ids.numel()
        if end > state.row.numel():  # positions past the snapshot: decode tokens (fp16, or slot 0 unseen)
            state.row = torch.cat([state.row, torch.zeros(end - state.row.numel(), dtype=torch.int64)])
        state.row[start:end] = ids

    def note_rows(self, req, start: int, ids: torch.Tensor) -> None:
        """The request's row positions [start, start + len) now hold `ids` (host tensor): decode
        demotion calls it after rewriting the row, so a host mirror stays exact."""
        state = self.states.get(req)
        if state is None or state.row is None:
            return
        ids = ids.reshape(-1).to(torch.int64)
        if state.row_copy is not None:
            state.patches.append((start, ids.clone()))
        else:
            self._write_mirror(state, start, ids)

    # ------------------------------------------------------------------ promotion
    def _issue(self, picks: list, block: torch.Tensor | None = None, row_of: dict | None = None) -> None:
        """Promote every (req, positions, old ids) of one scoring pass together: fresh fp16 slots per
        request, their host rows, then ONE copy job for the pass (cold_score.copy_job: one pinned
        staging buffer, one host -> device copy, one fp16 store write per layer, one event), run on
        the copy worker's thread on CUDA (cold_copy.py), so the host gather does not hold up the
        scheduler; every request's pending landing waits on that copy. `block` (the pass's device
        rows, `row_of`: id(req) -> its row there) seeds the host row mirror of a request that has
        none (_snapshot)."""
        if not self.store.ready():  # the newest host copies are still in flight: next pass
            self.stats["deferred"] += len(picks)
            return
        pool = self.pool
        batch = []  # (req, positions, old, new CPU, host rows, restored dropped count)
        sizes = [positions.numel() for _, positions, _ in picks]
        total = sum(sizes)
        if self.allocator.available_size() < total:
            self.make_room(TIER_FP16, total)
        whole = self.allocator.alloc(total)  # one allocation (and one device -> host read) for the pass
        copy = PromotionCopy()
        parts = self._host_ids(whole, copy).split(sizes) if whole is not None else [None] * len(picks)
        for (req, positions, old), new in zip(picks, parts):
            if new is None:  # short of room for all: request by request, as far as it goes
                m = positions.numel()
                if self.allocator.available_size() < m:
                    self.make_room(TIER_FP16, m)
                new = self.allocator.alloc(m)
                if new is None:
                    self.stats["no_room"] += 1
                    continue
                new = new.cpu()  # NOTE: a sync (with a step in flight, a wait for it): only when short of room
            state = self._state(req)
            # a dropped position's row is the request's (keep_dropped), the rest the int4 ids'
            rows = host_rows(self.store, state.dropped, positions, old)
            batch.append((req, positions, old, new, rows, int((old == 0).sum())))
        if not batch:
            return
        if self.cuda:  # the new slots' last users come first
            self.side.wait_stream(torch.cuda.current_stream(pool.device))
        if block is not None:
            fresh = [b[0] for b in batch if self._state(b[0]).row is None]
            self._snapshot(fresh, block, [row_of[id(r)] for r in fresh], copy)
        rows_all = torch.cat([b[4] for b in batch])
        # the one allocation on the device (its host ids may still be in flight), else the host ids
        new_all = whole if whole is not None and self.cuda else torch.cat([b[3] for b in batch])
        self.worker.submit(copy, lambda c: copy_job(pool, self.store, self.side, c, rows_all, new_all))
        token_bytes = 2 * pool.num_layers * pool.num_kv_heads * pool.head_dim * pool.k16[0].element_size()
        for req, positions, old, new, _, n_drop in batch:
            m = positions.numel()
            self._state(req).promoted.update(positions.tolist())
            self.pending.append(Pending(req, positions, old, new, copy))
            self.stats["promotions"] += 1
            self.stats["promoted_tokens"] += m
            self.stats["promoted_bytes_h2d"] += m * token_bytes
            self.stats["restored_dropped"] += n_drop
            self.stats["restored_dropped_bytes_h2d"] += n_drop * token_bytes
        self.stats["staging_copies"] += 1

    def _host_ids(self, ids: torch.Tensor, copy: PromotionCopy) -> torch.Tensor:
        """The fp16 ids `ids` of a pass's allocation on the host. On CUDA without a wait: one
        non-blocking copy to pinned memory on the compute stream (behind a step in flight, if
        any), an event behind it on `copy` (ids_ready). Every reader of these host ids waits for
        it: the landing through the pass's copy (the side stream waits for the compute stream
        before the copy), release_request through copy.wait_ids()."""
        if not self.cuda:
            return ids.cpu()
        host = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
        host.copy_(ids, non_blocking=True)
        copy.ids_ready = torch.cuda.Event()
        copy.ids_ready.record(torch.cuda.current_stream(self.pool.device))
        return host

    def wait_copies(self) -> None:
        """Block until every pending promotion's copy job has run (tests, shutdown); landing
        still happens at the next hook."""
        for p in self.pending:
            if p.event is not None:
                p.event.wait()

    def prepare(self) -> None:
        """While the decode forward replays: land every promotion whose copy has completed,
        without waiting for the forward. The plan reads only host state (cold_land.find_holes
        over the host row mirrors); where the repair copies fit the int stores' free pages as
        they are (cold_land.copies_fit), the landing is applied here too: host-made int ids, the
        page repair and the table write enqueued behind the forward on its stream (so the
        forward still reads the rows it was launched with), frees deferred to land_prepared.
        Otherwise the plan waits for land_prepared, after the forward, where make_room and the
        fp16 fallback may sync. Never waits; a step with nothing pending runs no torch op."""
        self._hooked = True
        if self._prepared is not None or not self.pending or self._held is not None:
            return
        self._prepare(in_forward=True)

    def _prepare(self, in_forward: bool) -> None:
        self.pending, merged = ready_landings(self.pending)
        live = []
        for p in merged:
            state = self.states.get(p.req)
            if p.req.req_pool_idx is None or state is None:  # released meanwhile: it freed what it owned
                self._free_later.append(p.new)
            elif state.row_copy is not None and not state.row_copy.query():
                self.pending.append(p)  # its mirror's snapshot is not in yet (it comes with an earlier copy)
            else:
                if state.row is None:  # promoted without a pass's block (_issue called alone): read it once
                    state.row = self._read_block([p.req])[0]
                live.append(p)
        if not live:
            return
        holes = self._plan(live, self._mirror_block([self.states[p.req] for p in live]))
        if in_forward and copies_fit(holes, self.pool, self.allocator):
            self._apply(holes)
        else:
            self._prepared = holes

    def land(self) -> None:
        """Apply every promotion whose copy has completed (never waits): what prepare planned,
        else plan and apply now."""
        self._land()

    def land_prepared(self) -> None:
        """After a decode forward, before its demotion rewrites rows: apply what prepare planned
        during it and free what it deferred. Where the scheduler does not call prepare, the whole
        landing runs here. Nothing while a pass is held (hold): on_decode lands after that pass."""
        if self._held is not None:
            return
        if self._prepared is not None or self._free_later or (self.pending and not self._hooked):
            self._land()

    def before_forward(self) -> None:
        """Before a decode forward: landing happens around the forward (prepare, land_prepared)
        where the scheduler calls prepare; else here, so a copy issued after step N serves N + 1."""
        if not self._hooked and self._held is None:
            self._land()

    def _land(self) -> None:
        if self._prepared is None and self.pending:
            self._prepare(in_forward=False)
        holes, self._prepared = self._prepared, None
        if holes is not None:
            self._apply(holes)
        if self._free_later:  # the common step: nothing here, no torch op at all
            self.allocator.free(torch.cat(self._free_later))
            self._free_later = []

    def _apply(self, holes: Holes) -> None:
        """The landing itself: the repair copies' ids, then every request's page repair in ONE
        pool.move (codes bit for bit, one pass over the layers) and every row entry in ONE table
        write; the owned slots the rewrite replaces are freed later (_free_later), after both are
        enqueued, so no copy of this landing can reuse them."""
        plans = self._copies(holes)
        if not plans:
            return
        repair_pages(self.pool, plans, self.stats)
        drop = self._rewrite(plans)
        if drop.numel():
            self._free_later.append(drop)
        for _, state, at, slots, *_ in plans:  # the host mirrors follow the rows (planned from them)
            state.row[at] = slots

    # the landing's pieces (cold_land.py); cold_tier_breakdown.py times them by name
    def _plan(self, live: list, block: torch.Tensor) -> Holes:
        """The host half of every landing request's plan (cold_land.find_holes); stale entries'
        slots are freed when the landing is applied."""
        holes, stale = find_holes(live, block, self.pool, self.stats)
        if stale.numel():
            self._free_later.append(stale)
        return holes

    def _copies(self, holes: Holes) -> list:
        """The copy slots of every plan, one allocation per tier and request (cold_land.plan_copies)."""
        return plan_copies(holes, self.pool, self.allocator, self.make_room, self.states, self.stats)

    def _rewrite(self, plans: list) -> torch.Tensor:
        """Every plan's row entries in ONE table write (cold_land.rewrite_rows) -> the owned slots
        they replace (to free)."""
        return rewrite_rows(plans, self._owned, self.table.table, self.allocator, self.cuda)

    # ------------------------------------------------------------------ end of a request
    def release_request(self, req) -> None:
        """Before the request's KV is cached or freed: cancel its copies in flight, free what it
        owns and write back the slots it was given."""
        if self._prepared is not None and any(p.req is req for p in self._prepared.live):
            self._land()  # its planned landing goes in first (with the others'); undone below
        keep = []
        for p in self.pending:
            if p.req is not req:
                keep.append(p)
                continue
            if p.event is not None:  # NOTE: the copy may still write p.new: wait for its job, order the reuse
                p.event.wait(torch.cuda.current_stream(self.pool.device) if self.cuda else None)
                p.event.wait_ids()  # p.new's host ids are in
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
        positions, slots = positions[order], slots[order]
        table = self.table.table
        dev = self.pool._to_device(torch.stack([positions, slots]))
        # the owned slots the row holds there: from the host mirror (a landing wrote them, so it is
        # materialized), no device read
        owned = self._row(state)[positions].clone()
        table[req.req_pool_idx, dev[0]] = dev[1].to(table.dtype)
        self._owned[owned] = False
        self.allocator.free(owned)

    def server_info(self) -> dict:
        return {**self.stats, **self.store.stats, "host_rows_in_use": self.store.rows_in_use,
                "host_capacity": self.store.capacity, "pending": len(self.pending), "probe_layers": self.layers,
                "threshold": self.threshold, "interval": self.interval, "radius": self.radius,
                "drop_run": self.drop_run, "max_tokens": self.max_tokens}
