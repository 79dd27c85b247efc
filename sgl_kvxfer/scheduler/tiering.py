"""SpectrumKV in the engine: importance capture, re-tiering when a prefill ends, decode demotion.

EngineTiering is the entry point and holds the hooks' glue; the rules live beside it (mixins:
one class, one state): the prefill re-tier path and PD chunk streams in `tier_prefill.py`, decode
demotion in `tier_decode.py`, KV-norm importance in `tier_norms.py`, the settings and their
format check in `tier_settings.py`. This module owns the hooks below, the row rewrite with its
TierRecord (`_record`) and the evictions that make room in a tier store (`_make_room`).

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
while the GPU computes it. A step whose apply demotes a running request's tokens drains
(apply_drains): nothing is launched after it until its after_forward is done, so that demotion's
host work and its two waits (its rows to the host, its KV-norm totals back) add to the step's time
in full, once every R steps per request. A step on which a cold-tier scoring pass falls due does
not drain: before the next launch its query taps are copied (before_next_launch, ColdTier.hold),
and its pass runs in after_forward on the cold tier's scoring stream, beside the next forward.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from weakref import WeakKeyDictionary

import torch

from sgl_kvxfer.forward_batch import ForwardMode
from sgl_kvxfer.scheduler.tier_decode import DecodeDemotionMixin
from sgl_kvxfer.scheduler.tier_norms import KVNormImportanceMixin
from sgl_kvxfer.scheduler.tier_prefill import PrefillRetierMixin
from sgl_kvxfer.scheduler.tier_settings import TierSettings, TierSettingsMixin
from sgl_kvxfer.spectrum.budget import KVLayout, assignment_bytes, fp16_bytes
from sgl_kvxfer.spectrum.importance import ImportanceAccumulator
from sgl_kvxfer.spectrum.tiers import NUM_TIERS
from sgl_kvxfer.utils.host_copy import to_device

logger = logging.getLogger(__name__)


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


def _counts(tiers: torch.Tensor) -> tuple[int, ...]:
    return tuple(torch.bincount(tiers.cpu().to(torch.int64), minlength=NUM_TIERS).tolist())


class EngineTiering(TierSettingsMixin, PrefillRetierMixin, DecodeDemotionMixin, KVNormImportanceMixin):
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

    # ------------------------------------------------------------------ hooks
    def before_forward(self, batch, fb) -> None:
        if batch.mode != ForwardMode.EXTEND:
            if self.cold is not None:  # (where during_forward is not called) copies done land before this step
                self.cold.before_forward()
            return
        if not self.config.kv_importance.startswith("attn"):
            return
        head_max = self.config.kv_importance == "attn-max"
        observed, rows, dev, window = {}, {}, fb.input_ids.device, self.config.kv_importance_window
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
                # the row on the host, and whether every id in it is fp16: with no cached prefix
                # the row holds only this prompt's own tokens, fp16 until its re-tier
                rows[i] = (s.req.req_pool_idx, s.req.prefix_len == 0)
        if observed:
            def observe(layer_id, i, q, keys):  # q: the chunk's queries, positions [start, start + len)
                if i in observed:
                    accs, start = observed[i]
                    for acc in accs:
                        acc.add_range(q, keys, start)  # host-known positions: no sync per layer
            observe.requests = frozenset(observed)  # backends that compute keys only for these
            observe.rows = rows  # (triton_tiered_backend routes their keys without a host sync)
            fb.extras["attn_observer"] = observe

    def during_forward(self, batch) -> None:
        """The decode forward is launched and the GPU runs it: the cold tier lands its finished
        copies now, without waiting for it (ColdTier.prepare; what must wait goes in after_forward)."""
        if self.cold is not None and batch.mode != ForwardMode.EXTEND:
            self.cold.prepare()

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

    def before_next_launch(self, batch) -> None:
        """Decode step `batch` is launched, not applied, and the next step launches now (overlapped,
        scheduler/overlap.py): a cold-tier scoring pass due on `batch` keeps the taps of its
        queries, which the next forward overwrites, and holds the landings until it has run
        (ColdTier.hold)."""
        if self.cold is not None:
            self.cold.hold(batch)

    def apply_drains(self, batch) -> bool:
        """Whether applying decode step `batch` (launched, its tokens not yet applied) must run
        with no later step in flight (scheduler/overlap.py): it demotes a running request's
        generated tokens. A request that this step finishes is left out: its final demotion and
        release run behind the next step, which holds only its void token and reads the row it
        was launched with. A cold-tier scoring pass due on `batch` does not drain: it reads the
        taps copied before the next launch (before_next_launch) and, on CUDA, runs on the cold
        tier's scoring stream beside the next forward."""
        if batch.mode == ForwardMode.EXTEND:
            return False
        for s in batch.slices:
            req = s.req
            if req.finished_reason is None and req.req_pool_idx is not None \
                    and self._decode_run(req, final=False, kv_len=s.start + s.length) is not None:
                return True
        return False

    def release_request(self, req) -> None:
        """The request's KV is about to be cached or freed: the cold tier gives its row back."""
        if self.cold is not None:
            self.cold.release_request(req)

    def mark_tiered(self, req, n: int) -> None:
        """Positions [0, n) of req are final (PD decode: the prompt came tiered from the
        prefill); decode demotion starts after them."""
        self._tiered_len[req] = n
        self._tails.pop(req, None)

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
