"""Greedy SpectrumKV (paper Sec. 4.4, Algorithm 1): pin sinks, rank, fill Eq. 14/15 counts.

Sinks: honors `num_sink` as passed (Algorithm 1 step 2). num_sink=0 reproduces the ablation's
"Greedy (no pin)" row, where sinks compete on their score. Without int4 it is the 2-tier map.
"""
from __future__ import annotations

import torch

from sgl_kvxfer.spectrum.budget import tier_counts
from sgl_kvxfer.spectrum.importance import ranking_order
from sgl_kvxfer.spectrum.policies.base import TierPolicy, check_inputs, fill_by_order


class GreedyTierPolicy(TierPolicy):
    name = "greedy"

    def assign(self, importance: torch.Tensor, budget: float, num_sink: int = 0,
               int4_allowed: bool = True, rng_seed: int = 0) -> torch.Tensor:
        imp = check_inputs(importance, budget, num_sink)
        counts = tier_counts(budget, imp.numel(), num_sink, int4_allowed)
        return fill_by_order(ranking_order(imp, counts.num_sink), counts)

    def counts_for(self, n: int, budget: float, num_sink: int = 0, int4_allowed: bool = True):
        return tier_counts(budget, n, num_sink, int4_allowed)  # = assign's counts, whatever the scores
