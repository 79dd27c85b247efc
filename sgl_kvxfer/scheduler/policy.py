"""Scheduling policy as plain Python over integers: prefill admission and decode retraction.

Nothing here touches tensors; the scheduler feeds token counts and gets decisions back.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Admission:
    extend_len: int  # tokens of this request computed in this batch
    chunked: bool  # True when the request's prefill continues in a later batch


class PrefillAdder:
    """Greedy admission of waiting requests into one prefill batch.

    Budgets: `token_budget` new tokens per batch; `chunk_size` (None = no chunking) caps one
    request's tokens per batch; `free_tokens` KV slots (free + evictable) must cover every new
    token plus the decode reservation of admitted requests; `max_new_reqs` caps admissions.
    With `page_size` P > 1 each admission also charges P - 1 tokens: the worst-case unused room
    of its partial last page (allocation is in whole pages).
    """

    def __init__(self, token_budget: int, chunk_size: int | None, free_tokens: int, max_new_reqs: int,
                 page_size: int = 1):
        self.page_slack = page_size - 1
        self.token_budget = token_budget
        self.chunk_size = chunk_size
        self.free_tokens = free_tokens
        self.max_new_reqs = max_new_reqs
        self.num_added = 0
        self.chunked_added = False

    def try_add(self, extend_len: int, decode_reserve: int, limit: int | None = None) -> Admission | None:
        """`limit`: at most this many tokens of the request in this batch (a chunk cut short)."""
        if self.num_added >= self.max_new_reqs or self.chunked_added or self.token_budget <= 0:
            return None
        take = min(extend_len, self.token_budget)
        if self.chunk_size is not None:
            take = min(take, self.chunk_size)
        if limit is not None:
            take = min(take, max(1, limit))
        chunked = take < extend_len
        slack = self.page_slack
        need = take + slack + (0 if chunked else decode_reserve)
        if need > self.free_tokens:
            # Fall back to a chunk that fits in memory now, if chunking is allowed.
            take = min(take, self.free_tokens - slack) if self.chunk_size is not None else 0
            if take <= 0 or (take == extend_len and take + slack + decode_reserve > self.free_tokens):
                return None
            chunked = take < extend_len
        self.token_budget -= take
        self.free_tokens -= take + slack + (0 if chunked else decode_reserve)
        self.num_added += 1
        self.chunked_added = chunked
        return Admission(take, chunked)


def decode_reserve(remaining_new_tokens: int, ratio: float, cap: int = 4096) -> int:
    """KV slots to keep aside for a request's future decode steps."""
    return int(min(remaining_new_tokens, cap) * ratio)


def pick_retraction(arrivals: list[int]) -> int:
    """Index of the running request to retract when decode runs out of KV: the newest arrival,
    which has made the least progress and loses the least work when recomputed."""
    return max(range(len(arrivals)), key=lambda i: arrivals[i])
