"""Scheduler: continuous batching with chunked prefill, prefix caching and retraction.

The same class runs inside the server's scheduler process (via `event_loop`) and inside the
offline Engine (which calls `handle` and `step` directly). Policy decisions live in
`policy.py`; KV ownership in `kv_lifecycle.py`; logits handling in `results.py`. A PD role
(`disagg/role.py`: the hooks it calls, in one place) is given to the constructor; without one,
`PDRole`'s hooks do nothing.

Failure isolation: a request that cannot be admitted ends alone with a 400 (or 500); a batch
whose forward or sampling raises ends its own requests with a 500 and frees their KV
(`_recover`); the loop, and every other request, carry on.
"""
from __future__ import annotations

import itertools
import logging
import time

from sgl_kvxfer.config import SchedulerConfig
from sgl_kvxfer.disagg.role import PDRole, RoleContext
from sgl_kvxfer.forward_batch import ForwardMode
from sgl_kvxfer.message import (HEALTH_CHECK_RID_PREFIX, AbortReq, FlushCacheReq, FlushCacheResult,
                                GetInternalStateReq, InternalState, ReqOutput, SetKVLinkReq, SetKVLinkResult,
                                TokenizedGenerateReq)
from sgl_kvxfer.scheduler.batch import ReqSlice, ScheduleBatch, prepare_batch, prepare_decode
from sgl_kvxfer.scheduler.kv_lifecycle import KVLifecycle
from sgl_kvxfer.scheduler.overlap import (InflightBatch, continues_overlapped, overlap_ok, prefill_overlap_ok,
                                          void_slot_owned)
from sgl_kvxfer.scheduler.policy import PrefillAdder, decode_reserve, pick_retraction
from sgl_kvxfer.scheduler.req import Req
from sgl_kvxfer.scheduler.results import FinishChecker, make_output, process_logits
from sgl_kvxfer.scheduler.tiering import create_engine_tiering
from sgl_kvxfer.tokenizer.validation import check_tokenized
from sgl_kvxfer.utils.host_copy import int64_to_device

logger = logging.getLogger(__name__)

INIT_NEW_TOKEN_RATIO, MIN_NEW_TOKEN_RATIO, NEW_TOKEN_RATIO_DECAY = 0.7, 0.15, 0.002
MAX_FAILED_STEPS = 3  # _recover: then every request ends, so a persistent fault cannot spin forever


class Scheduler:
    def __init__(self, config: SchedulerConfig, runner, tokenizer=None, role: PDRole | None = None):
        self.config = config
        self.runner = runner
        self.max_running = runner.max_running_requests
        self.kv = KVLifecycle(runner.allocator, runner.req_to_token, use_radix=not config.disable_radix_cache)
        eos = set(runner.arch.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        self.checker = FinishChecker(eos, tokenizer, runner.context_len)
        self.waiting: list[Req] = []
        self.running: list[Req] = []  # decoding
        self.chunked: Req | None = None  # mid-prefill, holds KV
        self.outbox: list[ReqOutput] = []
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self._arrivals = itertools.count()
        self.stats = {"prompt_tokens": 0, "cached_tokens": 0, "generated": 0, "gen_throughput": 0.0}
        self._tput_window = (time.monotonic(), 0)
        self.tiering = None
        self.overlap = False  # decided below, once tiering is known
        self.role = PDRole()  # replaced below once the pool and tiering exist
        self._role_prefill = False
        self._joined = False  # requests joined `running` from outside a batch (PD decode)
        self._deferred = False  # the last step returned before its forward to let the role's outputs out
        self.inflight: InflightBatch | None = None  # decode step launched, not applied
        self._current = None  # (batch, out_cache_loc) between allocation and apply: _recover
        self._unapplied: list[InflightBatch] = []  # taken off inflight / pending_prefill, being applied
        self._failed_steps = 0  # consecutive steps that raised outside any batch
        self.pending_prefill: InflightBatch | None = None  # prefill launched, not applied
        self.tiering = create_engine_tiering(self)  # SpectrumKV; None at kv_tier_budget 1
        # Overlapped decode (scheduler/overlap.py): CUDA only (a CPU forward is synchronous).
        # Under tiering too: a step whose apply moves KV drains first (EngineTiering.apply_drains).
        self.overlap = not config.disable_overlap_schedule and str(runner.device).startswith("cuda")
        # Under tiering, prefill batches of chunks only (no slice ends its prompt) overlap:
        # tiering's after_forward does nothing for them (a prompt is re-tiered once it ends), so
        # the host work of chunk N (a PD chunk stream's tiers and pack) runs while N + 1 computes.
        self.chunk_overlap = (not config.disable_overlap_schedule and self.tiering is not None
                              and str(runner.device).startswith("cuda"))
        if role is not None:
            role.start(RoleContext(runner, self.kv, self.tiering, retire=self._retire, requeue=self.enqueue_validated,
                                   admit=self.admit_prefilled, has_seat=self.has_running_seat))
            self.role, self._role_prefill = role, role.intercepts_prefill

    # ------------------------------------------------------------------ messages
    def handle(self, msg):
        """Apply one incoming message; returns a reply message for request/response types."""
        if isinstance(msg, TokenizedGenerateReq):
            self._add_request(msg)
            return None
        if isinstance(msg, AbortReq):
            self.abort(msg.rid, msg.abort_all)
            return None
        if isinstance(msg, FlushCacheReq):
            return self.flush_cache()
        if isinstance(msg, GetInternalStateReq):
            return self.internal_state()
        if isinstance(msg, SetKVLinkReq):
            return SetKVLinkResult(*self.role.set_link(msg.rate_gbps, msg.latency_ms, msg.stream, msg.trace,
                                                                msg.last_chunk))
        raise TypeError(f"scheduler got an unexpected message {type(msg).__name__}")

    def _add_request(self, msg: TokenizedGenerateReq) -> None:
        """Queue a new request, or end it alone with an error (it never reaches a batch)."""
        if msg.rid.startswith(HEALTH_CHECK_RID_PREFIX):  # the loop turns: that is the answer
            self.outbox.append(ReqOutput(rid=msg.rid, new_output_ids=[], prompt_tokens=len(msg.input_ids),
                                         finish_reason={"type": "length", "length": 0}, completion_tokens=0,
                                         cached_tokens=0))
            return
        req = None
        try:
            error = check_tokenized(msg, self.runner.arch.vocab_size, self.runner.context_len,
                                    self.runner.max_total_tokens)
            req = self.new_req(msg)
            if error:
                req.finish({"type": "abort", "message": error, "status_code": 400, "err_type": "BadRequestError"})
                self.outbox.append(make_output(req))
            elif not self.role.on_new_request(req):
                self.enqueue_validated(req)
        except Exception as e:  # noqa: BLE001 (what the checks let through must not stop the loop)
            logger.exception("request %s could not be admitted", msg.rid)
            reason = {"type": "abort", "message": f"Internal server error: {type(e).__name__}: {e}",
                      "status_code": 500, "err_type": "InternalServerError"}
            if req is not None and req.req_pool_idx is not None:
                self.kv.release(req)
            self.outbox.append(ReqOutput(rid=msg.rid, new_output_ids=[], finish_reason=reason,
                                         prompt_tokens=len(msg.input_ids), completion_tokens=0, cached_tokens=0))

    def new_req(self, msg: TokenizedGenerateReq) -> Req:
        return Req(msg, next(self._arrivals))

    def enqueue_validated(self, req: Req) -> None:
        """Queue a request that `validate` passed (the offline Engine validates a whole call
        before queueing any of it)."""
        self.waiting.append(req)

    def validate(self, msg: TokenizedGenerateReq) -> str | None:
        """A clear message naming what is wrong with the request, or None (the same checks and
        messages as the tokenizer manager's: tokenizer/validation.py)."""
        return check_tokenized(msg, self.runner.arch.vocab_size, self.runner.context_len, self.runner.max_total_tokens)

    def abort(self, rid: str, abort_all: bool = False) -> None:
        self._apply_prefill()  # its requests join `running`, where the loop below finds them
        self.role.abort(rid, abort_all)  # requests waiting on a KV transfer
        reason = {"type": "abort", "message": "Abort requested", "status_code": None, "err_type": None}
        for req in [r for r in self.waiting if abort_all or r.rid == rid]:
            self.waiting.remove(req)
            req.finish(reason)
            self.kv.release(req)
            self.outbox.append(make_output(req))
        if self.chunked is not None and (abort_all or self.chunked.rid == rid):
            req, self.chunked = self.chunked, None
            req.finish(reason)
            self.kv.release(req)
            self.outbox.append(make_output(req))
        for req in [r for r in self.running if abort_all or r.rid == rid]:
            req.finish(reason)
            self._retire(req)

    def flush_cache(self) -> FlushCacheResult:
        if self.has_work():
            return FlushCacheResult(False, "Cache not flushed: requests are running or queued.")
        self.kv.flush()
        return FlushCacheResult(True, "Cache flushed.")

    def internal_state(self) -> InternalState:
        tree = self.kv.tree
        cached = tree.evictable_size() + tree.protected_size() if tree else 0
        used = self.runner.max_total_tokens - self.kv.allocator.available_size()
        hit = self.stats["cached_tokens"] / max(self.stats["prompt_tokens"], 1)
        role_info = self.role.server_info()
        return InternalState(
            max_total_num_tokens=self.runner.max_total_tokens, max_req_input_len=self.runner.context_len - 1,
            num_running_reqs=len(self.running) + len(self._pending_reqs()) + (self.chunked is not None),
            num_queue_reqs=len(self.waiting),
            kv_used_tokens=used, kv_cached_tokens=cached, kv_bytes_per_token=self.runner.kv_pool.bytes_per_token(),
            last_gen_throughput=self.stats["gen_throughput"], cache_hit_rate=hit,
            extra={**(self.tiering.server_info() if self.tiering is not None else {}), **self.runner.server_info_extra(),
                   **({"kv_transfer": role_info} if role_info is not None else {})})

    # ------------------------------------------------------------------ one iteration
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked or self.inflight or self.pending_prefill
                    or self.role.has_work())

    def step(self) -> bool:
        """Schedule, run and apply one batch. Returns False when there was nothing to run."""
        try:
            ran = self._step()
        except Exception as e:  # noqa: BLE001 (the batch's requests fail; the scheduler goes on)
            self._recover(e)
            return True
        self._current = None
        self._failed_steps = 0
        return ran

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

    def _recover(self, exc: Exception) -> None:
        """A batch raised (forward, sampling, a PD hook): end its requests, and those of any
        launched-but-unapplied step, with a 500; free their KV; keep everything else running.

        KV accounting: a request's row holds slots for [0, kv_len) once its slice is applied; the
        batch being run had slots allocated for [start, start + length) that kv_len does not yet
        cover. They are written into the row (prepare_batch may have failed before doing it) and
        kv_len extended, so `release` frees exactly what the request holds."""
        logger.exception("a batch failed; its requests end with an error")
        reason = {"type": "abort", "message": f"Internal server error: {type(exc).__name__}: {exc}",
                  "status_code": 500, "err_type": "InternalServerError"}
        victims: list[Req] = []
        current, self._current = self._current, None
        if current is not None:
            batch, loc = current
            offset = 0
            for s in batch.slices:
                req = s.req
                if loc is not None and req.req_pool_idx is not None and req.kv_len < s.start + s.length:
                    self.runner.req_to_token.write(req.req_pool_idx, s.start, loc[offset:offset + s.length])
                    req.kv_len = s.start + s.length
                offset += s.length
                victims.append(req)
        for inf in (self.inflight, self.pending_prefill, *self._unapplied):
            if inf is not None:  # overlap (CUDA): launched, its rows written at launch
                for s in inf.batch.slices:
                    if s.req.req_pool_idx is not None and s.req.kv_len < s.start + s.length:
                        s.req.kv_len = s.start + s.length
                    victims.append(s.req)
        self.inflight = self.pending_prefill = None
        self._unapplied.clear()
        victims = [r for r in dict.fromkeys(victims) if r.finished_reason is None or r.req_pool_idx is not None]
        self._failed_steps = 0 if victims else self._failed_steps + 1
        if self._failed_steps >= MAX_FAILED_STEPS:  # failing outside any batch, again and again
            logger.error("%d steps in a row failed outside a batch; ending every request", self._failed_steps)
            victims = [*self.running, *([self.chunked] if self.chunked else []), *self.waiting]
            self.role.abort("", True)
            self._failed_steps = 0
        for req in victims:  # not already retired
            self._drop(req, reason)

    def _drop(self, req: Req, reason: dict) -> None:
        """End a request now with `reason` (kept if it already finished) and free its KV
        without caching it (it may be incomplete)."""
        req.finish(reason)
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        if self.chunked is req:
            self.chunked = None
        self.kv.release(req)
        self.outbox.append(make_output(req))

    def _step_overlapped(self) -> bool:
        """Launch the next decode step on the in-flight step's device-resident tokens, then
        apply the in-flight step while the GPU runs the next one (scheduler/overlap.py)."""
        prev, self.inflight = self.inflight, None
        self._unapplied.append(prev)
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
        tiering, when applying it demotes KV or runs a cold-tier scoring pass."""
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

    def take_outputs(self) -> list[ReqOutput]:
        out, self.outbox = self.outbox, []
        return out

    # ------------------------------------------------------------------ batch formation
    def _reserve(self, reqs) -> int:
        return sum(decode_reserve(r.remaining_new_tokens, self.new_token_ratio) for r in reqs)

    def _prefill_batch(self) -> ScheduleBatch | None:
        if not self.waiting and self.chunked is None:
            return None
        cfg = self.config
        pending = self._pending_reqs()  # already admitted: they count as running here
        free = self.kv.available_tokens() - self._reserve(self.running) - self._reserve(pending)
        adder = PrefillAdder(cfg.max_prefill_tokens, cfg.resolved_chunked_prefill_size, free,
                             self.max_running - len(self.running) - len(pending), page_size=self.kv.page_size)
        # Slices are admitted against free KV one by one (room is made as they come) and
        # allocated together at the end: one allocation per batch, not per request.
        batch, room = ScheduleBatch(ForwardMode.EXTEND), [0]
        self._current = (batch, None)  # its requests leave the queues before their slots exist
        if self.chunked is not None:
            req, self.chunked = self.chunked, None
            if not self._add_slice(batch, room, adder, req, admitted=True):
                self.chunked = req  # not even one token fits: decode frees memory first
                return None
        if cfg.schedule_policy == "lpm" and len(self.waiting) < 128:
            self.waiting.sort(key=lambda r: -self.kv.match(r))
        while self.waiting and not adder.chunked_added:
            req = self.waiting[0]
            if not self.kv.admit(req):
                break
            if not self._add_slice(batch, room, adder, req, admitted=False):
                self.kv.release(req)
                break
            self.waiting.pop(0)
        if not batch.slices:
            return None
        loc = self.kv.alloc([s.req for s in batch.slices], [s.length for s in batch.slices],
                            [s.start for s in batch.slices])
        assert loc is not None, "room was made for every slice"
        self._out_cache_loc = loc
        return batch

    def _add_slice(self, batch, room: list[int], adder, req: Req, admitted: bool) -> bool:
        """Add req's next slice if it fits; room[0]: slots the batch's slices so far will take."""
        remaining = req.seq_len - req.kv_len
        adm = adder.try_add(remaining, decode_reserve(req.remaining_new_tokens, self.new_token_ratio),
                            self._chunk_limit(req, remaining))
        if adm is None:
            return False
        need = self.kv.slots_needed([req.kv_len], [adm.extend_len])
        if not self.kv.make_room(room[0] + need):
            return False
        room[0] += need
        if not admitted and req.num_retractions == 0:
            self.stats["prompt_tokens"] += len(req.origin_input_ids)
            self.stats["cached_tokens"] += req.prefix_len
        sample = not adm.chunked and req.sampling.max_new_tokens > 0
        batch.slices.append(ReqSlice(req, req.kv_len, adm.extend_len, sample))
        if adm.chunked:
            self.chunked = req
        return True

    def _chunk_limit(self, req: Req, remaining: int) -> int | None:
        """Tokens of req's next chunk when its role wants the last `last` tokens on their own:
        what remains is one chunk and at least twice `last`, so this chunk stops `last` short."""
        chunk = self.config.resolved_chunked_prefill_size
        if not self._role_prefill or chunk is None:
            return None
        last = self.role.last_chunk_tokens(req)
        return remaining - last if last and 2 * last <= remaining <= chunk else None

    def _decode_batch(self) -> ScheduleBatch | None:
        if not self.running:
            return None
        self.new_token_ratio = max(self.new_token_ratio - NEW_TOKEN_RATIO_DECAY, MIN_NEW_TOKEN_RATIO)
        loc = self.kv.alloc(self.running)
        while loc is None and len(self.running) > 1:
            # Out of KV: retract and later recompute the request that made the least progress.
            self._retract(self.running.pop(pick_retraction([r.arrival for r in self.running])))
            self.new_token_ratio = INIT_NEW_TOKEN_RATIO
            loc = self.kv.alloc(self.running)
        if loc is None:  # one request that alone outgrew the pool: it ends, the server goes on
            self._drop(self.running[0], {"type": "abort", "status_code": 500, "err_type": "InternalServerError",
                                         "message": "The KV pool ran out of room for this request."})
            return None
        self._out_cache_loc = loc
        self._joined = False
        return ScheduleBatch(ForwardMode.DECODE, [ReqSlice(r, r.kv_len, 1, True) for r in self.running])

    def _retract(self, req: Req) -> None:
        if self.tiering is not None:
            self.tiering.release_request(req)  # the cold tier gives the row back first
        self.kv.release(req)
        req.num_retractions += 1
        self.waiting.insert(0, req)
        logger.info("retracted %s to free KV (retraction #%d)", req.rid, req.num_retractions)

    # ------------------------------------------------------------------ bookkeeping
    def _after_batch(self, batch: ScheduleBatch) -> None:
        self.role.after_forward(batch)
        if self.tiering is not None:  # re-tier finished prefills, demote old decode tokens
            self.tiering.after_forward(batch, self.chunked)
        interval = self.config.stream_interval
        extend = batch.mode == ForwardMode.EXTEND
        if not extend:
            self._count_generated(len(batch.slices))
        for s in batch.slices:  # hot: every request of every decode step
            req = s.req
            if extend and self._role_prefill:  # PD prefill: the KV leaves, the request waits
                if s.sample:
                    self.kv.cache(req, finished=False)
                    if self.role.on_prompt_done(req):
                        continue
                elif req.finished_reason is None:
                    self.role.on_chunk(req, s.start, s.start + s.length)
            if req.finished_reason is not None:
                if req in self.running:
                    self.running.remove(req)
                if self.chunked is req:
                    self.chunked = None
                self._retire(req)
                continue
            if extend and s.sample:  # its prompt is done (a chunk slice does not sample)
                self.kv.cache(req, finished=False)  # share the prompt with later requests now
                self.running.append(req)
            if req.stream and len(req.output_ids) - req.sent_output_len >= (req.sampling.stream_interval or interval):
                self.outbox.append(make_output(req))

    def _retire(self, req: Req) -> None:
        if req in self.running:
            self.running.remove(req)
        if req.req_pool_idx is not None:  # (a PD request may end before it held KV here)
            if self.tiering is not None:
                self.tiering.release_request(req)  # the cold tier gives the row back first
            self.kv.cache(req, finished=True)
        self.outbox.append(make_output(req))

    # ------------------------------------------------------------------ PD roles (disagg/role.py)
    def poll_role(self) -> None:
        """The PD role's transfers and admissions without a forward: the server's loop sends
        what they produced (a PD request's first token) before the next step runs. A poll
        that raises is contained as a failed step is (`_recover`)."""
        try:
            self.role.poll()
        except Exception as e:  # noqa: BLE001
            self._recover(e)

    def has_running_seat(self) -> bool:
        return len(self.running) + len(self._pending_reqs()) < self.max_running

    def admit_prefilled(self, req: Req) -> None:
        """A request whose prompt KV and first token came from a prefill server joins the
        running batch, its prefill skipped (PD decode). With no first token (SCD: KV for all
        but the last prompt position), its first decode step computes that position and
        samples the first token (kv_len == len(fill_ids) - 1 holds either way)."""
        if req.output_ids:
            self.checker.check(req)  # the first token may end it (EOS, max_new_tokens 1, ...)
        self.kv.cache(req, finished=False)
        if self.tiering is not None:
            self.tiering.mark_tiered(req, req.kv_len)  # the prompt came tiered (or at fp16)
        if req.finished_reason is not None:
            self._retire(req)
            return
        self.running.append(req)
        self._joined = True
        if req.stream and req.output_ids:  # the first token, now (time to first token)
            self.outbox.append(make_output(req))

    def _count_generated(self, n: int) -> None:
        self.stats["generated"] += n
        start, count = self._tput_window
        now = time.monotonic()
        if now - start >= 1.0:
            self.stats["gen_throughput"] = (self.stats["generated"] - count) / (now - start)
            self._tput_window = (now, self.stats["generated"])
