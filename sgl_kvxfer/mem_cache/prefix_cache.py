"""Base class of prefix caches: token ids -> KV slots already computed.

Ownership contract (the scheduler relies on it):
- `match_prefix(key)` returns slots owned by the cache; the caller pins them with
  `inc_lock_ref(node)` before use and unpins with `dec_lock_ref(node)` when done.
- `insert(key, slots)` transfers ownership of `slots[n:]` to the cache, where n is the return
  value (tokens of `key` already present). The caller still owns `slots[:n]` it allocated
  itself (duplicates of cached tokens) and must free those not obtained from `match_prefix`.
- `evict(num_tokens)` frees only unlocked leaves, least recently used first.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch


class PrefixCache(ABC):
    @abstractmethod
    def match_prefix(self, key: list[int]) -> tuple[torch.Tensor, Any]:
        """Longest cached prefix of `key`: (slots int64 [m], last node)."""

    @abstractmethod
    def insert(self, key: list[int], slots: torch.Tensor, tiers: torch.Tensor | None = None) -> int:
        """Insert key -> slots (+ per-token tiers); returns the number of leading tokens already cached."""

    @abstractmethod
    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` slots if possible; returns how many were freed."""

    @abstractmethod
    def inc_lock_ref(self, node: Any) -> None: ...

    @abstractmethod
    def dec_lock_ref(self, node: Any) -> None: ...

    @abstractmethod
    def evictable_size(self) -> int: ...

    @abstractmethod
    def protected_size(self) -> int: ...

    @abstractmethod
    def reset(self) -> None:
        """Drop every entry, freeing its slots. Only legal when nothing is locked."""
