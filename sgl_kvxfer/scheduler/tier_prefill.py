"""SpectrumKV's prefill re-tier path (a mixin of `EngineTiering`, scheduler/tiering.py).

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

PD chunk streams (`rank_chunks`): each chunk of a prompt is also ranked by its own window
(`chunk_tiers`), so the prefill role can tier and send it before the prompt ends; the prompt's
final tiers still come from the whole prompt at its end (`_tier_prefill`).

Hazards: a chunk's scores and row ids are copied to the host behind an event recorded right after
its launch (`after_launch`, `_ChunkSnapshot`): `chunk_tiers` waits for that chunk alone, never
for a chunk launched after it. `final_tiers_hook` runs before the KV moves: work it enqueues on
the stream reads the model-dtype rows ahead of the move.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from sgl_kvxfer.forward_batch import ForwardMode
from sgl_kvxfer.spectrum.byte_budget import assign_tiers
from sgl_kvxfer.spectrum.importance import token_importance


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


class PrefillRetierMixin:
    """`EngineTiering`'s prefill rules; state (`_acc`, `_chunk_acc`, `_chunk_snap`, ...) lives there."""

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
