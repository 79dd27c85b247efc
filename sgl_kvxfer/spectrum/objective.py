"""First-order objective of SpectrumKV (paper Eq. 9) and the sortedness invariant (Prop. 1).

    J(pi) = sum_j I_j * delta(q_j),   delta(fp16) < delta(int8) < delta(int4) < delta(drop)

For fixed tier counts, J is minimized by an importance-sorted assignment (exchange argument):
swapping the tiers of a pair with I_a >= I_b changes J by (I_a - I_b)(delta_b - delta_a) >= 0
whenever a already holds the higher precision.
"""
from __future__ import annotations

import torch

from sgl_kvxfer.spectrum.importance import sink_mask

# Ordinal perturbation levels per tier id; any strictly increasing table gives the same argmin.
DEFAULT_DELTA = (0.0, 1.0, 2.0, 4.0)


def weighted_error(importance: torch.Tensor, tiers: torch.Tensor,
                   delta: tuple[float, ...] = DEFAULT_DELTA) -> float:
    """Eq. 9 objective J = sum_j I_j * delta(tier_j)."""
    table = torch.tensor(delta, dtype=torch.float64)
    return float((importance.double().cpu() * table[tiers.long().cpu()]).sum())


def is_importance_sorted(importance: torch.Tensor, tiers: torch.Tensor, num_sink: int = 0) -> bool:
    """True iff no non-sink pair has I_a > I_b while tier_a > tier_b (a got lower precision).

    Sort by tier ascending, then stably by importance descending: equal scores end up with their
    best tier first, so any remaining descent in the tier sequence is a strict violation.
    """
    keep = ~sink_mask(importance.numel(), num_sink)
    imp, tier = importance.detach().float().cpu()[keep], tiers.long().cpu()[keep]
    by_tier = torch.argsort(tier, stable=True)
    order = by_tier[torch.argsort(imp[by_tier], descending=True, stable=True)]
    seq = tier[order]
    return bool((seq[1:] >= seq[:-1]).all()) if seq.numel() > 1 else True
