"""Byte-range bookkeeping of the transfer buffers (plain Python over integers).

Decode side: `StagingAllocator` hands each claimed room a region of the registered staging
buffer and takes it back when the room ends (success, failure or timeout, always exactly once).

Prefill side: `RingWriter` places a room's segments in the region the decode gave it:

    region: [ acked (free) | seg 3 | seg 4 (in flight) | free .......... ]
             0                                                 region_bytes
    a segment goes right after the newest one, or wraps to 0; it never overlaps a segment the
    decode has not acked yet (its bytes may not be unpacked yet). None: wait for an ack.
"""
from __future__ import annotations

ALIGN = 4096  # regions and segments start on page boundaries (DMA-friendly, and int views align)


def align_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


class StagingAllocator:
    """First-fit allocation of aligned byte ranges in [0, total)."""

    def __init__(self, total: int):
        self.total = total - total % ALIGN
        self._free: list[tuple[int, int]] = [(0, self.total)] if self.total else []  # sorted (start, size)
        self._used: dict[int, int] = {}  # start -> size

    def alloc(self, nbytes: int) -> int | None:
        size = align_up(max(nbytes, 1))
        for i, (start, free) in enumerate(self._free):
            if free >= size:
                if free == size:
                    self._free.pop(i)
                else:
                    self._free[i] = (start + size, free - size)
                self._used[start] = size
                return start
        return None

    def free(self, start: int) -> None:
        size = self._used.pop(start)  # KeyError: a double free is a bug, not a no-op
        self._free.append((start, size))
        self._free.sort()
        merged: list[tuple[int, int]] = []
        for s, n in self._free:
            if merged and merged[-1][0] + merged[-1][1] == s:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            else:
                merged.append((s, n))
        self._free = merged

    def used_bytes(self) -> int:
        return sum(self._used.values())

    def largest_free(self) -> int:
        return max((n for _, n in self._free), default=0)


class RingWriter:
    """Placement of one room's segments in its region, freed by the decode's acks (by seq)."""

    def __init__(self, region_bytes: int):
        self.region_bytes = region_bytes - region_bytes % ALIGN
        self._live: dict[int, tuple[int, int]] = {}  # seq -> (offset, aligned size), not acked
        self._head = 0  # where the next segment would start

    def fits_ever(self, nbytes: int) -> bool:
        return align_up(nbytes) <= self.region_bytes

    def place(self, seq: int, nbytes: int) -> int | None:
        size = align_up(max(nbytes, 1))
        if size > self.region_bytes:
            raise ValueError(f"segment of {nbytes} bytes exceeds the {self.region_bytes}-byte region")
        for start in (self._head, 0) if self._head + size <= self.region_bytes else (0,):
            if all(start + size <= off or off + n <= start for off, n in self._live.values()):
                self._live[seq] = (start, size)
                self._head = start + size
                return start
        return None

    def ack(self, seq: int) -> None:
        self._live.pop(seq, None)

    @property
    def in_flight(self) -> int:
        return len(self._live)
