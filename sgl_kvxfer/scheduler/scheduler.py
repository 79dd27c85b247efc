"""Scheduler: continuous batching with chunked prefill, prefix caching and retraction.

The same class runs inside the server's scheduler process (via `event_loop`) and inside the
offline Engine (which calls `handle` and `step` directly). Policy decisions live in
`policy.py`; KV ownership in `kv_lifecycle.py`; logits handling in `results.py`. A PD role
(`disagg/role.py`: the hooks it calls, in one place) is given to the constructor; without one,
`PDRole`'s hooks do nothing.
"""
from __future__ import annotations

import itertools
import logging
import time

from sgl_kvxfer.config import SchedulerConfig
from sgl_kvxfer.disagg.role import PDRole, RoleContext
from sgl_kvxfer.engine.forward_batch import ForwardMode
from sgl_kvxfer.message import (AbortReq, FlushCacheReq, FlushCacheResult, GetInternalStateReq, InternalState,
                                ReqOutput, SetKVLinkReq, SetKVLinkResult, TokenizedGenerateReq)
from sgl_kvxfer.scheduler.batch import ReqSlice, ScheduleBatch, prepare_batch, prepare_decode
from sgl_kvxfer.scheduler.kv_lifecycle import KVLifecycle
from sgl_kvxfer.scheduler.overlap import (InflightBatch, continues_overlapped, overlap_ok, prefill_overlap_ok,
                                          void_slot_owned)
from sgl_kvxfer.scheduler.policy import PrefillAdder, decode_reserve, pick_retraction
from sgl_kvxfer.scheduler.req import Req
from sgl_kvxfer.scheduler.results import FinishChecker, make_output, process_logits
from sgl_kvxfer.scheduler.tiering import create_engine_tiering
from sgl_kvxfer.utils.host_copy import int64_to_device

logger = logging.getLogger(__name__)

INIT_NEW_TOKEN_RATIO, MIN_NEW_TOKEN_RATIO, NEW_TOKEN_RATIO_DECAY = 0.7, 0.15, 0.002


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
        self.overlap = False  # NOTE: set before tiering: its int4 probe already runs steps
        self.role = PDRole()  # NOTE: the probe's steps run without the PD role
        self._role_prefill = False
        self._joined = False  # requests joined `running` from outside a batch (PD decode)
        self.inflight: InflightBatch | None = None  # decode step launched, not applied
        self.pending_prefill: InflightBatch | None = None  # prefill launched, not applied
        self.tiering = create_engine_tiering(self, tokenizer)  # SpectrumKV; None at kv_tier_budget 1
        # Overlapped decode (scheduler/overlap.py): CUDA only (a CPU forward is synchronous).
        self.overlap = (not config.disable_overlap_schedule and self.tiering is None
                        and str(runner.device).startswith("cuda"))
        if role is not None:
            role.start(RoleContext(runner, self.kv, self.tiering, retire=self._retire, requeue=self.enqueue_validated,
                                   admit=self.admit_prefilled, has_seat=self.has_running_seat))
            self.role, self._role_prefill = role, role.intercepts_prefill

    # ------------------------------------------------------------------ messages
    def handle(self, msg):
        """Apply one incoming message; returns a reply message for request/response types."""
        if isinstance(msg, TokenizedGenerateReq):
            req = self.new_req(msg)
            error = self.validate(req)
            if error:
                req.finish({"type": "abort", "message": error, "status_code": 400, "err_type": "BadRequestError"})
                self.outbox.append(make_output(req))
            elif not self.role.on_new_request(req):
                self.enqueue_validated(req)
            return None
        if isinstance(msg, AbortReq):
            self.abort(msg.rid, msg.abort_all)
            return None
        if isinstance(msg, FlushCacheReq):
            return self.flush_cache()
        if isinstance(msg, GetInternalStateReq):
            return self.internal_state()
        if isinstance(msg, SetKVLinkReq):
            return SetKVLinkResult(*self.role.set_link(msg.rate_gbps, msg.latency_ms, msg.stream))
        raise TypeError(f"scheduler got an unexpected message {type(msg).__name__}")

    def new_req(self, msg: TokenizedGenerateReq) -> Req:
        return Req(msg, next(self._arrivals))

    def enqueue_validated(self, req: Req) -> None:
        """Queue a request that `validate` passed (the offline Engine validates a whole call
        before queueing any of it)."""
        self.waiting.append(req)

    def validate(self, req: Req) -> str | None:
        """A clear message naming what is wrong with the request, or None."""
        n, ctx = len(req.origin_input_ids), self.runner.context_len
        if n == 0:
            return "The input is empty: provide a non-empty text or input_ids."
        if n >= ctx:
            return f"The input ({n} tokens) is longer than the model's context length ({ctx} tokens)."
        total = n + req.sampling.max_new_tokens
        if total > ctx:
            return (f"Requested token count exceeds the model's maximum context length of {ctx} tokens. "
                    f"You requested a total of {total} tokens: {n} tokens from the input messages and "
                    f"{req.sampling.max_new_tokens} tokens for the completion.")
        if total > self.runner.max_total_tokens:
            return f"The request needs {total} KV slots but the KV pool holds only {self.runner.max_total_tokens}."
        if req.logprob_start_len > n:
            return f"logprob_start_len ({req.logprob_start_len}) is larger than the prompt ({n} tokens)."
        vocab = self.runner.arch.vocab_size
        if min(req.origin_input_ids) < 0 or max(req.origin_input_ids) >= vocab:  # C loops: prompts are long
            return f"input_ids contain a token id outside the vocabulary [0, {vocab})."
        return None

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
        self.role.poll()
        if self.inflight is not None:
            return self._step_overlapped()
        batch = self._prefill_batch()
        if batch is None:
            self._apply_prefill()  # decode needs the prefilled requests running, with their first token
            batch = self._decode_batch()
        if batch is None:
            return False
        loc = self._out_cache_loc
        fb = prepare_batch(batch, loc, self.runner.req_to_token.table, self.runner.device)
        if self.tiering is not None:
            self.tiering.before_forward(batch, fb)
        if batch.mode == ForwardMode.EXTEND:
            self.role.before_forward(batch, fb)
        logits = self.runner.forward(fb)
        if self.overlap and batch.mode == ForwardMode.DECODE and all(overlap_ok(s.req, 0) for s in batch.slices):
            self.inflight = InflightBatch.launch(batch, logits, loc)  # applied next step
            return True
        if self.overlap and batch.mode == ForwardMode.EXTEND and prefill_overlap_ok(batch):
            launched = InflightBatch.launch(batch, logits, loc)
            for s in batch.slices:  # the next prefill continues a chunked prompt from here
                s.req.kv_len = s.start + s.length
            self._apply_prefill()  # the previous prefill, while the GPU runs this one
            self.pending_prefill = launched
            return True
        self._apply_prefill()  # results apply in launch order
        process_logits(batch, logits, self.checker)
        self._after_batch(batch)
        return True

    def _step_overlapped(self) -> bool:
        """Launch the next decode step on the in-flight step's device-resident tokens, then
        apply the in-flight step while the GPU runs the next one (scheduler/overlap.py)."""
        prev, self.inflight = self.inflight, None
        nxt = None
        if not self.waiting and self.chunked is None and not self._joined:  # new requests: regroup first
            nxt = self._launch_followup(prev)
        self._apply_inflight(prev)
        if nxt is not None and not self.running:  # prev finished everyone: nxt is all void
            self._apply_inflight(nxt)
            nxt = None
        self.inflight = nxt  # invariant: an in-flight step has a running request
        return True

    def _apply_prefill(self) -> None:
        """Apply the pending prefill (prefill_overlap_ok): its kv_lens were set at launch; now
        its first tokens, finish checks and the bookkeeping of _after_batch."""
        if self.pending_prefill is None:
            return
        inf, self.pending_prefill = self.pending_prefill, None
        tokens = iter(inf.token_list())
        for s in inf.batch.slices:
            if s.sample:
                s.req.output_ids.append(next(tokens))
                self.checker.check(s.req)
        self._after_batch(inf.batch)

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
        fb = prepare_decode(batch, loc, self.runner.req_to_token.table, self.runner.device, input_ids=ids)
        logits = self.runner.forward(fb)
        return InflightBatch.launch(batch, logits, loc)

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
        adm = adder.try_add(remaining, decode_reserve(req.remaining_new_tokens, self.new_token_ratio))
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
        if loc is None:
            raise RuntimeError("KV pool exhausted with a single running request; the pool is too small")
        self._out_cache_loc = loc
        self._joined = False
        return ScheduleBatch(ForwardMode.DECODE, [ReqSlice(r, r.kv_len, 1, True) for r in self.running])

    def _retract(self, req: Req) -> None:
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
            self.kv.cache(req, finished=True)
        self.outbox.append(make_output(req))

    # ------------------------------------------------------------------ PD roles (disagg/role.py)
    def poll_role(self) -> None:
        """The PD role's transfers and admissions without a forward: the server's loop sends
        what they produced (a PD request's first token) before the next step runs."""
        self.role.poll()

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
