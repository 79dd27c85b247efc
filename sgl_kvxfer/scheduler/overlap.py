"""Overlap scheduling of consecutive decode steps (GPU): the host work of step N (sampled ids
to the host, finish checks, outputs, the next batch's bookkeeping) runs while the GPU computes
step N + 1.

    host:  launch N | launch N+1 (ids = N's argmax, on device) | apply N | launch N+2 | apply N+1
    GPU:   [ fwd N ][ fwd N+1 ..................................][ fwd N+2 ...

A decode batch qualifies when every request samples greedily on the GPU alone: no logprobs,
no penalties or logit bias, no banned ids (min_new_tokens). Step N + 1 is launched before N's
finish checks, so it carries every request of N except those that N certainly finishes (length
and context limits are known ahead); a request that N finishes otherwise (EOS, stop id or
string, abort) computes one void token in N + 1, whose id is dropped and whose slot is freed
when N + 1 is applied.

NOTE: correctness rests on stream order. Step N + 1 reads N's sampled ids, table rows and KV
slots on the device after N wrote them; a slot or row freed on the host while N + 1 is in
flight is only reused by work enqueued after N + 1.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from sgl_kvxfer.scheduler.batch import ScheduleBatch
from sgl_kvxfer.scheduler.req import Req


@dataclass
class InflightDecode:
    """A launched decode batch whose results are not applied yet."""
    batch: ScheduleBatch
    tokens: torch.Tensor  # int64 [B] on the device: each row's greedy token
    out_cache_loc: torch.Tensor  # int64 [B]: the KV slot each row wrote


def overlap_ok(req: Req, checker, pending: int) -> bool:
    """`req` may decode overlapped with `pending` of its tokens not yet applied: its sampling
    needs nothing but a GPU argmax."""
    p = req.sampling
    if not p.is_greedy or req.return_logprob or p.has_logit_processors:
        return False
    banned = p.stop_token_ids or not p.ignore_eos
    return not banned or len(req.output_ids) + pending >= p.min_new_tokens


def continues_after(req: Req, context_len: int) -> bool:
    """False when applying one more token certainly finishes `req` (length or context limit)."""
    return (len(req.output_ids) + 1 < req.sampling.max_new_tokens
            and req.seq_len + 1 < context_len)


def void_slot_owned(start: int, page_size: int) -> bool:
    """Whether the slot of position `start` (a finished request's void decode token) still has
    to be freed: with pages, only a slot that opened a fresh page owns that page; one inside
    the request's partial last page was freed with that page when the request was cached."""
    return page_size == 1 or start % page_size == 0
