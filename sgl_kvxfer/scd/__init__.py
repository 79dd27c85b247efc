"""Semantic Cache Distillation (SCD): a base model prefills, fine-tuned specialists decode from
its low-rank codes. See sgl_kvxfer/scd/README.md.

    artifacts   ScdManifest, ScdArtifacts (load/save/check_pair), make_random_artifacts
    codec       ScdEncoder (producer), ScdDecoder (one consumer), regenerate_kv, kv_projections
    (mem_cache/scd_quant.py: int8 / int4 codes on the wire, per-token-per-field scale, packing)
    rank_policy the adaptive nested-rank choice of a producer
    calib/      offline: python -m sgl_kvxfer.scd.calib (paired prefills -> artifacts); the
                serving runtime never imports it
"""
from sgl_kvxfer.scd.artifacts import ScdArtifacts, ScdManifest, ScdPairError, make_random_artifacts
from sgl_kvxfer.scd.codec import KVProjection, ScdDecoder, ScdEncoder, kv_projections, regenerate_kv
from sgl_kvxfer.scd.identity import ModelIdentity, identify
from sgl_kvxfer.scd.rotary import KeyRotary

__all__ = ["ScdArtifacts", "ScdManifest", "ScdPairError", "make_random_artifacts", "ScdEncoder", "ScdDecoder",
           "KVProjection", "kv_projections", "regenerate_kv", "ModelIdentity", "identify", "KeyRotary"]
