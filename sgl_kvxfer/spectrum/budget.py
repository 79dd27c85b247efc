"""Transfer-budget arithmetic of SpectrumKV (paper Sec. 2.1 and 4.4).

Normalized cost per element (Eq. 2): c(16)=1, c(8)=1/2, c(4)=1/4, and c(drop)=0 for the
keep/drop baselines. The budget of an assignment is b(pi) = (1/n) sum_j c(q_j) (Eq. 3).
All comparisons run in integer *quarter units* (c * 4), so "respects budget b" is exact:

    sum_j quarters(q_j) <= floor(4 * b * n)      (a 1e-9 slack absorbs float error in b * n)

Byte accounting is separate from the normalized cost: real payloads also carry one fp16 scale
and zero per `group_size` elements for the int tiers, so the byte ratio is >= the cost.
`KVLayout.vector_bytes` equals `sgl_kvxfer.kernels.tier_codec.payload_bytes` (tested).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from sgl_kvxfer.spectrum.formats import StoreFormats
from sgl_kvxfer.spectrum.tiers import (NUM_TIERS, TIER_DROP, TIER_FP16, TIER_INT4, TIER_INT8,
                                       TIER_QUARTERS)

_EPS = 1e-9
_COST_BY_BITS = {16: 1.0, 8: 0.5, 4: 0.25}


def cost(bits: int) -> float:
    """Eq. 2: normalized per-element cost of a precision given in bits (16, 8 or 4)."""
    if bits not in _COST_BY_BITS:
        raise ValueError(f"bits must be one of {tuple(_COST_BY_BITS)}, got {bits}")
    return _COST_BY_BITS[bits]


def tier_cost(tier: int) -> float:
    """Normalized cost of a tier id (TIER_DROP costs 0)."""
    return TIER_QUARTERS[tier] / 4.0


def budget_quarters(budget: float, n: int) -> int:
    """Largest integer number of quarter units that n tokens may spend under budget b."""
    if budget < 0 or n < 0:
        raise ValueError(f"budget and n must be >= 0, got {budget}, {n}")
    return int(math.floor(4.0 * budget * n + _EPS))


def cost_quarters(tiers: torch.Tensor) -> int:
    """Exact spend of an assignment in quarter units."""
    counts = torch.bincount(tiers.to(torch.int64).flatten(), minlength=NUM_TIERS)
    if counts.numel() > NUM_TIERS:
        raise ValueError(f"tier ids must be < {NUM_TIERS}")
    return int(sum(int(c) * q for c, q in zip(counts.tolist(), TIER_QUARTERS)))


def normalized_cost(tiers: torch.Tensor) -> float:
    """Eq. 3: the budget actually used, b(pi) = (1/n) sum c(q_j). 0 for an empty assignment."""
    n = tiers.numel()
    return cost_quarters(tiers) / (4.0 * n) if n else 0.0


class BudgetExceededError(ValueError):
    pass


def check_budget(tiers: torch.Tensor, budget: float) -> float:
    """Prove that `tiers` respects budget b in exact quarter arithmetic; return b(pi).

    Raises BudgetExceededError with the offending numbers otherwise.
    """
    n = tiers.numel()
    used, cap = cost_quarters(tiers), budget_quarters(budget, n)
    if used > cap:
        raise BudgetExceededError(
            f"assignment spends {used}/4 = {used / 4:.2f} cost units over {n} tokens "
            f"(b={used / (4 * n):.4f}) but budget {budget} allows {cap}/4")
    return used / (4.0 * n) if n else 0.0


def respects_budget(tiers: torch.Tensor, budget: float) -> bool:
    return cost_quarters(tiers) <= budget_quarters(budget, tiers.numel())


# ---------------------------------------------------------------- Eq. 14 / 15 tier map


def tier_fractions(budget: float, int4_allowed: bool = True) -> tuple[float, float, float, float]:
    """Continuous greedy map b -> (f16, f8, f4, f_drop), no sinks.

        3-tier  0.5 <= b <= 1 : f16 = 2b - 1, f8 = 2 - 2b            (Eq. 15)
                0.25 <= b < .5: f8 = 4b - 1,  f4 = 2 - 4b            (Eq. 14)
                b < 0.25      : f4 = 4b, rest dropped                (extension)
        2-tier  b >= 0.5      : Eq. 15
                b < 0.5       : f8 = 2b, rest dropped                (paper Sec. 7.4.3)
    b > 1 saturates at all-fp16. The fractions always sum to 1 and spend exactly min(b, 1).
    """
    b = min(max(budget, 0.0), 1.0)
    if b >= 0.5:
        return 2 * b - 1, 2 - 2 * b, 0.0, 0.0
    if not int4_allowed:
        return 0.0, 2 * b, 0.0, 1 - 2 * b
    if b >= 0.25:
        return 0.0, 4 * b - 1, 2 - 4 * b, 0.0
    return 0.0, 0.0, 4 * b, 1 - 4 * b


@dataclass(frozen=True)
class TierCounts:
    """Integer token counts of an assignment. `num_sink` tokens are part of `fp16`."""
    fp16: int
    int8: int
    int4: int
    drop: int
    num_sink: int = 0

    @property
    def total(self) -> int:
        return self.fp16 + self.int8 + self.int4 + self.drop

    @property
    def quarters(self) -> int:
        return 4 * self.fp16 + 2 * self.int8 + self.int4

    def as_tuple(self) -> tuple[int, int, int, int]:
        """Counts indexed by tier id (TIER_FP16, TIER_INT8, TIER_INT4, TIER_DROP)."""
        out = [0] * NUM_TIERS
        out[TIER_FP16], out[TIER_INT8], out[TIER_INT4], out[TIER_DROP] = (
            self.fp16, self.int8, self.int4, self.drop)
        return tuple(out)


def fill_counts(quarters: int, m: int, int4_allowed: bool = True) -> tuple[int, int, int, int]:
    """Integer Eq. 14/15 for m ranked tokens sharing `quarters` units: (n16, n8, n4, n_drop).

    Floors toward the lower tier, so the spend is <= quarters and, in the Eq. 14 band, equal.
    """
    if quarters >= 4 * m:
        return m, 0, 0, 0
    if quarters >= 2 * m:                      # Eq. 15: fp16 + int8
        n16 = (quarters - 2 * m) // 2
        return n16, m - n16, 0, 0
    if int4_allowed and quarters >= m:         # Eq. 14: int8 + int4
        n8 = quarters - m
        return 0, n8, m - n8, 0
    if int4_allowed:                           # below b = 1/4: int4 + drop
        return 0, 0, quarters, m - quarters
    n8 = quarters // 2                         # 2-tier below b = 1/2: int8 + drop
    return 0, n8, 0, m - n8


def effective_sinks(budget: float, n: int, num_sink: int, int4_allowed: bool = True) -> int:
    """How many of the requested sinks can be pinned at fp16.

    Rule: pinning never *causes* a drop. If all n tokens fit at the lowest allowed tier, sinks are
    pinned only while the rest still fit at that tier; if drops are unavoidable anyway, sinks stay
    pinned as far as the budget pays for them at fp16.
    """
    q, lo = budget_quarters(budget, n), (1 if int4_allowed else 2)
    s = min(max(num_sink, 0), n)
    if q >= lo * n:
        return min(s, (q - lo * n) // (4 - lo))
    return min(s, q // 4)


def tier_counts(budget: float, n: int, num_sink: int = 0, int4_allowed: bool = True) -> TierCounts:
    """Greedy 3-tier (or 2-tier) integer counts for n tokens with `num_sink` pinned sinks.

    SinkProtect semantics (Sec. 4.4): the first s tokens take fp16, and the remaining budget
    (4bn - 4s quarters) is mapped by Eq. 14/15 over the other n - s tokens.
    """
    s = effective_sinks(budget, n, num_sink, int4_allowed)
    n16, n8, n4, nd = fill_counts(budget_quarters(budget, n) - 4 * s, n - s, int4_allowed)
    return TierCounts(fp16=n16 + s, int8=n8, int4=n4, drop=nd, num_sink=s)


# ---------------------------------------------------------------- byte accounting


@dataclass(frozen=True)
class KVLayout:
    """Shape of one token's KV payload: K and V, each [num_layers, num_kv_heads, head_dim]."""
    num_layers: int
    num_kv_heads: int
    head_dim: int
    group_size: int = 32
    elem_bytes: int = 2   # model dtype (fp16/bf16) of the fp16 tier
    scale_bytes: int = 2  # each per-group scale and zero (the codec stores fp16)
    # per-layer int store formats (spectrum/formats.py); None = the codec's int8 / int4 everywhere
    formats: StoreFormats | None = None
    page_size: int = 64   # int-store page (channel-axis K scales are per page)

    def vector_bytes(self, tier: int, with_scales: bool = True) -> int:
        """Bytes of one head vector (one of K or V, one layer, one kv head) at `tier`.

        int tiers pack head_dim elements at 8 or 4 bits, plus one scale and one zero of
        scale_bytes each per group of group_size elements when with_scales.
        """
        if tier == TIER_DROP:
            return 0
        if tier == TIER_FP16:
            return self.head_dim * self.elem_bytes
        bits = 8 if tier == TIER_INT8 else 4
        if tier not in (TIER_INT8, TIER_INT4):
            raise ValueError(f"unknown tier id {tier}")
        data = (self.head_dim * bits + 7) // 8
        groups = -(-self.head_dim // self.group_size)
        return data + (2 * groups * self.scale_bytes if with_scales else 0)

    def token_bytes(self, tier: int, with_scales: bool = True) -> float:
        """Bytes one token costs at `tier` across all layers, kv heads, K and V (an int under
        uniform formats; channel-axis keys amortize their page scales, a fraction)."""
        if self.formats is not None and tier in (TIER_INT8, TIER_INT4):
            return self.formats.token_bytes(tier, self.num_kv_heads, self.head_dim, self.group_size,
                                            self.page_size, self.scale_bytes if with_scales else 0)
        return 2 * self.num_layers * self.num_kv_heads * self.vector_bytes(tier, with_scales)


def fp16_bytes(n: int, layout: KVLayout) -> int:
    """Eq. 1: 2 * L * Hkv * d_h * n * s16."""
    return 2 * layout.num_layers * layout.num_kv_heads * layout.head_dim * n * layout.elem_bytes


def assignment_bytes(tiers: torch.Tensor, layout: KVLayout, with_scales: bool = True) -> float:
    """Exact payload bytes of an assignment (dropped tokens send nothing)."""
    counts = torch.bincount(tiers.to(torch.int64).flatten(), minlength=NUM_TIERS).tolist()
    return sum(c * layout.token_bytes(t, with_scales) for t, c in enumerate(counts))


def byte_ratio(tiers: torch.Tensor, layout: KVLayout, with_scales: bool = True) -> float:
    """Payload bytes over the all-fp16 payload.

    Equals normalized_cost when with_scales=False, elem_bytes == 2 and head_dim is even.
    """
    n = tiers.numel()
    return assignment_bytes(tiers, layout, with_scales) / fp16_bytes(n, layout) if n else 0.0
