"""Tier ids shared by the SpectrumKV policy layer, the tiered pool and the codec.

    TIER_FP16 = 0   model dtype, no quantization        c = 1
    TIER_INT8 = 1   8-bit groups (+ scale, zero)        c = 1/2
    TIER_INT4 = 2   4-bit groups (+ scale, zero)        c = 1/4
    TIER_DROP = 3   masked out of attention             c = 0

Ids grow as precision falls, so "more important never gets a lower precision" reads as
"more important never gets a larger tier id". TIER_DROP means the token's KV is *masked out of
attention* by the consumer (never zeroed: a zero key still takes softmax mass).
The first three ids come from the codec when it is installed so there is one source of truth.
"""
from __future__ import annotations

try:
    from sgl_kvxfer.kernels.tier_codec import TIER_FP16, TIER_INT4, TIER_INT8
except ImportError:  # codec not built yet; same values by contract
    TIER_FP16, TIER_INT8, TIER_INT4 = 0, 1, 2

TIER_DROP = 3
NUM_TIERS = 4

assert (TIER_FP16, TIER_INT8, TIER_INT4) == (0, 1, 2), "tier ids are indices into the tables below"

TIER_NAMES = ("fp16", "int8", "int4", "drop")
# Bits per element of a transferred token (drop sends nothing).
TIER_BITS = (16, 8, 4, 0)
# Eq. 2 cost in integer quarter units, so budget arithmetic is exact: c = QUARTERS / 4.
TIER_QUARTERS = (4, 2, 1, 0)
