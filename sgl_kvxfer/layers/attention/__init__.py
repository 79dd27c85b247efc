"""Attention backend registry: name -> lazily imported class. Names feed --attention-backend."""
from __future__ import annotations

import importlib

ATTENTION_BACKENDS = {
    "torch": "sgl_kvxfer.layers.attention.torch_backend:TorchAttentionBackend",
    "triton": "sgl_kvxfer.layers.attention.triton_backend:TritonAttentionBackend",
    "cpu": "sgl_kvxfer.layers.attention.cpu_backend:CpuAttentionBackend",
    # CUDA + the paged fp16 pool + the flashinfer package (not a dependency: scripts/gpu/README.md)
    "flashinfer": "sgl_kvxfer.layers.attention.flashinfer_backend:FlashInferAttentionBackend",
}
# (name, KVPool.layout) -> the variant of a backend that reads that pool layout natively.
LAYOUT_VARIANTS = {
    ("triton", "tiered"): "sgl_kvxfer.layers.attention.triton_tiered_backend:TritonTieredAttentionBackend",
}


def create_attention_backend(name: str, **kwargs):
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose from {sorted(ATTENTION_BACKENDS)}")
    pool = kwargs.get("kv_pool")
    from sgl_kvxfer.mem_cache.layer_mapped_pool import LayerMappedKVPool

    if isinstance(pool, LayerMappedKVPool):  # FusedKV: the named backend serves the stored layers
        from sgl_kvxfer.layers.attention.fusedkv_backend import FusedKVAttentionBackend

        inner = create_attention_backend(name, **{**kwargs, "kv_pool": pool.inner})
        return FusedKVAttentionBackend(inner, **kwargs)
    layout = getattr(pool, "layout", None)
    module, cls = LAYOUT_VARIANTS.get((name, layout), ATTENTION_BACKENDS[name]).split(":")
    return getattr(importlib.import_module(module), cls)(**kwargs)
