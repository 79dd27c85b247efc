"""Token-slot allocator: a free list over integer slot ids of one KV pool.

Invariants:
- Slot 0 is never handed out; it is the padding slot that padded gathers read from.
- A slot is either free (in the free list) or owned by exactly one holder: a running request's
  private tail, or a radix-cache node. Double free is a bug; `debug_check()` finds it in tests.
"""
from __future__ import annotations

import torch


class TokenSlotAllocator:
    page_size = 1

    def __init__(self, size: int, device: str = "cpu"):
        self.size = size  # usable slots: ids 1..size
        self.device = device
        self.clear()

    def clear(self) -> None:
        self._free = torch.arange(1, self.size + 1, dtype=torch.int64, device=self.device)
        self._pending_free: list[torch.Tensor] = []

    def available_size(self) -> int:
        return int(self._free.numel()) + sum(int(t.numel()) for t in self._pending_free)

    def alloc(self, n: int) -> torch.Tensor | None:
        """Return `n` slot ids (int64 [n]) or None when fewer than `n` are free."""
        if n > int(self._free.numel()) and self._pending_free:
            self._merge()
        if n > int(self._free.numel()):
            return None
        out, self._free = self._free[:n], self._free[n:]
        return out

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel():
            self._pending_free.append(slots.to(self.device, torch.int64))

    def reclaimable(self, slots: torch.Tensor) -> int:
        """How many of `slots`, once freed, count toward a later `alloc` (eviction targets)."""
        return int(slots.numel())

    def _merge(self) -> None:
        self._free = torch.cat([self._free] + self._pending_free)
        self._pending_free = []

    def debug_check(self) -> None:
        self._merge()
        assert int(self._free.unique().numel()) == int(self._free.numel()), "double free"
        assert not bool((self._free == 0).any()), "padding slot 0 was freed"
