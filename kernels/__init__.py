"""Triton kernels + torch references for the tiered (fp16/int8/int4) paged KV cache.

Installed as `sgl_kvxfer.kernels`. Only the torch codec is imported eagerly; the Triton
modules (`store`, `decode_attention`, `extend_attention`, `pack`) import triton, so import
them explicitly (and set TRITON_INTERPRET=1 first when running on CPU).
"""
from .tier_codec import (  # noqa: F401
    DEFAULT_GROUP_SIZE,
    TIER_BITS,
    TIER_FP16,
    TIER_INT4,
    TIER_INT8,
    TIERS,
    budget_cost,
    dequantize,
    greedy_tier_fractions,
    payload_bytes,
    quantize,
)
