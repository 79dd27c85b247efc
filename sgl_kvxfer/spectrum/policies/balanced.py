"""Balanced ablation (paper Table 11): tier mix as even as the budget allows, no ranking.

Fractions: the point closest (L2) to (1/3, 1/3, 1/3) on {f16 + f8 + f4 = 1, c . f = b},
    f_t = 1/3 + alpha * (c_t - mean(c)),  alpha = (b - mean(c)) / (sum c^2 - 3 mean(c)^2)
with a tier that would go negative removed (then it is Eq. 14 or 15). At b = 0.5 this gives
(0.214, 0.357, 0.429): the "substantial int4 mass" that breaks int4-intolerant models.
Placement ignores importance: each tier is spread evenly over positions (tier t's k-th token
sits near fraction (k + 1/2) / count_t of the non-sink span). The paper gives neither formula.
"""
from __future__ import annotations

import math

import torch

from sgl_kvxfer.spectrum.budget import TierCounts, budget_quarters, effective_sinks, fill_counts
from sgl_kvxfer.spectrum.policies.base import TierPolicy, check_inputs
from sgl_kvxfer.spectrum.tiers import TIER_DROP, TIER_FP16, TIER_INT4, TIER_INT8

_C = (1.0, 0.5, 0.25)


def balanced_fractions(budget: float) -> tuple[float, float, float]:
    """(f16, f8, f4) of the 3-tier balanced mix for 0.25 <= b <= 1 (clamped outside)."""
    b = min(max(budget, 0.25), 1.0)
    mean = sum(_C) / 3
    alpha = (b - mean) / (sum(c * c for c in _C) - 3 * mean * mean)
    f16, f8, f4 = (1 / 3 + alpha * (c - mean) for c in _C)
    if f16 < 0:
        return 0.0, 4 * b - 1, 2 - 4 * b
    if f4 < 0:
        return 2 * b - 1, 2 - 2 * b, 0.0
    return f16, f8, f4


def balanced_counts(budget: float, n: int, num_sink: int, int4_allowed: bool) -> TierCounts:
    s = effective_sinks(budget, n, num_sink, int4_allowed)
    m, q = n - s, budget_quarters(budget, n) - 4 * s
    n16 = 0
    if int4_allowed and m and q < 4 * m:
        # floor the fp16 share, then let Eq. 14/15 spend what is left exactly
        n16 = math.floor(balanced_fractions(q / (4 * m))[0] * m)
    r16, n8, n4, nd = fill_counts(q - 4 * n16, m - n16, int4_allowed)
    return TierCounts(fp16=n16 + r16 + s, int8=n8, int4=n4, drop=nd, num_sink=s)


def spread_tiers(counts: tuple[int, ...], tier_ids: tuple[int, ...]) -> torch.Tensor:
    """Interleave tiers so each is spread evenly along a span of sum(counts) positions."""
    keys, ids = [], []
    for c, t in zip(counts, tier_ids):
        keys += [(k + 0.5) / c for k in range(c)]
        ids += [t] * c
    order = sorted(range(len(ids)), key=lambda i: (keys[i], ids[i]))
    return torch.tensor([ids[i] for i in order], dtype=torch.int8)


class BalancedTierPolicy(TierPolicy):
    name = "balanced"
    ranked = False

    def assign(self, importance: torch.Tensor, budget: float, num_sink: int = 0,
               int4_allowed: bool = True, rng_seed: int = 0) -> torch.Tensor:
        n = check_inputs(importance, budget, num_sink).numel()
        counts = balanced_counts(budget, n, num_sink, int4_allowed)
        s = counts.num_sink
        tiers = torch.full((n,), TIER_FP16, dtype=torch.int8)
        tiers[s:] = spread_tiers((counts.fp16 - s, counts.int8, counts.int4, counts.drop),
                                 (TIER_FP16, TIER_INT8, TIER_INT4, TIER_DROP))
        return tiers
