"""Uniform int8 baseline (paper Table 2): every token at int8, normalized cost 0.5.

Budget above 0.5 is left unspent. Below 0.5 the budget cannot pay for every token, so the
floor(2bn) top-ranked tokens (sinks first) stay int8 and the rest are dropped.
"""
from __future__ import annotations

import torch

from sgl_kvxfer.spectrum.budget import TierCounts, budget_quarters
from sgl_kvxfer.spectrum.importance import ranking_order
from sgl_kvxfer.spectrum.policies.base import TierPolicy, check_inputs, fill_by_order


class UniformInt8TierPolicy(TierPolicy):
    name = "uniform-int8"

    def assign(self, importance: torch.Tensor, budget: float, num_sink: int = 0,
               int4_allowed: bool = True, rng_seed: int = 0) -> torch.Tensor:
        imp = check_inputs(importance, budget, num_sink)
        n = imp.numel()
        keep = min(n, budget_quarters(budget, n) // 2)
        return fill_by_order(ranking_order(imp, num_sink), TierCounts(0, keep, 0, n - keep))
