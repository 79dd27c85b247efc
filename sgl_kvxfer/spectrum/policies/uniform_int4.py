"""Uniform int4 baseline (paper Table 14): every token at int4, normalized cost 0.25.

Refuses to run when int4 is not allowed (an explicit int4 baseline on an int4-intolerant
model must be requested with --kv-int4 on). Below b = 0.25 the floor(4bn) top-ranked tokens
stay int4 and the rest are dropped.
"""
from __future__ import annotations

import torch

from sgl_kvxfer.spectrum.budget import TierCounts, budget_quarters
from sgl_kvxfer.spectrum.importance import ranking_order
from sgl_kvxfer.spectrum.policies.base import TierPolicy, check_inputs, fill_by_order


class UniformInt4TierPolicy(TierPolicy):
    name = "uniform-int4"

    def assign(self, importance: torch.Tensor, budget: float, num_sink: int = 0,
               int4_allowed: bool = True, rng_seed: int = 0) -> torch.Tensor:
        if not int4_allowed:
            raise ValueError("uniform-int4 needs int4; the model's int4 probe is off or failed "
                             "(use --kv-int4 on to force it)")
        imp = check_inputs(importance, budget, num_sink)
        n = imp.numel()
        keep = min(n, budget_quarters(budget, n))
        return fill_by_order(ranking_order(imp, num_sink), TierCounts(0, 0, keep, n - keep))
