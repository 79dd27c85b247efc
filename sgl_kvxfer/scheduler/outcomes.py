"""Output handling and failure isolation (a mixin of `Scheduler`): what an applied batch
does to the queues, and what a batch that raised does.

`_after_batch` runs the role's and tiering's after-forward hooks (under tiering, a prompt's
streamed first token is sent before its re-tier, through `send_early`), then moves each request on:
finished requests retire (their KV cached, an output sent), ended prompts join `running` and
stream outputs go to the outbox. `_recover` ends a failed batch's requests with a 500.

Invariants and hazards:
- a request's cold-tier row is given back before its KV is cached or freed (`_retire`);
- `_recover` writes a failed batch's allocated slots into the rows and extends kv_len first, so
  `release` frees exactly what each request holds; after MAX_FAILED_STEPS steps in a row that
  fail outside any batch, every request ends, so a persistent fault cannot spin forever.
"""
from __future__ import annotations

import logging
import time

from sgl_kvxfer.forward_batch import ForwardMode
from sgl_kvxfer.scheduler.batch import ScheduleBatch
from sgl_kvxfer.scheduler.req import Req
from sgl_kvxfer.scheduler.results import make_output

logger = logging.getLogger(__name__)

MAX_FAILED_STEPS = 3  # _recover: then every request ends, so a persistent fault cannot spin forever


class OutcomesMixin:
    """`Scheduler._after_batch`, `_retire`, `_recover` and `_drop`; state lives on `Scheduler`."""

    def _after_batch(self, batch: ScheduleBatch) -> None:
        self.role.after_forward(batch)
        interval = self.config.stream_interval
        extend = batch.mode == ForwardMode.EXTEND
        if self.tiering is not None:  # re-tier finished prefills, demote old decode tokens
            if extend and self.send_early is not None:
                self._send_first_tokens(batch, interval)
            self.tiering.after_forward(batch, self.chunked)
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

    def _send_first_tokens(self, batch: ScheduleBatch, interval: int) -> None:
        """The streamed first tokens of prompts this batch ended go out now, ahead of the
        prompt's re-tier (scoring, tier assignment, the KV moves): the client's first token does
        not wait for host bookkeeping its value does not depend on; the re-tier delays the next
        decode step instead. Left to the outbox: a request that ended (its final output follows
        its KV into the cache) and a request whose KV a PD prefill sends (its tokens reach the client
        from the decode; a prefill server's own request, with no peer, is streamed here)."""
        outs = []
        for s in batch.slices:
            req = s.req
            if s.sample and req.stream and req.finished_reason is None \
                    and not (self._role_prefill and self.role.transfers(req)) \
                    and len(req.output_ids) - req.sent_output_len >= (req.sampling.stream_interval or interval):
                outs.append(make_output(req))  # (advances sent_output_len: the loop below sends no copy)
        if outs:
            self.send_early(outs)

    def _retire(self, req: Req) -> None:
        if req in self.running:
            self.running.remove(req)
        if req.req_pool_idx is not None:  # (a PD request may end before it held KV here)
            if self.tiering is not None:
                self.tiering.release_request(req)  # the cold tier gives the row back first
            self.kv.cache(req, finished=True)
        self.outbox.append(make_output(req))

    def _count_generated(self, n: int) -> None:
        self.stats["generated"] += n
        start, count = self._tput_window
        now = time.monotonic()
        if now - start >= 1.0:
            self.stats["gen_throughput"] = (self.stats["generated"] - count) / (now - start)
            self._tput_window = (now, self.stats["generated"])

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
