"""Token-slot allocator: a free list over integer slot ids of one KV pool.

Invariants:
- Slot 0 is never handed out; it is the padding slot that padded gathers read from.
- A slot is either free (in the free list) or owned by exactly one holder: a running request's
  private tail, or a radix-cache node. Double free is a bug; `debug_check()` finds it in tests.
"""
from __future__ import annotations

import torch

from sgl_kvxfer.mem_cache.free_list import LazyFreeList


class TokenSlotAllocator:
    page_size = 1

    def __init__(self, size: int, device: str = "cpu"):
        self.size = size  # usable slots: ids 1..size
        self.device = device
        self._slots = LazyFreeList(1, size, device)  # slot 0 (padding) is never in it
        self.clear()  # subclasses (TieredSlotAllocator) build their own lists here

    def clear(self) -> None:
        self._slots.reset()

    def available_size(self) -> int:
        return self._slots.available()

    def alloc(self, n: int) -> torch.Tensor | None:
        """Return `n` slot ids (int64 [n]) or None when fewer than `n` are free."""
        return self._slots.take(n)

    def free(self, slots: torch.Tensor) -> None:
        self._slots.give(slots)

    def reclaimable(self, slots: torch.Tensor) -> int:
        """How many of `slots`, once freed, count toward a later `alloc` (eviction targets)."""
        return int(slots.numel())

    def debug_check(self) -> None:
        self._slots.check("slot")
