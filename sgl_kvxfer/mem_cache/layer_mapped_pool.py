"""LayerMappedKVPool (FusedKV): KV storage for the bottom `num_stored` layers only.

A FusedKV model's top layers (reconstruction layers) store no KV: they rebuild K and V from the
caches of layer 0 and layer `num_stored - 1` (models/fusedkv_llama.py). This pool wraps a pool
of any family (fp16, paged fp16, tiered) built for `num_stored` layers and presents the model's
`num_layers` with a per-layer storage map:

    model layer:   0 ........ n-1 | n ............ L-1
    stores KV:     yes (inner 0..n-1) | no (stores_layer False; set_kv / get_kv raise)

Invariants:
- Stored layers are the bottom [0, n): a stored layer's id is its index in the inner pool, so
  family-specific per-layer members reached through this wrapper (k_buffer[i], stores[t][i],
  stored_codes(i, ...)) take the model's layer id unchanged.
- Slot ids, allocation and every byte of storage belong to the inner pool: allocators, radix
  cache, tiering and transfer work on it unchanged (they reach family members by delegation).
- bytes_per_token is the inner pool's, i.e. n / L of a pool over every layer at the same
  precision; `vanilla_bytes_per_token` is what an fp16 pool over all L layers would take.
"""
from __future__ import annotations

import torch

from sgl_kvxfer.mem_cache.kv_pool import KVPool


class LayerMappedKVPool(KVPool):
    def __init__(self, inner: KVPool, num_layers: int):
        if not 0 < inner.num_layers <= num_layers:
            raise ValueError(f"a layer-mapped pool stores 1 .. {num_layers} layers, got {inner.num_layers}")
        super().__init__(inner.size, num_layers, inner.num_kv_heads, inner.head_dim, inner.dtype, inner.device)
        self.inner = inner
        self.num_stored = inner.num_layers
        # the inner family's flags: backends pick their variant by them
        self.layout, self.drops_tokens, self.stores_exact = inner.layout, inner.drops_tokens, inner.stores_exact

    def __getattr__(self, name):
        # Only reached for names this object lacks: family members (k_buffer, page_size,
        # scratch_slot, tier stores, bind_occupancy, ...) are the inner pool's.
        if name == "inner":  # not yet set (copy / unpickle): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    @property
    def id_end(self) -> int:
        return self.inner.id_end

    def stores_layer(self, layer_id: int) -> bool:
        return 0 <= layer_id < self.num_stored

    def _check(self, layer_id: int) -> None:
        if not self.stores_layer(layer_id):
            raise IndexError(f"layer {layer_id} stores no KV (FusedKV reconstruction layer; stored: "
                             f"0..{self.num_stored - 1})")

    def set_kv(self, layer_id, slots, k, v):
        self._check(layer_id)
        self.inner.set_kv(layer_id, slots, k, v)

    def get_kv(self, layer_id, slots):
        self._check(layer_id)
        return self.inner.get_kv(layer_id, slots)

    def get_kv_no_sync(self, layer_id, slots):
        self._check(layer_id)
        return self.inner.get_kv_no_sync(layer_id, slots)

    def set_kv_fp16(self, layer_id, slots, k, v):
        self._check(layer_id)
        self.inner.set_kv_fp16(layer_id, slots, k, v)

    def bytes_per_token(self, with_scales: bool = True) -> float:
        return self.inner.bytes_per_token(with_scales)

    def vanilla_bytes_per_token(self) -> float:
        """Bytes per token of an fp16 (model dtype) pool over all `num_layers` layers."""
        elem = torch.finfo(self.dtype).bits // 8
        return float(2 * self.num_layers * self.num_kv_heads * self.head_dim * elem)

    def storage_map(self) -> list[bool]:
        return [self.stores_layer(i) for i in range(self.num_layers)]
