"""Adaptive 2-tier (paper Sec. 7.4.3): fp16 + int8 only, whatever int4_allowed says.

Below b = 0.5 even all-int8 does not fit, so the least important tokens are dropped
(f8 = 2b, f_drop = 1 - 2b; at b = 0.3 only 60% of tokens are sent). This is the policy an
int4-intolerant model (probe failed) runs; greedy with int4_allowed=False is equivalent.
"""
from __future__ import annotations

import torch

from sgl_kvxfer.spectrum.policies.greedy import GreedyTierPolicy


class Adaptive2TierPolicy(GreedyTierPolicy):
    name = "adaptive-2tier"

    def assign(self, importance: torch.Tensor, budget: float, num_sink: int = 0,
               int4_allowed: bool = True, rng_seed: int = 0) -> torch.Tensor:
        return super().assign(importance, budget, num_sink, False, rng_seed)
