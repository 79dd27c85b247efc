"""Base class of tier policies: token importance -> one tier id per prompt token.

Contract of `assign` (every implementation, every input):
  * returns an int8 CPU tensor [n] of tier ids in {TIER_FP16, TIER_INT8, TIER_INT4, TIER_DROP};
  * respects the budget: sum_j c(tier_j) <= b * n in exact quarter units (budget.check_budget);
  * never emits TIER_INT4 when int4_allowed is False (the probe said no; uniform-int4 raises);
  * is a pure function of its arguments (random-tier draws only from rng_seed).
Policies with `ranked = True` also keep the Prop. 1 invariant: outside the first num_sink
positions, a more important token never gets a larger tier id than a less important one.

TIER_DROP semantics: the consumer masks the token out of attention (its KV is not sent and
its slot is never read). It must never be zero-filled instead: a zero key still draws softmax
mass exp(0) and a zero value drags the output toward 0 (paper App. B, fix ii).
Policies hold only constructor hyper-parameters; `assign` mutates nothing, so one instance may
serve every request from any thread.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from sgl_kvxfer.spectrum.budget import TierCounts
from sgl_kvxfer.spectrum.formats import StoreFormats  # noqa: F401 (annotation)
from sgl_kvxfer.spectrum.tiers import TIER_DROP, TIER_FP16, TIER_INT4, TIER_INT8


class TierPolicy(ABC):
    name: ClassVar[str] = ""
    # Prop. 1 sortedness holds outside the sinks.
    ranked: ClassVar[bool] = True
    # Keep/drop selection baseline: kept tokens stay fp16, the rest are TIER_DROP.
    keep_drop: ClassVar[bool] = False

    @abstractmethod
    def assign(self, importance: torch.Tensor, budget: float, num_sink: int = 0,
               int4_allowed: bool = True, rng_seed: int = 0) -> torch.Tensor:
        """importance [n] (>= 0, larger = keep sharper) -> int8 tier ids [n]. See module contract."""

    def counts_for(self, n: int, budget: float, num_sink: int = 0, int4_allowed: bool = True) -> "TierCounts | None":
        """The tokens per tier `assign` gives n tokens at `budget`, when they depend on nothing
        else (not on the scores); None otherwise. Lets the byte-budget search (byte_budget.py)
        test a budget without building an assignment."""
        return None

    def sink_count(self, num_sink: int) -> int:
        """Sinks this policy is asked to pin for a caller's num_sink (before budget clamping)."""
        return num_sink

    def store_formats(self, budget: float, layout) -> "StoreFormats | None":
        """Per-layer int store formats this policy needs at budget b (spectrum/formats.py), or
        None for the codec's int8 / int4 (every policy but the KIVI baseline)."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def check_inputs(importance: torch.Tensor, budget: float, num_sink: int) -> torch.Tensor:
    """Validate and return importance as a float32 CPU vector."""
    if importance.dim() != 1:
        raise ValueError(f"importance must be 1-D [n], got shape {tuple(importance.shape)}")
    if not budget >= 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    if num_sink < 0:
        raise ValueError(f"num_sink must be >= 0, got {num_sink}")
    imp = importance.detach().float().cpu()
    if torch.isnan(imp).any():
        raise ValueError("importance contains NaN")
    return imp


def fill_by_order(order: torch.Tensor, counts: TierCounts) -> torch.Tensor:
    """Hand out tiers along `order`: first counts.fp16 ids get fp16, then int8, int4, drop.

        order: [ 0 .. fp16 ) [ .. +int8 ) [ .. +int4 ) [ .. n )
                  FP16         INT8         INT4        DROP
    """
    n = order.numel()
    if counts.total != n:
        raise ValueError(f"counts cover {counts.total} tokens, order has {n}")
    tiers = torch.empty(n, dtype=torch.int8)
    a = counts.fp16
    b = a + counts.int8
    c = b + counts.int4
    tiers[order[:a]] = TIER_FP16
    tiers[order[a:b]] = TIER_INT8
    tiers[order[b:c]] = TIER_INT4
    tiers[order[c:]] = TIER_DROP
    return tiers
