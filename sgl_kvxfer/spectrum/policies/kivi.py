"""KIVI baseline (Liu et al., ICML 2024): every token quantized, keys per channel, values per token.

The int4 store takes KIVI's format (`store_formats`: spectrum/formats.py, channel key axis) at the
widest bit width b pays for, from (8, 4, 2); what the budget leaves over keeps the NEWEST tokens
at fp16 (KIVI's full-precision residual window). Importance and sinks play no part. Its budget is
bytes in either unit: a token of the low store costs c = its bytes / fp16 bytes, scales included.

    c <= b:   n16 = floor((b - c) n / (1 - c)) newest at fp16, the rest in the int4 store
    c >  b:   (b below 2-bit KIVI) floor(b n / c) newest in the int4 store, the oldest dropped

Like uniform-int4, it refuses to run when int4 is not allowed (the probe said no).
"""
from __future__ import annotations

import math

import torch

from sgl_kvxfer.spectrum.formats import CHANNEL_AXIS_BITS, IntFormat, StoreFormats
from sgl_kvxfer.spectrum.policies.base import TierPolicy, check_inputs
from sgl_kvxfer.spectrum.tiers import TIER_DROP, TIER_FP16, TIER_INT4


def kivi_cost(bits: int, layout) -> float:
    """Bytes of one KIVI token at `bits` over its fp16 bytes (layout None: bits / 16)."""
    if layout is None:
        return bits / 16
    k, v = IntFormat(bits, "channel").head_bytes(layout.head_dim, layout.group_size, layout.page_size,
                                                 layout.scale_bytes)
    return (k + v) / (2 * layout.head_dim * layout.elem_bytes)


def kivi_bits(budget: float, layout) -> int:
    """The widest KIVI bit width whose all-token cost fits budget b (2 when none does)."""
    return next((b for b in CHANNEL_AXIS_BITS if kivi_cost(b, layout) <= budget + 1e-9), CHANNEL_AXIS_BITS[-1])


class KIVITierPolicy(TierPolicy):
    name = "kivi"
    ranked = False
    needs_layout = True

    def __init__(self, layout=None, budget: float | None = None, bits: int | None = None):
        if bits is None:
            bits = kivi_bits(budget, layout) if budget is not None else 4
        if bits not in CHANNEL_AXIS_BITS:
            raise ValueError(f"kivi bits must be one of {CHANNEL_AXIS_BITS}, got {bits}")
        self.layout, self.bits = layout, bits
        self.cost = kivi_cost(bits, layout)

    def assign(self, importance: torch.Tensor, budget: float, num_sink: int = 0,
               int4_allowed: bool = True, rng_seed: int = 0) -> torch.Tensor:
        if not int4_allowed:
            raise ValueError("kivi keeps its tokens in the int4 store; the model's int4 probe is off or failed "
                             "(use --kv-int4 on to force it)")
        n = check_inputs(importance, budget, num_sink).numel()
        tiers = torch.full((n,), TIER_INT4, dtype=torch.int8)
        c = self.cost
        if c <= budget + 1e-12:
            n16 = min(n, math.floor((budget - c) * n / (1 - c) + 1e-9)) if c < 1 else n
            if n16:
                tiers[n - n16:] = TIER_FP16
        else:
            keep = min(n, math.floor(budget * n / c + 1e-9))
            tiers[:n - keep] = TIER_DROP
        return tiers

    def store_formats(self, budget: float, layout) -> StoreFormats:
        num_layers = layout.num_layers if layout is not None else 1
        return StoreFormats.with_int4((IntFormat(self.bits, "channel"),) * num_layers)

    def __repr__(self) -> str:
        return f"KIVITierPolicy(bits={self.bits})"
