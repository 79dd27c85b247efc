"""Sizing the tier stores of a TieredKVPool inside the memory an fp16 pool would take.

Plain arithmetic over byte counts (unit-tested on CPU). With M = size x full_bytes (what
`Fp16KVPool(size)` would hold) and a planned tier mix (f16, f8, f4) over resident tokens:

    staging  S   = floor(staging x size)           fp16 slots for tokens not yet tiered
                                                    (prefill in flight, the decode window)
    tiered   T   = (M - S x b16) / (f16 b16 + f8 b8 + f4 b4)      tokens at the planned mix
    stores       n16 = S + f16 T,   n8 = f8 T,   n4 = f4 T        (n8, n4 floored to whole pages)

so (n16 + 2) b16 + n8 b8 + n4 b4 <= M (the fp16 store also holds the padding and the CUDA-graph
scratch rows). The planned mix includes the int4 decision (made before the pool is built,
scheduler/startup.py), so the stores are sized once.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TierStorePlan:
    """Slot counts of the three stores. n16 excludes the padding row."""
    n16: int
    n8: int
    n4: int

    @property
    def total(self) -> int:
        return self.n16 + self.n8 + self.n4


def split_int_stores(byte_left: int, f8: float, f4: float, b8: int, b4: int,
                     page_size: int = 1) -> tuple[int, int]:
    """(n8, n4), multiples of page_size, holding int tokens at ratio f8 : f4 in at most
    `byte_left` bytes."""
    if f8 + f4 <= 0 or byte_left <= 0:
        return 0, 0
    g8, g4 = f8 / (f8 + f4), f4 / (f8 + f4)
    tokens = byte_left / (g8 * b8 + g4 * b4)
    n8, n4 = int(g8 * tokens), int(g4 * tokens)
    return n8 - n8 % page_size, n4 - n4 % page_size


def plan_tier_stores(size: int, full_bytes: int, tier_bytes: tuple[int, int, int],
                     fractions: tuple[float, ...], staging: float, page_size: int = 1) -> TierStorePlan:
    """Stores for a pool that replaces an fp16 pool of `size` tokens at `full_bytes` each.

    tier_bytes: (b16, b8, b4) bytes one token takes in each store (all layers, K and V, scales);
    fractions: (f16, f8, f4[, f_drop]) of the planned mix; dropped tokens take no slot;
    page_size: the int stores' page (their slot counts are whole pages).
    """
    b16, b8, b4 = tier_bytes
    f16, f8, f4 = fractions[:3]
    resident = f16 + f8 + f4
    if resident <= 0:  # a pure-drop plan still needs somewhere to stage tokens
        f16, resident = 1.0, 1.0
    f16, f8, f4 = f16 / resident, f8 / resident, f4 / resident
    memory = size * full_bytes
    n_stage = int(staging * size)
    left = memory - (n_stage + 2) * b16  # + the padding and scratch rows
    tokens = left / (f16 * b16 + f8 * b8 + f4 * b4)
    n16 = n_stage + int(f16 * tokens)
    n8, n4 = split_int_stores(memory - (n16 + 2) * b16, f8, f4, b8, b4, page_size)
    return TierStorePlan(n16=n16, n8=n8, n4=n4)
