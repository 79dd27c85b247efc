"""PDTrim baseline (paper Sec. 5, Table 9): keep a first and a last region at fp16, drop the middle.

keep = floor(b * n) tokens (fp16 costs 1); the first round(keep * first_ratio) positions (at
least num_sink) and the last keep - n_first positions are kept; importance is ignored.

    positions: [0, n_first) kept | [n_first, n - n_last) TIER_DROP | [n - n_last, n) kept
"""
from __future__ import annotations

import torch

from sgl_kvxfer.spectrum.budget import budget_quarters
from sgl_kvxfer.spectrum.policies.base import TierPolicy, check_inputs
from sgl_kvxfer.spectrum.tiers import TIER_DROP, TIER_FP16


class PDTrimTierPolicy(TierPolicy):
    name = "pdtrim"
    ranked = False
    keep_drop = True

    def __init__(self, first_ratio: float = 0.5):
        if not 0.0 <= first_ratio <= 1.0:
            raise ValueError(f"first_ratio must be in [0, 1], got {first_ratio}")
        self.first_ratio = first_ratio

    def assign(self, importance: torch.Tensor, budget: float, num_sink: int = 0,
               int4_allowed: bool = True, rng_seed: int = 0) -> torch.Tensor:
        n = check_inputs(importance, budget, num_sink).numel()
        keep = min(n, budget_quarters(budget, n) // 4)
        n_first = min(keep, max(round(keep * self.first_ratio), num_sink))
        n_last = keep - n_first
        tiers = torch.full((n,), TIER_DROP, dtype=torch.int8)
        tiers[:n_first] = TIER_FP16
        if n_last:
            tiers[n - n_last:] = TIER_FP16
        return tiers

    def __repr__(self) -> str:
        return f"PDTrimTierPolicy(first_ratio={self.first_ratio})"
