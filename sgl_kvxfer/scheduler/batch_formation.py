"""Admission and batch formation (a mixin of `Scheduler`): which requests run next.

Prefill: the chunked request first, then the queue (longest prefix match first under "lpm"),
each slice admitted against free KV less the decode reserve of running and pending requests
(policy.py), room made as slices come and all slots allocated at once. Decode: every running
request one token; out of KV, the request that made the least progress is retracted and later
recomputed.

Invariants and hazards:
- a request leaves `waiting` / `chunked` before its slots exist: `_current` is set first so a
  raise ends it (`_recover`, outcomes.py);
- a retracted request gives its cold-tier row back before its KV is released.
"""
from __future__ import annotations

import logging

from sgl_kvxfer.forward_batch import ForwardMode
from sgl_kvxfer.scheduler.batch import ReqSlice, ScheduleBatch
from sgl_kvxfer.scheduler.policy import PrefillAdder, decode_reserve, pick_retraction
from sgl_kvxfer.scheduler.req import Req

logger = logging.getLogger(__name__)

INIT_NEW_TOKEN_RATIO, MIN_NEW_TOKEN_RATIO, NEW_TOKEN_RATIO_DECAY = 0.7, 0.15, 0.002


class BatchFormationMixin:
    """`Scheduler._prefill_batch` / `_decode_batch` and their helpers; state lives on `Scheduler`."""

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
        """Tokens of req's next chunk when its PD prefill role cuts it shorter than the chunk size:
        to a streaming chunk while the KV link is slow (role.stream_chunk_tokens), and, when what
        remains is one chunk and at least twice `last` (role.last_chunk_tokens), `last` short
        of the end, so the last `last` tokens are a chunk of their own."""
        size = self.config.resolved_chunked_prefill_size
        if not self._role_prefill or size is None:
            return None
        cap = self.role.stream_chunk_tokens(req)
        chunk = min(size, cap) if cap else size
        last = self.role.last_chunk_tokens(req)
        if last and 2 * last <= remaining <= chunk:
            return remaining - last
        return chunk if chunk < size else None

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
