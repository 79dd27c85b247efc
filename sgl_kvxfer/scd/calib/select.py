"""Patch-layer selection, the paper's Appendix A (plain Python over a metric callback).

F(S) is a task metric (higher is better) of the consumer whose layers in S are restored to its
oracle state (during profiling a restored layer stands for a perfectly patched one) and whose
other layers use Reuse. With dF(S) = F(S) - F({}):

  1. restore-one profile   dF_l = F({l}) - F({}) for every layer; candidate pool C = top-M layers
  2. greedy growth         S_t = S_{t-1} + argmax_{l in C \\ S_{t-1}} F(S_{t-1} + {l})
  3. budget                k* = argmax_{k in [k_min, k_max]} dF(S_k) / (c k)   ("auto"),
                           or a fixed k (then S_k)

c is a constant per-layer cost (it scales the efficiency curve, never moves its argmax). F is
memoized on the frozen set, so each configuration is evaluated once.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


@dataclass
class Selection:
    layers: tuple[int, ...]  # the chosen patch set S_k*, sorted
    k: int
    base: float  # F({})
    restore_one: dict[int, float]  # dF_l
    candidates: list[int]  # the pool, best first
    greedy: list[tuple[int, float]]  # (layer added at step t, dF(S_t)), t = 1..k_max
    efficiency: list[float]  # dF(S_k) / (c k), k = 1..len(greedy)
    evaluations: int = 0
    budget: str = "auto"
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"layers": list(self.layers), "k": self.k, "budget": self.budget, "F_empty": self.base,
                "restore_one": {str(k): v for k, v in self.restore_one.items()}, "candidates": self.candidates,
                "greedy": [{"layer": l, "dF": d} for l, d in self.greedy], "efficiency": self.efficiency,
                "evaluations": self.evaluations, **self.extra}


def select_patch_layers(metric: Callable[[frozenset], float], num_layers: int, budget: int | str = "auto",
                        pool: int | None = None, k_min: int = 1, k_max: int = 8, cost: float = 1.0,
                        progress: Callable[[str], None] | None = None) -> Selection:
    """budget: a fixed k (0 = Reuse only) or "auto" (k* over [k_min, k_max])."""
    cache: dict[frozenset, float] = {}

    def F(s) -> float:
        s = frozenset(s)
        if s not in cache:
            cache[s] = float(metric(s))
            if progress:
                progress(f"F({sorted(s)}) = {cache[s]:.5f}")
        return cache[s]

    fixed = budget != "auto"
    k_hi = int(budget) if fixed else k_max
    if not 0 <= k_hi <= num_layers or (not fixed and not 1 <= k_min <= k_max):
        raise ValueError(f"bad budget {budget!r} / k range [{k_min}, {k_max}] for {num_layers} layers")
    base = F(())
    if k_hi == 0:
        return Selection((), 0, base, {}, [], [], [], len(cache), str(budget))
    gains = {layer: F({layer}) - base for layer in range(num_layers)}
    m = max(k_hi, pool if pool else max(2 * k_hi, num_layers // 2))
    candidates = sorted(gains, key=lambda l: (-gains[l], l))[:min(m, num_layers)]
    chosen: list[int] = []
    greedy: list[tuple[int, float]] = []
    while len(chosen) < min(k_hi, len(candidates)):
        best = max((l for l in candidates if l not in chosen), key=lambda l: (F(chosen + [l]), -l))
        chosen.append(best)
        greedy.append((best, F(chosen) - base))
    eff = [d / (cost * (i + 1)) for i, (_, d) in enumerate(greedy)]
    if fixed:
        k = len(greedy)
    else:
        lo = min(k_min, len(eff))
        k = max(range(lo, len(eff) + 1), key=lambda kk: (eff[kk - 1], -kk))
    return Selection(tuple(sorted(chosen[:k])), k, base, gains, candidates, greedy, eff, len(cache), str(budget))
