"""Tier policy registry. Names feed the `--kv-tier-policy` argparse choices; imports are lazy.

    policy          tiers used              ranked  keep/drop
    greedy          fp16/int8/int4 (Eq14/15)  yes     no
    sink-protect    greedy, sinks always      yes     no
    adaptive-2tier  fp16/int8 (+drop < 0.5)   yes     no
    balanced        even mix, spread          no      no
    random-tier     greedy counts, shuffled   no      no
    uniform-int8    int8                      yes*    no
    uniform-int4    int4                      yes*    no
    pdtrim          fp16 head + tail          no      yes
    sws             fp16 top-k                yes     yes
    kivi            fp16 newest / KIVI int    no      no (its own store format: policies/kivi.py)
(* ranking only decides which tokens drop when the budget is below the uniform cost.)
"""
from __future__ import annotations

import importlib

from sgl_kvxfer.spectrum.policies.base import TierPolicy

# name -> "module:Class" under sgl_kvxfer.spectrum.policies
TIER_POLICIES: dict[str, str] = {
    "greedy": "greedy:GreedyTierPolicy",
    "sink-protect": "sink_protect:SinkProtectTierPolicy",
    "adaptive-2tier": "adaptive:Adaptive2TierPolicy",
    "balanced": "balanced:BalancedTierPolicy",
    "random-tier": "random_tier:RandomTierPolicy",
    "uniform-int8": "uniform_int8:UniformInt8TierPolicy",
    "uniform-int4": "uniform_int4:UniformInt4TierPolicy",
    "pdtrim": "pdtrim:PDTrimTierPolicy",
    "sws": "sws:SWSTierPolicy",
    "kivi": "kivi:KIVITierPolicy",
}


def create_tier_policy(name: str, layout=None, budget: float | None = None, **kwargs) -> TierPolicy:
    """Instantiate a registered policy; kwargs go to its constructor (e.g. first_ratio=0.3).
    Policies whose class sets `needs_layout` (KIVI: its store format and costs) also get the KV
    layout and the budget they will run at."""
    if name not in TIER_POLICIES:
        raise ValueError(f"unknown tier policy {name!r}; choose from {sorted(TIER_POLICIES)}")
    module, cls = TIER_POLICIES[name].split(":")
    klass = getattr(importlib.import_module(f"{__name__}.{module}"), cls)
    if getattr(klass, "needs_layout", False):
        kwargs = {"layout": layout, "budget": budget, **kwargs}
    return klass(**kwargs)


__all__ = ["TIER_POLICIES", "TierPolicy", "create_tier_policy"]
