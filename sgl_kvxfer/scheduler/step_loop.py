"""The scheduler's step loop: plain, overlapped and draining steps (a mixin of `Scheduler`).

`_step` polls the PD role, forms a batch (batch_formation.py), launches its forward and applies
it (outcomes.py). On CUDA a decode step is applied one step late (`inflight`), and a prefill
batch may be applied after the next batch is launched (`pending_prefill`); overlap.py states
when each may overlap and why it is safe.

Invariants and hazards:
- results apply in launch order: a pending prefill is applied before a later batch is applied;
- an in-flight step has a running request; a step whose apply demotes KV under tiering drains
  (`_drains`, EngineTiering.apply_drains): nothing is launched after it until it is applied;
  a step applied with the next one in flight first lets tiering keep what its apply reads that
  the next forward overwrites (EngineTiering.before_next_launch: a cold-tier pass's query taps);
- `_current` holds (batch, out_cache_loc) between allocation and apply and `_unapplied` the
  steps taken off `inflight` / `pending_prefill`, so `_recover` (outcomes.py) can free their KV.
"""
from __future__ import annotations

from sgl_kvxfer.forward_batch import ForwardMode
from sgl_kvxfer.scheduler.batch import ReqSlice, ScheduleBatch, prepare_batch, prepare_decode
from sgl_kvxfer.scheduler.batch_formation import MIN_NEW_TOKEN_RATIO, NEW_TOKEN_RATIO_DECAY
from sgl_kvxfer.scheduler.overlap import (InflightBatch, continues_overlapped, overlap_ok, prefill_overlap_ok,
                                          void_slot_owned)
from sgl_kvxfer.scheduler.req import Req
from sgl_kvxfer.scheduler.results import process_logits
from sgl_kvxfer.utils.host_copy import int64_to_device, wait_releasing_gil


class StepLoopMixin:
    """`Scheduler._step` and the overlapped / draining paths; state lives on `Scheduler`."""

    def _step(self) -> bool:
        self.role.poll()
        # NOTE: what this poll produced (a PD decode's admitted first token, a PD prefill's
        # finished reply) goes out before the forward: return, the caller flushes the outbox and
        # steps again. Not twice in a row, so a stream of admissions cannot starve the forward.
        if self.outbox and not self._deferred:
            self._deferred = True
            return True
        self._deferred = False
        applied = False
        if self.inflight is not None:
            if not self._drains(self.inflight):
                return self._step_overlapped()
            self._drain()  # then the next batch launches below, in this same step
            applied = True
        batch = self._prefill_batch()
        if batch is None:
            applied = applied or self.pending_prefill is not None
            self._apply_prefill()  # decode needs the prefilled requests running, with their first token
            batch = self._decode_batch()
        if batch is None:
            # applying a prefill is work: its outputs and what the role does next with the request
            # (a PD prefill packs its KV) must not wait out the event loop's idle sleep
            return applied
        loc = self._out_cache_loc
        self._current = (batch, loc)  # slots allocated, not yet in the requests' kv_len: _recover
        fb = prepare_batch(batch, loc, self.runner.req_to_token.table, self.runner.device)
        if self.tiering is not None:
            self.tiering.before_forward(batch, fb)
        if batch.mode == ForwardMode.EXTEND:
            self.role.before_forward(batch, fb)
        logits = self.runner.forward(fb)
        self.forwards += 1
        if self.tiering is not None:
            self.tiering.after_launch(batch)  # chunk snapshots, copied behind this forward only
            self.tiering.during_forward(batch)  # host work while the GPU runs the step (the cold tier's landing plan)
        if batch.mode == ForwardMode.EXTEND:
            self.role.after_launch(batch)
        if self.overlap and batch.mode == ForwardMode.DECODE and all(overlap_ok(s.req, 0) for s in batch.slices):
            self.inflight = InflightBatch.launch(batch, logits, loc)  # applied next step
            return True
        if self._prefill_overlaps(batch):
            launched = InflightBatch.launch(batch, logits, loc)
            for s in batch.slices:  # the next prefill continues a chunked prompt from here
                s.req.kv_len = s.start + s.length
            self._apply_prefill()  # the previous prefill, while the GPU runs this one
            self.pending_prefill = launched
            return True
        self._apply_prefill()  # results apply in launch order
        wait_releasing_gil(self.runner.device)
        process_logits(batch, logits, self.checker)  # sets every slice's kv_len before anything else
        self._current = None
        self._after_batch(batch)
        return True

    def _prefill_overlaps(self, batch) -> bool:
        """Whether `batch` is applied after the next batch is launched (scheduler/overlap.py)."""
        if batch.mode != ForwardMode.EXTEND or not prefill_overlap_ok(batch):
            return False
        if self.tiering is None:
            return self.overlap
        return self.chunk_overlap and not any(s.sample for s in batch.slices)

    def _step_overlapped(self) -> bool:
        """Launch the next decode step on the in-flight step's device-resident tokens, then
        apply the in-flight step while the GPU runs the next one (scheduler/overlap.py)."""
        prev, self.inflight = self.inflight, None
        self._unapplied.append(prev)
        if self.tiering is not None:  # what prev's apply reads that the next forward overwrites
            self.tiering.before_next_launch(prev.batch)
        nxt = None
        if not self.waiting and self.chunked is None and not self._joined:  # new requests: regroup first
            nxt = self._launch_followup(prev)
            if nxt is not None:
                self._unapplied.append(nxt)
        self._apply_inflight(prev)
        if nxt is not None and not self.running:  # prev finished everyone: nxt is all void
            self._apply_inflight(nxt)
            nxt = None
        self._unapplied.clear()
        self.inflight = nxt  # invariant: an in-flight step has a running request
        return True

    def _drains(self, inf: InflightBatch) -> bool:
        """Whether the in-flight decode step is applied before the next one launches: under
        tiering, when applying it demotes a running request's KV."""
        return self.tiering is not None and self.tiering.apply_drains(inf.batch)

    def _drain(self) -> None:
        """Apply the in-flight decode step with nothing launched after it (serialized)."""
        prev, self.inflight = self.inflight, None
        self._unapplied.append(prev)
        self._apply_inflight(prev)
        self._unapplied.clear()

    def _apply_prefill(self) -> None:
        """Apply the pending prefill (prefill_overlap_ok): its kv_lens were set at launch; now
        its first tokens, finish checks and the bookkeeping of _after_batch."""
        if self.pending_prefill is None:
            return
        inf, self.pending_prefill = self.pending_prefill, None
        self._unapplied.append(inf)
        tokens = iter(inf.token_list())
        for s in inf.batch.slices:
            if s.sample:
                s.req.output_ids.append(next(tokens))
                self.checker.check(s.req)
        self._after_batch(inf.batch)
        self._unapplied.remove(inf)

    def _pending_reqs(self) -> list[Req]:
        """Requests of the pending prefill that join `running` when it is applied."""
        return [s.req for s in self.pending_prefill.batch.slices if s.sample] if self.pending_prefill else []

    def _launch_followup(self, prev: InflightBatch) -> InflightBatch | None:
        ctx, slices = self.runner.context_len, prev.batch.slices
        # not: requests already finished (prev holds their void token) or finished by prev for sure
        keep = [i for i, s in enumerate(slices) if continues_overlapped(s.req, ctx)]
        if not keep:
            return None
        reqs = [slices[i].req for i in keep]
        starts = [slices[i].start + 1 for i in keep]
        loc = self.kv.alloc(reqs, starts=starts)
        if loc is None:  # out of KV: apply first, then the plain path retracts
            return None
        self.new_token_ratio = max(self.new_token_ratio - NEW_TOKEN_RATIO_DECAY, MIN_NEW_TOKEN_RATIO)
        batch = ScheduleBatch(ForwardMode.DECODE, [ReqSlice(r, st, 1, True) for r, st in zip(reqs, starts)])
        ids = prev.tokens if len(keep) == len(slices) else prev.tokens[int64_to_device((keep,), prev.tokens.device)]
        self._current = (batch, loc)
        fb = prepare_decode(batch, loc, self.runner.req_to_token.table, self.runner.device, input_ids=ids)
        if self.tiering is not None:
            self.tiering.before_forward(batch, fb)
        logits = self.runner.forward(fb)
        self.forwards += 1
        if self.tiering is not None:
            # NOTE: the cold tier's landing is enqueued behind this forward, and prev's apply
            # (demotion of requests prev finishes, their rows given back) behind it too: the
            # forward reads the rows and slots it was launched with (stream order)
            self.tiering.during_forward(batch)
        launched = InflightBatch.launch(batch, logits, loc)
        self._current = None
        return launched

    def _apply_inflight(self, inf: InflightBatch) -> None:
        """process_logits for an overlapped step: its tokens are the argmax already taken."""
        tokens = inf.token_list()  # waits for this step only, not for one launched after it
        live, check = [], self.checker.check
        for i, (s, token) in enumerate(zip(inf.batch.slices, tokens)):
            req = s.req
            if req.finished_reason is not None:  # finished (or aborted) after this step was launched: a void token
                if void_slot_owned(s.start, self.kv.page_size):
                    self.kv.allocator.free(inf.out_cache_loc[i : i + 1])
                continue
            req.kv_len = s.start + 1
            req.output_ids.append(token)
            check(req)
            live.append(s)
        inf.batch.slices = live
        self._after_batch(inf.batch)
