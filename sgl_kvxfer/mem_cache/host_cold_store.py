"""HostColdStore: fp16 copies, in host memory, of the tokens a TieredKVPool holds at int4 or dropped.

The cold tier (scheduler/cold_tier.py) brings an int4 token back to full precision when decode
attends to it; the exact values it needs live here, captured when the token was demoted:

    row_of[s - base(INT4)] = host row of int4 id s, or -1 (no copy: demoted before the cold tier,
                             relocated from another store, or the store was full)
    k_host[layer], v_host[layer]: [capacity, Hkv, D] model dtype, pinned on CUDA
    ref[row]                 holders of a row: int4 ids sharing it (a relocated id keeps its copy)

Hooks (TieredKVPool.move, TieredSlotAllocator.free call them; the scheduler thread only):
    begin_move / capture / end_move   fp16 -> int4 demotions: rows reserved, values copied per
                                      layer (device -> host, non_blocking), one event at the end;
                                      int4 -> int4 relocations share the source's row
    release(int4 ids)                 the ids are free: their rows lose a holder
Dropped tokens (TIER_DROP: slot 0 in the row, no id) are copied by the cold tier itself, just
before their fp16 ids are freed: keep_dropped(fp16 ids) -> rows, owned by the request the cold
tier keeps them for, given back with free_rows when that request releases its row.
NOTE: a copy is readable on the host only once `ready()` (its device -> host event completed);
the cold tier defers a promotion until then instead of waiting.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from sgl_kvxfer.mem_cache.free_list import LazyFreeList
from sgl_kvxfer.spectrum.tiers import TIER_FP16, TIER_INT4


@dataclass
class _Capture:
    sel: torch.Tensor | None   # positions, in the move's requantized order, of the captured tokens
    rows: torch.Tensor         # host rows (CPU int64), one per captured token
    runs: list                 # (start in rows, row0, count): contiguous host row runs


class HostColdStore:
    def __init__(self, capacity: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 int4_base: int, int4_slots: int, device: str):
        self.device = device
        self.pinned = str(device).startswith("cuda")
        row = num_kv_heads * head_dim * torch.finfo(dtype).bits // 8
        if self.pinned:  # torch's pinned allocator rounds each buffer up to a power of two: use it all
            capacity = (1 << max(0, (capacity * row - 1).bit_length())) // row
        self.capacity = capacity
        shape = (capacity, num_kv_heads, head_dim)
        # never read before written (a row is handed out with its copy)
        self.k_host = [torch.empty(shape, dtype=dtype, pin_memory=self.pinned) for _ in range(num_layers)]
        self.v_host = [torch.empty(shape, dtype=dtype, pin_memory=self.pinned) for _ in range(num_layers)]
        self.ref = torch.zeros(capacity, dtype=torch.int32)
        self._rows = LazyFreeList(0, capacity - 1, "cpu")
        self._event = None
        self.stats = {"host_copies": 0, "host_bytes_d2h": 0, "host_full_skips": 0, "dropped_copies": 0,
                      "dropped_bytes_d2h": 0}
        # the int4 store is allocated once with the pool: its ids never change meaning
        self.base = int4_base
        self.row_of = torch.full((int4_slots,), -1, dtype=torch.int64)

    @property
    def rows_in_use(self) -> int:
        return self.capacity - self._rows.available()

    def rows_for(self, slots: torch.Tensor) -> torch.Tensor:
        """Host rows of int4 ids (CPU int64, -1 = no copy)."""
        return self.row_of[slots.cpu() - self.base]

    def ready(self) -> bool:
        """Every copy made so far is readable on the host (no wait)."""
        return self._event is None or self._event.query()

    # ------------------------------------------------------------------ pool hooks
    def begin_move(self, src, dst, ts, td, requant) -> _Capture | None:
        """Plan a TieredKVPool.move: share rows of int4 -> int4 moves, reserve rows for fp16 -> int4
        demotions (those land in the requantized part `requant`, in its order)."""
        share = (ts == TIER_INT4) & (td == TIER_INT4)
        if bool(share.any()):
            rows = self.row_of[src[share] - self.base]
            self.row_of[dst[share] - self.base] = rows
            held = rows[rows >= 0]
            self.ref.index_add_(0, held, torch.ones_like(held, dtype=torch.int32))
        demote = requant & (ts == TIER_FP16) & (td == TIER_INT4)
        n = int(demote.sum())
        if not n:
            return None
        rows = self._rows.take(n)
        if rows is None:  # the host store is full: the first rows it has, the rest go uncopied
            got = self._rows.available()
            self.stats["host_full_skips"] += n - got
            rows = self._rows.take(got) if got else torch.empty(0, dtype=torch.int64)
        keep = demote.nonzero().squeeze(1)[: rows.numel()]
        if not keep.numel():
            return None
        self.row_of[dst[keep] - self.base] = rows
        self.ref[rows] = 1
        # positions of the kept tokens in the requantized order (cumsum of `requant` before them)
        order = torch.cumsum(requant.to(torch.int64), 0) - 1
        sel = order[keep]
        return _Capture(sel.to(self.device), rows, _runs(rows))

    def capture(self, cap: _Capture, layer_id: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Copy the captured tokens' k, v [m, Hkv, D] of one layer into their host rows."""
        kk, vv = k.index_select(0, cap.sel), v.index_select(0, cap.sel)
        self._write_rows(layer_id, kk, vv, cap.runs)

    def end_move(self, cap: _Capture) -> None:
        n = cap.rows.numel()
        self._copied(n, "host_copies", "host_bytes_d2h")

    def release(self, slots: torch.Tensor) -> None:
        """int4 ids `slots` were freed: drop their rows' holders, free rows nobody holds."""
        idx = slots.cpu() - self.base
        rows = self.row_of[idx]
        self.row_of[idx] = -1
        rows = rows[rows >= 0]
        if rows.numel():
            self.ref.index_add_(0, rows, torch.full_like(rows, -1, dtype=torch.int32))
            gone = rows.unique()
            self._rows.give(gone[self.ref[gone] == 0])

    def _write_rows(self, layer: int, kk: torch.Tensor, vv: torch.Tensor, runs) -> None:
        """Copy rows of `kk` / `vv` into layer `layer`'s host rows, run by run ((at, row0, count))."""
        for at, row0, count in runs:
            self.k_host[layer][row0:row0 + count].copy_(kk[at:at + count], non_blocking=self.pinned)
            self.v_host[layer][row0:row0 + count].copy_(vv[at:at + count], non_blocking=self.pinned)

    def _copied(self, n: int, count_key: str, bytes_key: str) -> None:
        """Count `n` tokens' copies (K and V of every stored layer); on CUDA, record the event
        the copies' readers wait for."""
        self.stats[count_key] += n
        self.stats[bytes_key] += 2 * len(self.k_host) * n * self.k_host[0][0].numel() * self.k_host[0].element_size()
        if self.pinned:
            self._event = torch.cuda.Event()
            self._event.record()

    # ------------------------------------------------------------------ dropped tokens
    def keep_dropped(self, k16: list[torch.Tensor], v16: list[torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
        """Copy fp16 ids `ids` (about to be dropped: the caller frees them after this call, on the
        same stream) of every layer into fresh host rows; -> the rows (CPU int64, one per id, -1
        where the store was full). The rows belong to the caller until `free_rows`: a dropped
        token has no id, so nothing else holds them."""
        n = ids.numel()
        out = torch.full((n,), -1, dtype=torch.int64)
        got = min(n, self._rows.available())
        self.stats["host_full_skips"] += n - got
        if not got:
            return out
        rows = self._rows.take(got)
        self.ref[rows] = 1
        out[:got] = rows
        src = ids.reshape(-1)[:got].to(k16[0].device)
        runs = _runs(rows)
        for layer in range(len(k16)):  # the pool's stored layers (as `capture` sees them)
            kk, vv = k16[layer].index_select(0, src), v16[layer].index_select(0, src)
            self._write_rows(layer, kk, vv, runs)
        self._copied(got, "dropped_copies", "dropped_bytes_d2h")
        return out

    def free_rows(self, rows: torch.Tensor) -> None:
        """Give back rows `keep_dropped` handed out (-1 entries skipped)."""
        rows = rows[rows >= 0]
        if rows.numel():
            self.ref[rows] = 0
            self._rows.give(rows)

    # ------------------------------------------------------------------ promotion reads
    def gather(self, rows: torch.Tensor, out_k: list[torch.Tensor], out_v: list[torch.Tensor]) -> None:
        """Host rows -> out_k[layer], out_v[layer] [m, Hkv, D] (host tensors, pinned on CUDA)."""
        for layer, (k, v) in enumerate(zip(self.k_host, self.v_host)):
            torch.index_select(k, 0, rows, out=out_k[layer])
            torch.index_select(v, 0, rows, out=out_v[layer])


def _runs(rows: torch.Tensor) -> list[tuple[int, int, int]]:
    """Split host rows into runs of consecutive ids: (index of the run's first, first row, count)."""
    r = rows.tolist()
    out, start = [], 0
    for i in range(1, len(r) + 1):
        if i == len(r) or r[i] != r[i - 1] + 1:
            out.append((start, r[start], i - start))
            start = i
    return out
