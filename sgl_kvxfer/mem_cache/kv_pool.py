"""Base class of the KV pool family: token slot -> per-layer K and V storage.

Every pool maps the same slot id to the same token in every layer that stores KV. Families:
`Fp16KVPool` (model dtype, this issue), tiered pools (SpectrumKV: per-slot precision) and
layer-mapped pools (FusedKV: some layers store nothing) are sibling files, each a subclass.

Mutation: `set_kv` / `write_external` write slots; only the scheduler thread calls them, and
only for slots it owns (allocated and not yet freed). Reads never mutate.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class KVPool(ABC):
    # True when request rows may hold the padding slot 0 for a token that is masked out of
    # attention (SpectrumKV TIER_DROP); backends then mask keys whose slot is 0.
    drops_tokens = False
    # Storage layout; attention backends may have one variant per layout (layers/attention):
    # "token" ([size + page_size, Hkv, D] per layer, slot-indexed), "paged" (head-major pages),
    # "tiered" (SpectrumKV).
    layout = "token"
    # True when get_kv returns exactly what set_kv stored (no quantization): a backend may then
    # attend a prefill's fresh k/v directly instead of reading them back from the pool.
    stores_exact = False

    def __init__(self, size: int, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: str):
        self.size = size  # usable slots (ids 1..size when slot-granular; paged ids: id_end); slot 0 is padding
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = device

    @property
    def id_end(self) -> int:
        """One past the largest slot id this pool stores: the row count a side table indexed by
        slot (an SCD producer's patch codes) needs. Slot-granular: 1 .. size. Families whose
        allocator hands out ids past `size` (pages, tier stores) override it."""
        return self.size + 1

    @abstractmethod
    def set_kv(self, layer_id: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [n, Hkv, D] (model dtype, K already rotated) at `slots` [n]."""

    @abstractmethod
    def get_kv(self, layer_id: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather K, V at `slots` (any shape S) as [*S, Hkv, D] in the model dtype."""

    def get_kv_no_sync(self, layer_id: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """get_kv without a host sync, so a captured CUDA graph may call it (FusedKV's torch
        reconstruction inside a decode graph). Slot- and page-indexed families gather: get_kv is it."""
        return self.get_kv(layer_id, slots)

    @abstractmethod
    def bytes_per_token(self, with_scales: bool = True) -> float:
        """Resident bytes one token costs across all layers (K and V)."""

    def stores_layer(self, layer_id: int) -> bool:
        """Per-layer storage map: False for layers whose KV is rebuilt, not stored (FusedKV)."""
        return True

    def write_external(self, slots: torch.Tensor, layers_kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Write KV computed elsewhere (PD transfer, SCD) for every storing layer, in order."""
        for layer_id, (k, v) in enumerate(layers_kv):
            if self.stores_layer(layer_id):
                self.set_kv(layer_id, slots, k, v)

    def write_layers(self, slots: torch.Tensor, layer_ids: tuple[int, ...], k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [len(layer_ids), n, Hkv, D] at `slots` [n] of the listed layers (the storing
        ones). Families whose layers share one allocation override it with one write."""
        for i, layer_id in enumerate(layer_ids):
            if self.stores_layer(layer_id):
                self.set_kv(layer_id, slots, k[i], v[i])

    def read_external(self, slots: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [self.get_kv(layer_id, slots) for layer_id in range(self.num_layers) if self.stores_layer(layer_id)]
