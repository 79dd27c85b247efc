"""Running a tier policy under a *byte* budget (the engine's default `--kv-budget-unit bytes`).

The paper's budget b is a normalized cost (Eq. 3) that ignores the fp16 scale and zero each int
group carries. The engine promises more: resident KV bytes, scales included, are at most
b x the bytes of an all-fp16 cache. It keeps that promise by running the policy at the largest
cost budget b' <= b whose assignment fits those bytes:

    b' = q* / 4n,   q* = max { q in [0, floor(4bn)] : bytes(policy.assign(I, q / 4n)) <= b * fp16_bytes(n) }

found by binary search over integer quarter units q. Bytes grow with q for every registered
policy, and the search only keeps a q it checked, so the answer fits even for a policy that were
not monotone. Example, head_dim 64 and group 32: int8 costs 0.5625 of fp16 and int4 0.3125,
so b = 0.5 runs greedy at b' = 0.4375 (75% int8, 25% int4) instead of all-int8. Keep/drop
policies are unchanged (fp16 bytes equal fp16 cost). Bytes are counted on a 2-byte fp16 cache
(`KVLayout.elem_bytes`), whatever dtype the engine computes in, so CPU and GPU runs agree.
"""
from __future__ import annotations

import math

import torch

from sgl_kvxfer.spectrum.budget import KVLayout, assignment_bytes, budget_quarters, fp16_bytes
from sgl_kvxfer.spectrum.policies.base import TierPolicy
from sgl_kvxfer.spectrum.tiers import NUM_TIERS, TIER_DROP, TIER_FP16, TIER_INT4, TIER_INT8

BUDGET_UNITS = ("bytes", "cost")


def byte_cap(budget: float, n: int, layout: KVLayout) -> int:
    """Largest payload (bytes, scales included) n tokens may hold under byte budget b."""
    return int(math.floor(budget * fp16_bytes(n, layout) + 1e-6))


def fit_byte_budget(policy: TierPolicy, importance: torch.Tensor, budget: float, layout: KVLayout,
                    num_sink: int = 0, int4_allowed: bool = True, rng_seed: int = 0) -> tuple[torch.Tensor, float]:
    """(tiers, b'): the policy's assignment at the largest cost budget b' that fits b in bytes."""
    n = importance.numel()
    cap = byte_cap(budget, n, layout)

    def run(q: int) -> torch.Tensor:
        return policy.assign(importance, q / (4.0 * n), num_sink, int4_allowed, rng_seed)

    def fits(q: int) -> tuple[bool, torch.Tensor | None]:
        """Whether q's assignment fits the cap, and the assignment when one was built (a
        policy whose counts do not depend on the scores is tested on its counts alone:
        assignment_bytes depends only on the counts)."""
        counts = policy.counts_for(n, q / (4.0 * n), num_sink, int4_allowed)
        if counts is None:
            tiers = run(q)
            return assignment_bytes(tiers, layout) <= cap, tiers
        per_tier = [0] * NUM_TIERS
        per_tier[TIER_FP16], per_tier[TIER_INT8], per_tier[TIER_INT4], per_tier[TIER_DROP] = (
            counts.fp16, counts.int8, counts.int4, counts.drop)
        return sum(c * layout.token_bytes(t) for t, c in enumerate(per_tier)) <= cap, None

    hi = budget_quarters(budget, n)
    ok, best = fits(hi)
    if ok:
        return (run(hi) if best is None else best), hi / (4.0 * n)
    lo, best = 0, None  # q = 0 keeps nothing: always fits
    hi -= 1
    while lo < hi:  # invariant: q = lo fits (its tiers are `best`, or None: not built yet)
        mid = (lo + hi + 1) // 2
        ok, tiers = fits(mid)
        if ok:
            lo, best = mid, tiers
        else:
            hi = mid - 1
    return (run(lo) if best is None else best), lo / (4.0 * n)


def assign_tiers(policy: TierPolicy, importance: torch.Tensor, budget: float, layout: KVLayout,
                 unit: str = "bytes", num_sink: int = 0, int4_allowed: bool = True,
                 rng_seed: int = 0) -> torch.Tensor:
    """int8 tier ids [n] for `importance` [n] under budget b in `unit` ("bytes" or "cost")."""
    if unit not in BUDGET_UNITS:
        raise ValueError(f"budget unit must be one of {BUDGET_UNITS}, got {unit!r}")
    if importance.numel() == 0:
        return torch.empty(0, dtype=torch.int8)
    if unit == "cost":
        return policy.assign(importance, budget, num_sink, int4_allowed, rng_seed)
    return fit_byte_budget(policy, importance, budget, layout, num_sink, int4_allowed, rng_seed)[0]


def planned_fractions(policy: TierPolicy, budget: float, layout: KVLayout, unit: str = "bytes",
                      num_sink: int = 0, int4_allowed: bool = True, n: int = 4096) -> tuple[float, ...]:
    """Tier mix (f16, f8, f4, f_drop) the policy produces on an n-token request; sizes tier stores."""
    ranked = torch.linspace(1.0, 0.0, n)  # any strictly ranked importance gives the same counts
    tiers = assign_tiers(policy, ranked, budget, layout, unit, num_sink, int4_allowed)
    counts = torch.bincount(tiers.to(torch.int64), minlength=NUM_TIERS).tolist()
    return tuple(c / n for c in counts)


def uses_int4(policy: TierPolicy) -> bool:
    """Whether the policy emits int4 at all when allowed (decides if the int4 probe matters)."""
    tiers = policy.assign(torch.linspace(1.0, 0.0, 256), 0.3, 4, True, 0)
    return bool((tiers == TIER_INT4).any())
