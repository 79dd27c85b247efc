"""SWS-like keep/drop baseline (paper Sec. 5): keep the floor(b * n) most important tokens at fp16.

Sinks rank first when num_sink > 0; everything else is TIER_DROP. The paper's "ValueAware"
variant differs only in its score, so pass a value-aware importance to get it.
"""
from __future__ import annotations

import torch

from sgl_kvxfer.spectrum.budget import TierCounts, budget_quarters
from sgl_kvxfer.spectrum.importance import ranking_order
from sgl_kvxfer.spectrum.policies.base import TierPolicy, check_inputs, fill_by_order


class SWSTierPolicy(TierPolicy):
    name = "sws"
    keep_drop = True

    def assign(self, importance: torch.Tensor, budget: float, num_sink: int = 0,
               int4_allowed: bool = True, rng_seed: int = 0) -> torch.Tensor:
        imp = check_inputs(importance, budget, num_sink)
        n = imp.numel()
        keep = min(n, budget_quarters(budget, n) // 4)
        return fill_by_order(ranking_order(imp, num_sink), TierCounts(keep, 0, 0, n - keep))
