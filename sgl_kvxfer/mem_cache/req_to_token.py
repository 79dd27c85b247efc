"""Request-to-token table: row r, column p holds the KV slot of request r's token at position p.

Rows are handed out per running request and returned when it finishes or is retracted.
Only columns [0, kv_committed_len) of a row are meaningful; the rest is stale.
"""
from __future__ import annotations

import torch


class ReqToTokenPool:
    def __init__(self, max_reqs: int, max_context_len: int, device: str = "cpu"):
        self.max_reqs = max_reqs
        self.max_context_len = max_context_len
        self.table = torch.zeros((max_reqs, max_context_len), dtype=torch.int64, device=device)
        self._free_rows = list(range(max_reqs))

    def available_size(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> int | None:
        return self._free_rows.pop() if self._free_rows else None

    def free(self, row: int) -> None:
        self._free_rows.append(row)

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        self.table[row, start : start + slots.numel()] = slots

    def read(self, row: int, end: int, start: int = 0) -> torch.Tensor:
        return self.table[row, start:end]
