"""RandomTier baseline (paper Sec. 5): greedy's tier counts on a seeded random permutation.

Same sinks and same counts as greedy (so the same budget spend); only the ranking is replaced
by torch.randperm under a CPU generator seeded with rng_seed, so a seed reproduces exactly.
"""
from __future__ import annotations

import torch

from sgl_kvxfer.spectrum.budget import tier_counts
from sgl_kvxfer.spectrum.policies.base import TierPolicy, check_inputs, fill_by_order


class RandomTierPolicy(TierPolicy):
    name = "random-tier"
    ranked = False

    def assign(self, importance: torch.Tensor, budget: float, num_sink: int = 0,
               int4_allowed: bool = True, rng_seed: int = 0) -> torch.Tensor:
        n = check_inputs(importance, budget, num_sink).numel()
        counts = tier_counts(budget, n, num_sink, int4_allowed)
        s = counts.num_sink
        gen = torch.Generator().manual_seed(rng_seed)
        order = torch.cat([torch.arange(s), torch.randperm(n - s, generator=gen) + s])
        return fill_by_order(order, counts)
