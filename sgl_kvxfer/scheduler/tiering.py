"""SpectrumKV in the engine: importance capture, re-tiering when a prefill ends, decode demotion.

The scheduler calls two hooks per batch (both no-ops for requests they do not concern):

    before_forward(batch, fb)    EXTEND: install `fb.extras["attn_observer"]`, which feeds each
                                 request's ImportanceAccumulator with the queries of the last
                                 W prompt positions (every layer and head, chunked prefill too)
                                 DECODE: the cold tier lands promotions whose copies are done
                                 (only where the scheduler does not call during_forward)
    during_forward(batch)        DECODE, the forward launched: the cold tier lands finished
                                 copies while the GPU runs the step (device work behind it)
    after_forward(batch, chunked)  EXTEND, prefill complete: score, assign, re-tier private tokens
                                 DECODE: demote generated tokens older than the recent window

after_forward runs when the step's tokens are applied. On CUDA decode steps overlap (overlap.py):
the next step is usually launched before this one is applied, and after_forward's host work runs
while the GPU computes it. A step whose apply demotes a running request's tokens or runs a
cold-tier scoring pass drains (apply_drains): nothing is launched after it until its
after_forward is done, so that demotion's host work and its two waits (its rows to the host, its
KV-norm totals back) add to the step's time in full, once every R steps per request.

Prefill rule (runs before the prompt enters the radix cache):

    row:  [ matched prefix (cache-owned) | private tokens ...................... ]
          0                       prefix_len                               kv_len
          keeps its cached tiers          policy(I[prefix_len:kv_len], b) -> tiers -> retier

Tokens matched from the radix cache keep the tiers they were cached with: the cache owns them and
other requests may be reading them. Each private run is assigned as its own span at budget b, so
every run, and so the whole cache, respects b. Importance I (Eq. 13) is computed over the full
sequence (attention over all keys, recency from the last token) and then cut to the run. Sinks
are absolute positions [0, s): a run starting at p pins max(0, s - p) of them (policies that
always pin, like sink-protect, pin at the head of each run).

Decode rule: the newest R = kv_decode_recent generated tokens stay fp16; once 2R are unassigned,
the oldest R are assigned by the same policy at b (KV-norm importance: no queries exist yet for
them) and moved, so at most 2R - 1 generated tokens per request wait in fp16. On finish, all but
the newest R are assigned. Keep/drop baselines (pdtrim, sws) trim only the prefill KV, as in
PD transfer, and leave generated tokens fp16.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, replace
from weakref import WeakKeyDictionary

import torch

from sgl_kvxfer.forward_batch import ForwardMode
from sgl_kvxfer.spectrum.budget import KVLayout, assignment_bytes, fp16_bytes
from sgl_kvxfer.spectrum.byte_budget import assign_tiers
from sgl_kvxfer.spectrum.importance import (ImportanceAccumulator, KVNormAccumulator, normalize_importance,
                                             token_importance)
from sgl_kvxfer.spectrum.policies import create_tier_policy
from sgl_kvxfer.spectrum.tiers import NUM_TIERS, TIER_INT4, TIER_INT8
from sgl_kvxfer.utils.host_copy import to_device

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TierSettings:
    policy: str
    budget: float
    unit: str
    int4_allowed: bool
    decode_recent: int
    layer_budget: str = "uniform"      # "profile": per-layer int4 formats (spectrum/layer_budget.py)
    layer_profile: str | None = None   # its JSON
    recency_lambda: float = 0.0        # Eq. 13's lambda


@dataclass(frozen=True)
class TierRecord:
    """One re-tiered run of a request: tiers asked for vs. got (counts by tier id)."""
    rid: str
    start: int
    end: int
    asked: tuple[int, ...]
    got: tuple[int, ...]
    byte_ratio: float  # payload incl. scales / fp16 payload of the run (dropped tokens: 0 bytes)
    tier_map: torch.Tensor | None = None  # int8 [end - start] tiers got, kept only with keep_tier_maps


@dataclass
class _ChunkSnapshot:
    """A streamed chunk's window scores and its row's slot ids, copied to the host behind `ready`."""
    scores: torch.Tensor | None  # float32 [chunk end] (None: no window query was observed)
    row: torch.Tensor  # int64 [chunk end]: the row's slot ids when the chunk was launched
    ready: object = None  # torch.cuda.Event after both copies (None: already on the host)

    @classmethod
    def take(cls, scores: torch.Tensor | None, row: torch.Tensor) -> "_ChunkSnapshot":
        if row.device.type != "cuda":
            return cls(None if scores is None else scores.cpu().clone(), row.cpu().clone())
        host_row = torch.empty(row.shape, dtype=row.dtype, pin_memory=True)
        host_row.copy_(row, non_blocking=True)
        host_scores = None
        if scores is not None:
            host_scores = torch.empty(scores.shape, dtype=scores.dtype, pin_memory=True)
            host_scores.copy_(scores, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return cls(host_scores, host_row, ready)

    def wait(self) -> None:
        if self.ready is not None:
            self.ready.synchronize()
            self.ready = None


def _counts(tiers: torch.Tensor) -> tuple[int, ...]:
    return tuple(torch.bincount(tiers.cpu().to(torch.int64), minlength=NUM_TIERS).tolist())


class EngineTiering:
    def __init__(self, config, runner, kv):
        self.config = config
        self.pool = runner.kv_pool
        self.allocator = kv.allocator
        self.kv = kv
        self.table = runner.req_to_token
        a = runner.arch
        self.runner = runner
        # uniform byte layout; self.layout adds the per-layer formats the stores hold now
        self.base_layout = KVLayout(a.num_hidden_layers, a.num_key_value_heads, a.head_dim, self.pool.group_size,
                                    page_size=self.pool.page_size)
        self.layout = self.base_layout
        self.settings = TierSettings(config.kv_tier_policy, config.kv_tier_budget, config.kv_budget_unit,
                                     config.kv_int4 != "off", config.kv_decode_recent, config.kv_layer_budget,
                                     config.kv_layer_profile, config.kv_recency_lambda)
        self.policy = self._make_policy(self.settings)
        self.allocation = None  # layer_budget.LayerAllocation of the formats in use (profile mode)
        self.int4 = None  # probe.Int4Resolution once resolved
        self._acc: WeakKeyDictionary = WeakKeyDictionary()  # req -> ImportanceAccumulator
        # PD chunk streams: req -> {chunk end: the accumulator of that chunk's window}, until the
        # chunk is launched; then req -> {chunk end: _ChunkSnapshot} until chunk_tiers reads it
        # (with overlapped chunks the next chunk's window exists before this one is tiered)
        self._chunk_acc: WeakKeyDictionary = WeakKeyDictionary()
        self._chunk_snap: WeakKeyDictionary = WeakKeyDictionary()
        self._tiered_len: WeakKeyDictionary = WeakKeyDictionary()  # req -> row prefix at final tiers
        # req -> {int tier: the last id its decode demotion got}: the next run continues that page
        # (decode tokens are private to the request until it finishes, so it holds the whole page)
        self._tails: WeakKeyDictionary = WeakKeyDictionary()
        self.records: deque[TierRecord] = deque(maxlen=4096)
        # req -> [(name, start, end)] time.time() spans of its prompt's tiering (the PD trace)
        self.prefill_spans: WeakKeyDictionary = WeakKeyDictionary()
        self._evict_s = 0.0  # seconds _make_room spent evicting, summed
        # offline tools set this to read which tokens got which tier (one byte per token per record)
        self.keep_tier_maps = False
        # PD prefill (chunk streams): called as hook(req, start, slots, tiers) once a prompt's
        # final tiers are assigned and before its KV moves (slots: host ids of [start, kv_len));
        # work it enqueues on the stream reads the model-dtype rows ahead of the move
        self.final_tiers_hook = None
        self.cold = None
        if config.kv_cold_tier:
            from sgl_kvxfer.scheduler.cold_tier import ColdTier

            # its probe layers' query taps were installed by the runner (spectrum/query_taps.py)
            self.cold = ColdTier(config, runner, self.allocator, self.table, self._make_room)

    # ------------------------------------------------------------------ settings
    def configure(self, **changes) -> TierSettings:
        """Change policy / budget / unit / int4_allowed / decode_recent / layer_budget /
        layer_profile / recency_lambda for later requests; returns the old settings. Requests
        already tiered keep their tiers. The int stores' per-layer formats were fixed when the
        pool was built (mem_cache/__init__.py: tier_store_formats, from the flags): a change that
        needs other formats (to or from KIVI, --kv-layer-budget profile, a budget that moves a
        profile's allocation) is refused with a ValueError; start an engine with those flags. The
        stores' sizes stay too: a mix other than the planned one falls back to a higher tier
        where a store is short (TierRecord.got)."""
        old = self.settings
        new = replace(old, **changes)
        policy = self._make_policy(new)
        self._check_formats(policy, new)
        self.settings, self.policy = new, policy
        return old

    @contextmanager
    def using(self, **changes):
        old = self.configure(**changes)
        try:
            yield self
        finally:
            self.configure(**vars(old))

    def _make_policy(self, st: TierSettings):
        return create_tier_policy(st.policy, layout=self.base_layout, budget=st.budget)

    def _profile(self, st: TierSettings):
        if st.layer_budget != "profile":
            return None
        from sgl_kvxfer.spectrum.layer_budget import LayerProfile

        if not st.layer_profile:
            raise ValueError("layer_budget 'profile' needs a layer_profile JSON")
        return LayerProfile.load(st.layer_profile)

    def _check_formats(self, policy, st: TierSettings) -> None:
        """Refuse settings whose int store formats differ from the pool's (fixed at start-up)."""
        from sgl_kvxfer.spectrum.layer_budget import plan_store_formats

        formats, alloc = plan_store_formats(policy, st.budget, st.unit, self.base_layout, self.config.kv_sink_tokens,
                                            st.int4_allowed, self._profile(st))
        # FusedKV pools hold only the stored layers: uniform formats compare by value, not by count
        same = formats == self.pool.formats or (
            formats.is_uniform and self.pool.formats.is_uniform
            and set(formats.int8) == set(self.pool.formats.int8) and set(formats.int4) == set(self.pool.formats.int4))
        if not same:
            raise ValueError(f"tier settings {st} need int store formats {formats.describe()}, the pool was built "
                             f"with {self.pool.formats.describe()}: the formats are fixed at start-up (start an "
                             f"engine with --kv-tier-policy / --kv-tier-budget / --kv-layer-budget for them)")
        self.layout = replace(self.base_layout, formats=None if formats.is_uniform else formats)
        self.allocation = alloc

    # ------------------------------------------------------------------ hooks
    def before_forward(self, batch, fb) -> None:
        if batch.mode != ForwardMode.EXTEND:
            if self.cold is not None:  # (where during_forward is not called) copies done land before this step
                self.cold.before_forward()
            return
        if not self.config.kv_importance.startswith("attn"):
            return
        head_max = self.config.kv_importance == "attn-max"
        observed, dev, window = {}, fb.input_ids.device, self.config.kv_importance_window
        for i, s in enumerate(batch.slices):
            n, end = s.req.seq_len, s.start + s.length
            acc = self._acc.get(s.req)
            if acc is None or acc.num_tokens != n:
                # every head in one product per layer: the per-head loop's sums (to float32
                # rounding) in Hkv times fewer launches, on the last chunk's critical path
                acc = self._acc[s.req] = ImportanceAccumulator(n, window, dev, fused_heads=not head_max,
                                                               head_max=head_max)
            accs = [acc] if end > acc.window_start else []  # this chunk holds window queries
            if s.req in self._chunk_acc and end < n:  # a streamed chunk: its own window ranks it
                chunk_acc = self._chunk_acc[s.req][end] = ImportanceAccumulator(end, window, dev, fused_heads=True)
                accs.append(chunk_acc)
            if accs:
                observed[i] = (accs, s.start)
        if observed:
            def observe(layer_id, i, q, keys):  # q: the chunk's queries, positions [start, start + len)
                if i in observed:
                    accs, start = observed[i]
                    for acc in accs:
                        acc.add_range(q, keys, start)  # host-known positions: no sync per layer
            observe.requests = frozenset(observed)  # backends that compute keys only for these
            fb.extras["attn_observer"] = observe

    def during_forward(self, batch) -> None:
        """The decode forward is launched and the GPU runs it: the cold tier lands its finished
        copies now, without waiting for it (ColdTier.prepare; what must wait goes in after_forward)."""
        if self.cold is not None and batch.mode != ForwardMode.EXTEND:
            self.cold.prepare()

    def after_launch(self, batch) -> None:
        """Right after an EXTEND batch's forward is launched: each streamed chunk's window scores
        and its row's slot ids [0, chunk end) start copying to pinned host memory, behind an
        event recorded after them. They sit in the stream before any later batch, so
        chunk_tiers waits for this chunk alone, not for a chunk launched after it."""
        if batch.mode != ForwardMode.EXTEND:
            return
        for s in batch.slices:
            end = s.start + s.length
            if s.req not in self._chunk_acc or end >= s.req.seq_len:  # not streamed, or the prompt's last chunk
                continue
            acc = self._chunk_acc[s.req].pop(end, None)  # (none in KV-norm mode)
            scores = acc.scores() if acc is not None and acc.has_data else None
            row = self.table.read(s.req.req_pool_idx, end)
            self._chunk_snap.setdefault(s.req, {})[end] = _ChunkSnapshot.take(scores, row)

    def after_forward(self, batch, chunked) -> None:
        if self.cold is not None and batch.mode != ForwardMode.EXTEND:
            self.cold.land_prepared()  # before the demotion below rewrites rows a plan read
        due = []  # decode: the runs this step demotes, all requests together
        for s in batch.slices:
            req = s.req
            if req.req_pool_idx is None:
                continue
            if batch.mode == ForwardMode.EXTEND:
                # a chunk with more prompt to come is not its prompt's end, even when it is
                # applied after the next chunk was launched (overlapped: `chunked` is None then)
                if req is not chunked and (s.sample or s.start + s.length >= req.seq_len):
                    self._tier_prefill(req)
            else:
                run = self._decode_run(req, final=req.finished)
                if run is not None:
                    due.append(run)
        if due:
            self._demote_runs(due)
        if self.cold is not None and batch.mode != ForwardMode.EXTEND:
            self.cold.on_decode(batch)

    def apply_drains(self, batch) -> bool:
        """Whether applying decode step `batch` (launched, its tokens not yet applied) must run
        with no later step in flight (scheduler/overlap.py): it demotes a running request's
        generated tokens, or a cold-tier scoring pass falls due (the pass reads the taps of this
        step's queries, which a later forward overwrites, and the rows as this step leaves them).
        A request that this step finishes is left out: its final demotion and release run behind
        the next step, which holds only its void token and reads the row it was launched with."""
        if batch.mode == ForwardMode.EXTEND:
            return False
        for s in batch.slices:
            req = s.req
            if req.finished_reason is None and req.req_pool_idx is not None \
                    and self._decode_run(req, final=False, kv_len=s.start + s.length) is not None:
                return True
        return self.cold is not None and self.cold.pass_due(batch)

    def release_request(self, req) -> None:
        """The request's KV is about to be cached or freed: the cold tier gives its row back."""
        if self.cold is not None:
            self.cold.release_request(req)

    def rank_chunks(self, req) -> None:
        """PD chunk streams: from now on each chunk of req is also ranked on its own (its last W
        queries over keys [0, chunk end)), so chunk_tiers can tier it before the prompt ends."""
        self._chunk_acc[req] = {}

    def chunk_tiers(self, req, start: int, end: int, with_slots: bool = False):
        """Tiers at budget b for positions [start, end) of req (its chunk just ended), from the
        chunk's window attention (KV norms where none was observed). The pool is unchanged: the
        prompt's final tiers still come from the whole prompt at its end. With `with_slots`:
        (tiers, the host slot ids of [start, end) as the chunk's launch left the row, or None
        where no snapshot was taken); a later chunk still running on the GPU is not waited for."""
        snaps = self._chunk_snap.get(req) or {}
        snap = snaps.pop(end, None)
        for stale in [e for e in snaps if e < end]:  # chunks never tiered (a failed room)
            del snaps[stale]
        if snap is not None:
            snap.wait()
        if self.config.kv_importance.startswith("attn") and snap is not None and snap.scores is not None:
            importance = token_importance(snap.scores, self.config.kv_recency_lambda)[start:]
        else:
            slots = snap.row[start:end] if snap is not None else self.table.read(req.req_pool_idx, end, start=start).cpu()
            importance = token_importance(self._norm_importance(slots), self.config.kv_recency_lambda)
        st = self.settings
        sinks = max(0, self.policy.sink_count(self.config.kv_sink_tokens) - start)
        tiers = assign_tiers(self.policy, importance, st.budget, self.layout, st.unit, sinks, st.int4_allowed,
                             self.config.random_seed)
        if not with_slots:
            return tiers
        return tiers, (snap.row[start:end] if snap is not None else None)

    def mark_tiered(self, req, n: int) -> None:
        """Positions [0, n) of req are final (PD decode: the prompt came tiered from the
        prefill); decode demotion starts after them."""
        self._tiered_len[req] = n
        self._tails.pop(req, None)

    # ------------------------------------------------------------------ rules
    def _tier_prefill(self, req) -> None:
        start, n = req.prefix_len, req.kv_len
        acc = self._acc.pop(req, None)
        if n <= start:
            return
        t0 = time.time()
        slots = self.table.read(req.req_pool_idx, n).cpu()  # ids on the host: retier's routing runs no sync
        if self.config.kv_importance.startswith("attn") and acc is not None and acc.has_data and acc.num_tokens == n:
            attn = acc.scores().cpu()  # (on a GPU: waits for the prompt's last forward)
        else:  # norm mode, or a backend that feeds no observer
            attn = self._norm_importance(slots)
        importance = token_importance(attn, self.settings.recency_lambda)[start:]
        sinks = max(0, self.policy.sink_count(self.config.kv_sink_tokens) - start)
        t1, cpu1 = time.time(), time.thread_time()
        evict0 = self._evict_s
        parts = self._retier(req, start, slots[start:], importance, sinks)
        t2, cpu = time.time(), time.thread_time() - cpu1
        # tier_evict: the summed time the retier spent evicting radix leaves for room in an int
        # store, drawn from the retier's start (the evictions interleave with its data moves);
        # tier_retier_cpu: the scheduler thread's CPU time in the retier, drawn the same way (far
        # below tier_retier: the thread waited, on the OS, the GIL or the device)
        evict = self._evict_s - evict0
        self.prefill_spans[req] = [("tier_scores", t0, t1), ("tier_retier", t1, t2), *parts,
                                   ("tier_retier_cpu", t1, min(t2, t1 + cpu))] + (
            [("tier_evict", t1, t1 + evict)] if evict > 0 else [])
        self._tiered_len[req] = n
        self._tails.pop(req, None)  # a re-prefilled (retracted) request starts fresh pages

    def _decode_run(self, req, final: bool, kv_len: int | None = None):
        """(req, start, end) of the generated tokens due for demotion once req's row holds
        `kv_len` tokens (default: req.kv_len), or None."""
        done = self._tiered_len.get(req)
        recent = self.settings.decode_recent
        if done is None or self.policy.keep_drop:
            return None
        end = (req.kv_len if kv_len is None else kv_len) - recent
        if end - done < (1 if final else recent):
            return None
        return req, done, end

    def _demote_runs(self, runs: list) -> None:
        """Decode demotion of every due request at once: one host copy of their slots, one KV-norm
        pass over the layers for all of them, the tiers assigned per run (each run normalized on
        its own, as a lone run would be), then one retier_runs: each run on its own pages (the
        free tail of its previous run's last page first), one data move (fp16 -> int: one
        quantize-and-store launch per tier for all layers on CUDA). The host reads the device
        table once (each run's row from its oldest live tail's position, so the tails are checked
        on that copy); everything after it runs on host ids."""
        spans = []  # (req, start, end, first position read: the oldest tail's, else start)
        for req, start, end in runs:
            tails = self._tails.get(req) or {}
            spans.append((req, start, end, min([start, *(pos for _, pos in tails.values())])))
        host = torch.cat([self.table.read(req.req_pool_idx, end, start=lo) for req, _, end, lo in spans]).cpu()
        rows, at = [], 0
        for req, start, end, lo in spans:
            rows.append((host[at:at + end - lo], lo))
            at += end - lo
        slots = torch.cat([row[start - lo:] for (row, lo), (_, start, _, _) in zip(rows, spans)])
        joint = self._norm_importance(slots)  # normalized over every run's tokens
        st, parts, pos = self.settings, [], 0
        for (req, start, end, _), (row, lo) in zip(spans, rows):
            n = end - start
            run_slots, imp = slots[pos:pos + n], joint[pos:pos + n]
            pos += n
            if len(runs) > 1:  # renormalized over the run alone (a lone run's scores are already)
                imp = imp / imp.sum()
            tiers = assign_tiers(self.policy, imp, st.budget, self.layout, st.unit, 0, st.int4_allowed,
                                 self.config.random_seed)
            if self.cold is not None:  # copies of the tokens it drops, before their ids are freed
                self.cold.keep_dropped(req, start, run_slots, tiers)
            parts.append((run_slots, tiers, self._live_tails(req, row, lo)))
        results = self.allocator.retier_runs(parts, self._make_room)
        for (req, start, end), (run_slots, tiers, _), (new, got) in zip(runs, parts, results):
            # host ids in, host ids out (retier_runs plans on the host): no copy back below
            self._record(req, start, run_slots, tiers, new, got)
            self._tiered_len[req] = end
            tails = dict(self._tails.get(req) or {})
            if self.cold is not None:  # its host mirror of the row follows the rewrite
                self.cold.note_rows(req, start, new)
            moved = new != run_slots
            for t in (TIER_INT8, TIER_INT4):
                idx = (moved & (got == t)).nonzero().squeeze(1)
                if idx.numel():
                    tails[t] = (int(new[idx[-1]]), start + int(idx[-1]))  # (id, row position)
            self._tails[req] = tails

    def _live_tails(self, req, row: torch.Tensor, lo: int) -> dict | None:
        """{tier: id} of the request's previous decode runs' last pages, each only if the row still
        holds that id at its position (a request retracted and recomputed starts afresh). row: the
        host copy of the request's row from position lo (lo <= every tail's position)."""
        tails = self._tails.get(req)
        if not tails:
            return None
        return {t: slot for t, (slot, pos) in tails.items() if int(row[pos - lo]) == slot}

    def _retier(self, req, start: int, slots: torch.Tensor, importance: torch.Tensor, sinks: int) -> list:
        """Assign and move one prompt run; returns the trace's parts of tier_retier: tier_assign
        (the byte-budget search, host), tier_move (ids planned on the host, the moves launched
        behind one staged index copy) and tier_row (the row's new ids queued through pinned
        memory behind the moves, and the record kept; the host does not wait for the moves)."""
        st = self.settings
        t0 = time.time()
        tiers = assign_tiers(self.policy, importance, st.budget, self.layout, st.unit, sinks, st.int4_allowed,
                             self.config.random_seed)
        if self.cold is not None:  # copies of the tokens it drops, before their ids are freed
            self.cold.keep_dropped(req, start, slots, tiers)
        t1 = time.time()
        if self.final_tiers_hook is not None:
            self.final_tiers_hook(req, start, slots, tiers)
        t1b = time.time()
        new, got = self.allocator.retier(slots, tiers, self._make_room)
        t2 = time.time()
        self._record(req, start, slots, tiers, new, got)
        return [("tier_assign", t0, t1), ("tier_move", t1b, t2), ("tier_row", t2, time.time())]

    def _record(self, req, start: int, slots, tiers, new, got) -> None:
        """Rewrite the request's row at the new ids and keep the run's TierRecord. Host ids go
        up through pinned memory: the host does not wait for the moves queued before the write."""
        row_ids = to_device(new, self.table.table.device) if new.device.type == "cpu" else new
        self.table.write(req.req_pool_idx, start, row_ids)
        got = got.cpu()
        ratio = assignment_bytes(got, self.layout) / fp16_bytes(got.numel(), self.layout)
        self.records.append(TierRecord(req.rid, start, start + slots.numel(), _counts(tiers), _counts(got), ratio,
                                       got.to(torch.int8) if self.keep_tier_maps else None))

    def _make_room(self, tier: int, count: int) -> None:
        """A tier store is short: evict LRU cache leaves until `count` more of its tokens are
        free in whole pages (a page frees with its last live id)."""
        if self.kv.tree is not None:
            t0 = time.perf_counter()
            self.kv.tree.evict(count, reclaim=self.allocator.page_reclaimer(tier))
            self._evict_s += time.perf_counter() - t0

    def _norm_importance(self, slots: torch.Tensor) -> torch.Tensor:
        """KV-norm importance of host ids `slots`, accumulated on the pool's device (one copy
        back). Where every id is an fp16 row of a pool that keeps every layer's rows in one
        tensor, the layers are read in a few gathers (_stacked_norms); else one read per layer."""
        total = self._stacked_norms(slots)
        if total is None:
            acc = KVNormAccumulator(slots.numel(), device=self.pool.device)
            route = self.pool.route(slots)
            for layer_id in range(self.pool.num_layers):
                if not self.pool.stores_layer(layer_id):  # FusedKV reconstruction layer: nothing stored
                    continue
                acc.add_layer(*self.pool.get_kv_routed(layer_id, route))
            total = acc.totals()
        return normalize_importance(total.cpu())  # on the host: the copy is the one wait

    # one _stacked_norms gather's K rows in float32 bytes at most (its transient peak is about
    # three times this: K and V gathered, each upcast): a decode run's 32 layers of a few hundred
    # tokens fit in one gather, a 16k-token prompt takes one layer per gather as the loop did
    _NORM_CHUNK_BYTES = 64 << 20

    def _stacked_norms(self, slots: torch.Tensor) -> torch.Tensor | None:
        """KVNormAccumulator's summed per-layer norms of fp16 ids `slots`, from the pool's
        [L, rows, Hkv, D] tensors: each gather takes several layers (all of them for a decode
        run), so a step runs a handful of launches instead of ~10 per layer. Each layer's norm
        is the per-layer path's; their sum over layers is one reduction instead of L running adds
        (equal to float32 rounding). None: a pool without stacked rows, or ids outside the fp16
        store."""
        from sgl_kvxfer.mem_cache.tiered_pool import TieredKVPool

        pool = self.pool
        flat = slots.reshape(-1)
        if not isinstance(pool, TieredKVPool) or not flat.numel() or bool((flat >= pool.base(TIER_INT8)).any()):
            return None
        k_all, v_all = pool.stacked_rows()
        L, _, H, D = k_all.shape
        rows = to_device(flat.to(torch.int64), k_all.device)
        total = torch.zeros(flat.numel(), dtype=torch.float32, device=k_all.device)
        step = max(1, self._NORM_CHUNK_BYTES // max(1, flat.numel() * H * D * 4))
        for l0 in range(0, L, step):
            k = k_all[l0:l0 + step].index_select(1, rows)  # [l, n, Hkv, D]
            v = v_all[l0:l0 + step].index_select(1, rows)
            norm = 0.5 * (k.float().norm(dim=-1).mean(dim=-1) + v.float().norm(dim=-1).mean(dim=-1))
            total += norm.sum(0)
        return total

    # ------------------------------------------------------------------ int4 decision
    def set_int4(self, resolution) -> None:
        """Apply the int4 decision to the settings. The pool was sized for it when it was built
        (ModelRunner's `int4`), so nothing is re-divided."""
        self.int4 = resolution
        self.configure(int4_allowed=resolution.enabled)
        logger.info("SpectrumKV: int4 %s (%s); stores fp16 %d / int8 %d / int4 %d slots",
                    "on" if resolution.enabled else "off", resolution.source,
                    self.pool.plan.n16, self.pool.plan.n8, self.pool.plan.n4)

    def server_info(self) -> dict:
        formats = self.pool.formats
        layer = {"kv_layer_budget": self.settings.layer_budget,
                 "kv_int_formats": None if formats.is_uniform else formats.describe()}
        if self.allocation is not None:
            layer["kv_layer_allocation"] = {"upgraded": list(self.allocation.upgraded),
                                            "lowered": list(self.allocation.lowered),
                                            "predicted_kl_gain": self.allocation.predicted_gain}
        if self.cold is not None:
            layer["kv_cold_tier"] = self.cold.server_info()
        return {**layer, "kv_tier_policy": self.settings.policy, "kv_tier_budget": self.settings.budget,
                "kv_int4_enabled": self.settings.int4_allowed,
                "kv_int4_source": self.int4.source if self.int4 is not None else "unresolved",
                "kv_full_bytes_per_token": float(self.pool.full_bytes_per_token()),
                "kv_tier_slots": [self.pool.plan.n16, self.pool.plan.n8, self.pool.plan.n4]}


def create_engine_tiering(scheduler) -> EngineTiering | None:
    """SpectrumKV for this scheduler, under the int4 decision its runner's pool was sized by
    (scheduler/startup.py); None at kv_tier_budget 1."""
    config = scheduler.config.engine
    if not config.tiering_enabled:
        return None
    tiering = scheduler.tiering = EngineTiering(config, scheduler.runner, scheduler.kv)
    tiering.set_int4(scheduler.runner.int4)
    return tiering
