"""Scheduler: continuous batching with chunked prefill, prefix caching and retraction.

The same class runs inside the server's scheduler process (via `event_loop`) and inside the
offline Engine (which calls `handle` and `step` directly). This module holds the state, the
messages and the PD role's entry points; the step loop lives in `step_loop.py` (overlap in
`overlap.py`), admission and batch formation in `batch_formation.py`, and what an applied or
failed batch does in `outcomes.py` (mixins: one class, one state). Policy decisions live in
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
from typing import Callable

from sgl_kvxfer.config import SchedulerConfig
from sgl_kvxfer.disagg.role import PDRole, RoleContext
from sgl_kvxfer.message import (HEALTH_CHECK_RID_PREFIX, AbortReq, FlushCacheReq, FlushCacheResult,
                                GetInternalStateReq, InternalState, ProfileReq, ProfileResult, ReqOutput,
                                SetKVLinkReq, SetKVLinkResult, TokenizedGenerateReq)
from sgl_kvxfer.scheduler.batch_formation import (INIT_NEW_TOKEN_RATIO, MIN_NEW_TOKEN_RATIO,  # noqa: F401
                                                  NEW_TOKEN_RATIO_DECAY, BatchFormationMixin)
from sgl_kvxfer.scheduler.kv_lifecycle import KVLifecycle
from sgl_kvxfer.scheduler.outcomes import MAX_FAILED_STEPS, OutcomesMixin  # noqa: F401
from sgl_kvxfer.scheduler.overlap import InflightBatch
from sgl_kvxfer.scheduler.profiler import SchedulerProfiler
from sgl_kvxfer.scheduler.req import Req
from sgl_kvxfer.scheduler.results import FinishChecker, make_output
from sgl_kvxfer.scheduler.step_loop import StepLoopMixin
from sgl_kvxfer.scheduler.tiering import create_engine_tiering
from sgl_kvxfer.tokenizer.validation import check_tokenized

logger = logging.getLogger(__name__)


class Scheduler(StepLoopMixin, BatchFormationMixin, OutcomesMixin):
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
        # the server's sender of outputs that must not wait for the step's end (None: the outbox
        # only; the offline Engine): a tiered prompt's first token goes out before its re-tier
        self.send_early: Callable[[list[ReqOutput]], None] | None = None
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
        self.profiler = SchedulerProfiler()  # /start_profile's capture
        self.forwards = 0  # forwards launched (step_loop.py): the profiler counts steps that ran one
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
        if isinstance(msg, ProfileReq):
            return ProfileResult(*(self.profiler.start(msg) if msg.start else self.profiler.stop()))
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
        forwards = self.forwards
        try:
            ran = self._step()
        except Exception as e:  # noqa: BLE001 (the batch's requests fail; the scheduler goes on)
            self._recover(e)
            ran = True
        else:
            self._current = None
            self._failed_steps = 0
        self.profiler.after_step(self.forwards > forwards)
        return ran

    def take_outputs(self) -> list[ReqOutput]:
        out, self.outbox = self.outbox, []
        return out

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
