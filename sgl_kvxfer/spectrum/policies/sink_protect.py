"""SinkProtect (paper Sec. 4.4 / Table 11): greedy that always pins an fp16 sink prefix.

Identical to greedy when num_sink > 0; num_sink=0 means "use default_num_sink" (4, the
StreamingLLM prefix) instead of "no sinks", so this policy can never run unpinned.
"""
from __future__ import annotations

import torch

from sgl_kvxfer.spectrum.policies.greedy import GreedyTierPolicy


class SinkProtectTierPolicy(GreedyTierPolicy):
    name = "sink-protect"

    def __init__(self, default_num_sink: int = 4):
        if default_num_sink < 1:
            raise ValueError(f"default_num_sink must be >= 1, got {default_num_sink}")
        self.default_num_sink = default_num_sink

    def assign(self, importance: torch.Tensor, budget: float, num_sink: int = 0,
               int4_allowed: bool = True, rng_seed: int = 0) -> torch.Tensor:
        return super().assign(importance, budget, self.sink_count(num_sink), int4_allowed, rng_seed)

    def sink_count(self, num_sink: int) -> int:
        return num_sink if num_sink > 0 else self.default_num_sink

    def __repr__(self) -> str:
        return f"SinkProtectTierPolicy(default_num_sink={self.default_num_sink})"
