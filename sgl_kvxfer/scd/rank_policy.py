"""Bandwidth-adaptive rank choice: which nested level of the codes a producer sends.

The producer encodes at one level per request (artifacts with `rank_levels`; every consumer
decodes any level). The rule: the highest level whose codes for the prompt cross the link in at
most `wire_frac` of the producer's own prefill time for it,

    level = max{ i : bytes_per_token[i] * tokens * 8 / link_bps <= wire_frac * prefill_s }

(the lowest level when none fits; the top level when the link rate or the prefill time is
unknown). SCD pays off when the consumer's wait for codes is small next to the prefill it
skips; `wire_frac` bounds that wait, and a faster link buys a higher rank at the same bound.
"""
from __future__ import annotations

import math
from typing import Sequence


def choose_level(bytes_per_token: Sequence[int], tokens: int, link_gbps: float | None, prefill_s: float | None,
                 wire_frac: float) -> int:
    """Index into the levels (ascending bytes per token)."""
    if not bytes_per_token:
        raise ValueError("no levels")
    top = len(bytes_per_token) - 1
    if not link_gbps or not prefill_s or not math.isfinite(link_gbps) or not math.isfinite(prefill_s) or tokens <= 0:
        return top
    budget = wire_frac * prefill_s
    best = 0
    for i, b in enumerate(bytes_per_token):
        if b * tokens * 8 / (link_gbps * 1e9) <= budget:
            best = i
    return best


def wire_seconds(bytes_per_token: int, tokens: int, link_gbps: float) -> float:
    return bytes_per_token * tokens * 8 / (link_gbps * 1e9)
