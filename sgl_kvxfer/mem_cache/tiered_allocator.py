"""TieredSlotAllocator: the slot ids of a TieredKVPool, one free list per tier store.

    alloc(n), available_size()        fp16 store only: every new token is computed into fp16
    alloc_tier(t, n), available_tier  int8 / int4 store ids (alloc_tier may return fewer than n)
    free(slots)                       routed to the owning store by id range; slot 0 is skipped
    retier(slots, tiers, make_room)   move tokens into their tier's store, free their old ids

Invariants: per store, as TokenSlotAllocator (an id is free or owned by exactly one holder).
Slot 0 stands for a dropped token in request rows and radix nodes; it is never freed into a list.
Only the scheduler thread calls these methods.
"""
from __future__ import annotations

from typing import Callable

import torch

from sgl_kvxfer.mem_cache.allocator import TokenSlotAllocator
from sgl_kvxfer.mem_cache.tiered_pool import INT_TIERS, TieredKVPool
from sgl_kvxfer.spectrum.tiers import TIER_DROP, TIER_FP16, TIER_INT4, TIER_INT8


class TieredSlotAllocator(TokenSlotAllocator):
    def __init__(self, pool: TieredKVPool, device: str = "cpu"):
        self.pool = pool
        super().__init__(pool.num_slots(TIER_FP16), device)
        pool.bind_occupancy(self.used_counts)

    def clear(self) -> None:
        super().clear()
        self._stores = {t: TokenSlotAllocator(self.pool.num_slots(t), self.device) for t in INT_TIERS}

    # ------------------------------------------------------------------ per store
    def available_tier(self, tier: int) -> int:
        return self.available_size() if tier == TIER_FP16 else self._stores[tier].available_size()

    def alloc_tier(self, tier: int, n: int) -> torch.Tensor:
        """Up to n global ids of an int store (fewer when it is short)."""
        store = self._stores[tier]
        k = min(n, store.available_size())
        if k == 0:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        # store ids 1..n_t  ->  global ids base(t) .. base(t) + n_t - 1
        return store.alloc(k) - 1 + self.pool.base(tier)

    def free(self, slots: torch.Tensor) -> None:
        slots = slots.reshape(-1).to(self.device, torch.int64)
        slots = slots[slots != 0]
        if not slots.numel():
            return
        if bool((slots < self.pool.base(TIER_INT8)).all()):
            super().free(slots)
            return
        tiers = self.pool.tier_of(slots)
        super().free(slots[tiers == TIER_FP16])
        for t in INT_TIERS:
            self._stores[t].free(slots[tiers == t] - self.pool.base(t) + 1)

    def reclaimable(self, slots: torch.Tensor) -> int:
        """Only fp16 ids count toward `alloc`."""
        return int(((slots > 0) & (slots < self.pool.base(TIER_INT8))).sum())

    def count_tier(self, slots: torch.Tensor, tier: int) -> int:
        return int((self.pool.tier_of(slots) == tier).sum())

    def tier_of(self, slots: torch.Tensor) -> torch.Tensor:
        return self.pool.tier_of(slots).cpu()

    def used_counts(self) -> dict[int, int]:
        return {t: self.pool.num_slots(t) - self.available_tier(t) for t in (TIER_FP16, TIER_INT8, TIER_INT4)}

    def repartition(self, n8: int, n4: int) -> None:
        """Resize the int stores; legal only while no int id is handed out (after a flush)."""
        for t, store in self._stores.items():
            assert store.available_size() == store.size, f"tier {t} store still holds tokens"
        self.pool.resize_int_stores(n8, n4)
        self._stores = {t: TokenSlotAllocator(self.pool.num_slots(t), self.device) for t in INT_TIERS}

    def debug_check(self) -> None:
        super().debug_check()
        for store in self._stores.values():
            store.debug_check()

    # ------------------------------------------------------------------ re-tiering
    def retier(self, slots: torch.Tensor, tiers: torch.Tensor,
               make_room: Callable[[int, int], None] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Move tokens `slots` [m] to the tiers `tiers` [m] asks for; returns (new ids, tiers got).

        - A token never gains precision: one held at int8 and asked for fp16 stays int8.
        - TIER_DROP frees the token's id and leaves slot 0 in its place.
        - A short store first calls make_room(tier, missing) (the caller may evict cache leaves);
          what still does not fit falls back one tier up: int4 -> int8 -> stays where it is.
        The old ids of moved and dropped tokens are freed; the caller rewrites its row.
        """
        cur = self.pool.tier_of(slots)
        target = torch.maximum(tiers.to(cur.device, torch.int8), cur)
        new = slots.clone()
        for tier in (TIER_INT4, TIER_INT8):  # int4 first: its overflow joins int8's demand
            idx = ((target == tier) & (cur != tier)).nonzero().squeeze(1)
            if not idx.numel():
                continue
            short = idx.numel() - self.available_tier(tier)
            if short > 0 and make_room is not None:
                make_room(tier, short)
            got = self.alloc_tier(tier, idx.numel())
            new[idx[: got.numel()]] = got
            target[idx[got.numel():]] = torch.maximum(cur[idx[got.numel():]],
                                                      torch.full_like(cur[idx[got.numel():]], tier - 1))
        drop = (target == TIER_DROP) & (cur != TIER_DROP)
        new[drop] = 0
        moved = (new != slots) & (new != 0)
        if bool(moved.any()):
            self.pool.move(slots[moved], new[moved])
        self.free(slots[moved | drop])
        return new, target
