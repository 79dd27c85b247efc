"""Bandwidth-adaptive rank choice: which nested level of the codes a producer sends.

The producer encodes at one level per request (artifacts with `rank_levels`; every consumer
decodes any level). The rule: the highest level whose codes for the prompt cross the link in at
most `wire_frac` of the producer's own prefill time for it,

    level = max{ i : bytes_per_token[i] * tokens * 8 / link_bps <= wire_frac * prefill_s }

(the lowest level when none fits; the top level when the link rate or the prefill time is
unknown), never below a floor level (`--scd-min-rank`) when one is set: the rule weighs time
only, and on a slow link it would otherwise send codes too coarse to answer from. The floor
`auto` is the lowest level whose calibrated agreement with the consumer's own prefill
(manifest.level_agreement) is within AGREEMENT_SLACK of the top level's (`quality_floor`). SCD pays off when the consumer's wait for codes is small next to the prefill it
skips; `wire_frac` bounds that wait, and a faster link buys a higher rank at the same bound.
"""
from __future__ import annotations

import math
from typing import Sequence


# `--scd-min-rank auto`: a level is good enough when its calibrated agreement is at most this far
# (a share of tokens: one point) below the top level's
AGREEMENT_SLACK = 0.01


def quality_floor(level_agreement: Sequence[float], slack: float = AGREEMENT_SLACK) -> int:
    """The lowest level index whose agreement is >= the top level's less `slack`."""
    if not level_agreement:
        raise ValueError("--scd-min-rank auto needs the artifacts' level_agreement, which these lack "
                         "(calibrated before it was measured): re-run python -m sgl_kvxfer.scd.calib, "
                         "or give the floor as R_K:R_V")
    top = level_agreement[-1]
    return next(i for i, a in enumerate(level_agreement) if a >= top - slack)


def choose_level(bytes_per_token: Sequence[int], tokens: int, link_gbps: float | None, prefill_s: float | None,
                 wire_frac: float, floor: int = 0) -> int:
    """Index into the levels (ascending bytes per token); never below `floor`."""
    if not bytes_per_token:
        raise ValueError("no levels")
    top = len(bytes_per_token) - 1
    if not 0 <= floor <= top:
        raise ValueError(f"floor {floor}: not one of the {top + 1} levels")
    if not link_gbps or not prefill_s or not math.isfinite(link_gbps) or not math.isfinite(prefill_s) or tokens <= 0:
        return top
    budget = wire_frac * prefill_s
    best = floor
    for i, b in enumerate(bytes_per_token):
        if i > floor and b * tokens * 8 / (link_gbps * 1e9) <= budget:
            best = i
    return best


def level_index(levels: Sequence[tuple[int, int]], rank: str, flag: str = "--scd-rank") -> int:
    """The index of "R_K:R_V" among the levels, or a ValueError naming the flag and the levels."""
    want = tuple(int(x) for x in rank.split(":"))
    if want not in levels:
        raise ValueError(f"{flag} {rank}: the artifacts hold levels {', '.join(f'{a}:{b}' for a, b in levels)}")
    return list(levels).index(want)


def wire_seconds(bytes_per_token: int, tokens: int, link_gbps: float) -> float:
    return bytes_per_token * tokens * 8 / (link_gbps * 1e9)


class LevelChooser:
    """A producer's per-request level: fixed (`rank` "top" or "R_K:R_V") or "auto" (choose_level
    with the link rate it is told, else the one it measured, and its measured prefill speed; never
    below `min_rank` "R_K:R_V" when given, or below quality_floor(level_agreement) with
    `min_rank` "auto"). Plain Python, no locks: the prefill role calls it from the scheduler
    thread only."""

    def __init__(self, levels: Sequence[tuple[int, int]], bytes_per_token: Sequence[int], rank: str, wire_frac: float,
                 min_rank: str | None = None, level_agreement: Sequence[float] = ()):
        self.levels, self.bytes_per_token, self.rank, self.wire_frac = tuple(levels), list(bytes_per_token), rank, wire_frac
        self.fixed: int | None = None
        if rank == "top":
            self.fixed = len(self.levels) - 1
        elif rank != "auto":
            self.fixed = level_index(self.levels, rank)
        if min_rank is not None and rank != "auto":
            raise ValueError(f"--scd-min-rank bounds --scd-rank auto, not --scd-rank {rank}")
        if min_rank is None:
            self.floor = 0
        elif min_rank == "auto":
            self.floor = quality_floor(level_agreement)
        else:
            self.floor = level_index(self.levels, min_rank, "--scd-min-rank")
        self.link_gbps: float | None = None  # measured write rate, moving average
        self.prefill_tps: float | None = None  # prompt tokens per second, moving average
        self.counts = [0] * len(self.levels)

    def choose(self, tokens: int, paced_gbps: float | None = None) -> int:
        """paced_gbps: the rate the link is paced at (told), None when unpaced."""
        if self.fixed is not None:
            i = self.fixed
        else:
            rate = paced_gbps if paced_gbps and math.isfinite(paced_gbps) else self.link_gbps
            prefill_s = tokens / self.prefill_tps if self.prefill_tps else None
            i = choose_level(self.bytes_per_token, tokens, rate, prefill_s, self.wire_frac, self.floor)
        self.counts[i] += 1
        return i

    def observe_write(self, nbytes: int, seconds: float) -> None:
        if seconds > 0 and nbytes >= (1 << 16):  # small writes time latency, not rate
            g = nbytes * 8 / seconds / 1e9
            self.link_gbps = g if self.link_gbps is None else 0.8 * self.link_gbps + 0.2 * g

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            tps = tokens / seconds
            self.prefill_tps = tps if self.prefill_tps is None else 0.7 * self.prefill_tps + 0.3 * tps

    def info(self) -> dict:
        return {"rank": self.rank, "levels": [list(x) for x in self.levels],
                "min_level": "{}:{}".format(*self.levels[self.floor]),
                "level_counts": {f"{a}:{b}": n for (a, b), n in zip(self.levels, self.counts)},
                "link_gbps_measured": self.link_gbps, "prefill_tokens_per_s": self.prefill_tps}
