"""SpectrumKV policy layer: token importance -> per-token precision tier under a byte budget.

Plain Python over small CPU tensors; no engine imports. See README.md in this package.
"""
from sgl_kvxfer.spectrum.tiers import TIER_DROP, TIER_FP16, TIER_INT4, TIER_INT8

__all__ = ["TIER_FP16", "TIER_INT8", "TIER_INT4", "TIER_DROP"]
