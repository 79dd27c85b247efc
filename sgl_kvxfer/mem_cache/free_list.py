"""LazyFreeList: the free ids of one allocator (slots or pages), as a device tensor.

Frees are queued and merged into the free tensor only when an allocation needs them (or a debug
check runs), so freeing costs no concatenation on the hot path.

Invariants: ids in [first, last] only; an id is either in the list (free, possibly still queued)
or owned by exactly one holder. Double free is a bug that `check()` finds (tests call it).
"""
from __future__ import annotations

import torch


class LazyFreeList:
    def __init__(self, first: int, last: int, device: str):
        self.first, self.last, self.device = first, last, device
        self.reset()

    def reset(self) -> None:
        self._free = torch.arange(self.first, self.last + 1, dtype=torch.int64, device=self.device)
        self._queued: list[torch.Tensor] = []
        self._queued_count = 0  # == sum of the queued tensors' sizes (available() is hot)

    def available(self) -> int:
        return int(self._free.numel()) + self._queued_count

    def take(self, n: int) -> torch.Tensor | None:
        """`n` ids (int64 [n]) or None, changing nothing, when fewer are free."""
        if n > int(self._free.numel()) and self._queued:
            self._merge()
        if n > int(self._free.numel()):
            return None
        out, self._free = self._free[:n], self._free[n:]
        return out

    def give(self, ids: torch.Tensor) -> None:
        n = int(ids.numel())
        if n:
            self._queued.append(ids.to(self.device, torch.int64))
            self._queued_count += n

    def check(self, what: str) -> None:
        """Assert no id is free twice and none lies outside [first, last] (`what` names them)."""
        self._merge()
        assert int(self._free.unique().numel()) == int(self._free.numel()), f"double free of a {what}"
        if self._free.numel():
            assert int(self._free.min()) >= self.first, f"reserved {what} {int(self._free.min())} was freed"
            assert int(self._free.max()) <= self.last, f"{what} {int(self._free.max())} out of range"

    def _merge(self) -> None:
        self._free = torch.cat([self._free] + self._queued)
        self._queued, self._queued_count = [], 0
