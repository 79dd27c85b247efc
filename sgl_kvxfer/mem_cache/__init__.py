"""KV memory stack (see README.md in this folder). Pool family registry with lazy imports."""
from __future__ import annotations

import importlib

KV_POOLS = {
    "fp16": "sgl_kvxfer.mem_cache.fp16_pool:Fp16KVPool",
}


def create_kv_pool(config, arch, size: int, dtype, device: str):
    """Pick the pool family for an EngineConfig; every family shares the KVPool interface."""
    name = "fp16"
    module, cls = KV_POOLS[name].split(":")
    pool_cls = getattr(importlib.import_module(module), cls)
    return pool_cls(size, arch.num_hidden_layers, arch.num_key_value_heads, arch.head_dim, dtype, device)
