"""KV memory stack (see README.md in this folder). Pool family registry with lazy imports."""
from __future__ import annotations

import importlib

KV_POOLS = {
    "fp16": "sgl_kvxfer.mem_cache.fp16_pool:Fp16KVPool",
    "tiered": "sgl_kvxfer.mem_cache.tiered_pool:TieredKVPool",
    "paged_fp16": "sgl_kvxfer.mem_cache.paged_fp16_pool:PagedFp16KVPool",
    # FusedKV: wraps any family above, built for the stored (bottom) layers only
    "layer_mapped": "sgl_kvxfer.mem_cache.layer_mapped_pool:LayerMappedKVPool",
}


def _load(name: str):
    module, cls = KV_POOLS[name].split(":")
    return getattr(importlib.import_module(module), cls)


def create_kv_pool(config, arch, size: int, dtype, device: str, int4_allowed: bool | None = None,
                   stored_layers: int | None = None):
    """Pick the pool family for an EngineConfig; every family shares the KVPool interface.

    `size` is the fp16 token count the memory budget affords; the tiered family (SpectrumKV,
    kv_tier_budget < 1) divides that same memory into fp16 / int8 / int4 stores.
    `stored_layers` n < num_hidden_layers (FusedKV): the family is built for layers [0, n)
    only and wrapped in a LayerMappedKVPool that presents all layers (layer_mapped_pool.py).
    """
    if stored_layers is not None and stored_layers < arch.num_hidden_layers:
        import dataclasses

        inner = create_kv_pool(config, dataclasses.replace(arch, num_hidden_layers=stored_layers), size, dtype,
                               device, int4_allowed)
        pool = _load("layer_mapped")(inner, arch.num_hidden_layers)
        return pool
    dims = (arch.num_hidden_layers, arch.num_key_value_heads, arch.head_dim)
    if not config.tiering_enabled:
        page = config.resolved_page_size
        if page > 1 and config.resolved_attention_backend == "cpu":  # slot rows, paged allocation
            pool = _load("fp16")(size, *dims, dtype, device, page_size=page)  # size: whole pages
        elif page > 1:  # head-major pages the Triton kernels read
            pool = _load("paged_fp16")(size, *dims, dtype, device, page_size=page)
        else:
            pool = _load("fp16")(size, *dims, dtype, device)
        # the group of int payloads it sends / receives (PD, kv_payload.py): both sides must agree
        pool.group_size = config.resolved_group_size(arch.head_dim)
        return pool
    if int4_allowed is None:
        int4_allowed = config.kv_int4 != "off"  # no decision given (tests, benchmarks): int4 unless off
    pool_cls = _load("tiered")
    return pool_cls(size, *dims, dtype, device, plan=tier_store_plan(config, arch, size, dtype, int4_allowed),
                    group_size=config.resolved_group_size(arch.head_dim), page_size=config.kv_tier_page_size)


def tier_store_plan(config, arch, size: int, dtype, int4_allowed: bool):
    """Store sizes for the configured policy's planned tier mix (see tier_plan.py)."""
    import torch

    from sgl_kvxfer.kernels.tier_codec import payload_bytes
    from sgl_kvxfer.mem_cache.tier_plan import plan_tier_stores
    from sgl_kvxfer.spectrum.budget import KVLayout
    from sgl_kvxfer.spectrum.byte_budget import planned_fractions
    from sgl_kvxfer.spectrum.policies import create_tier_policy

    layers, heads, dim = arch.num_hidden_layers, arch.num_key_value_heads, arch.head_dim
    group = config.resolved_group_size(dim)
    layout = KVLayout(layers, heads, dim, group)
    fractions = planned_fractions(create_tier_policy(config.kv_tier_policy), config.kv_tier_budget, layout,
                                  config.kv_budget_unit, config.kv_sink_tokens, int4_allowed)
    elem = torch.finfo(dtype).bits // 8
    per_token = [2 * layers * heads * payload_bytes(t, dim, group, elem) for t in (0, 1, 2)]
    return plan_tier_stores(size, per_token[0], tuple(per_token), fractions, config.kv_tier_staging,
                            config.kv_tier_page_size)


def create_slot_allocator(config, pool, device: str):
    """The allocator matching create_kv_pool's family for the same config and pool."""
    if config.tiering_enabled:
        from sgl_kvxfer.mem_cache.tiered_allocator import TieredSlotAllocator

        return TieredSlotAllocator(pool, device)
    if config.resolved_page_size > 1:  # slots in aligned pages (paged_allocator.py)
        from sgl_kvxfer.mem_cache.paged_allocator import PagedTokenSlotAllocator

        return PagedTokenSlotAllocator(pool.size, config.resolved_page_size, device)
    from sgl_kvxfer.mem_cache.allocator import TokenSlotAllocator

    return TokenSlotAllocator(pool.size, device)
