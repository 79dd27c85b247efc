"""TieredSlotAllocator: the slot ids of a TieredKVPool: fp16 slots, int8 / int4 pages.

    alloc(n), available_size()        fp16 store only: every new token is computed into fp16
    alloc_tier(t, n), available_tier  int8 / int4 ids on FRESH pages (alloc_tier may return fewer
                                      than n; available_tier counts whole free pages, in tokens)
    free(slots)                       routed to the owning store by id range; slot 0 is skipped;
                                      an int page returns to its free list when its last id goes
    retier(slots, tiers, make_room)   move fp16 tokens into their tier's store, free their old ids
    retier_runs(runs, make_room)      the same for several runs (each on its own pages), one data move
    repack(slots, make_room)          relocate int tokens whose page a holder sees with a hole

Int pages (PAGE = pool.page_size). `alloc_tier(t, n)` fills cdiv(n, PAGE) fresh pages densely, in
the order of the ids it returns (the last page's tail stays unused until the page is freed):

    ids:   base + p0*PAGE + 0 .. PAGE-1 | base + p1*PAGE + 0 .. | ... | pk*PAGE + 0 .. r-1 (tail unused)
    live[p] = ids handed out on page p and not freed yet; page p is free iff live[p] == 0

Prefix-fill invariant (what kernels/paged_layout.py's filled tables rely on): every holder of
int ids (a request row, a radix path) holds, of each int page it touches, the slots [0, fill).
It holds because (1) callers request each tier's tokens of a run in POSITION ORDER in one
alloc_tier call (retier, PD's _alloc_positions), (2) radix sharing hands out a prefix of a run's
positions and eviction / retraction free suffixes, (3) only fp16 tokens are re-tiered (moving an
int token would punch a hole), and (4) where a holder keeps a suffix of someone's run (duplicates
freed in KVLifecycle.cache, PD replace segments) the caller runs `repack` on what it keeps.

Invariants: an fp16 id is free or owned by exactly one holder; an int id likewise (its page is
free only when all its handed-out ids are). Slot 0 stands for a dropped token in rows and radix
nodes; it is never freed into a list. Only the scheduler thread calls these methods.
"""
from __future__ import annotations

import logging
from typing import Callable

import torch

from sgl_kvxfer.mem_cache.allocator import TokenSlotAllocator
from sgl_kvxfer.mem_cache.free_list import LazyFreeList
from sgl_kvxfer.mem_cache.tiered_pool import INT_TIERS, TieredKVPool
from sgl_kvxfer.spectrum.tiers import TIER_DROP, TIER_FP16, TIER_INT4, TIER_INT8
from sgl_kvxfer.utils.host_copy import to_device

logger = logging.getLogger(__name__)


class _IntPageList:
    """Free pages, live counts and handed-out ends of one int store; ids are store-relative
    (page * PAGE + offset), all bookkeeping on the host. end[p]: offsets [0, end[p]) of page p have
    been handed out (an id is never handed out twice before its page is free again)."""

    def __init__(self, num_pages: int, page_size: int):
        self.page_size = page_size
        self.num_pages = num_pages
        self.live = torch.zeros(num_pages, dtype=torch.int64)
        self.end = torch.zeros(num_pages, dtype=torch.int64)
        self._pages = LazyFreeList(0, num_pages - 1, "cpu")

    def available(self) -> int:
        return self._pages.available() * self.page_size

    def appendable(self, page) -> int:
        """Slots a holder of all of page's handed-out ids may still append to it (0 for None, a
        free page, or one whose ids were partly freed: appending then could leave a hole)."""
        if page is None or self.live[page] == 0 or self.live[page] != self.end[page]:
            return 0
        return self.page_size - int(self.end[page])

    def used(self) -> int:
        return int(self.live.sum())

    def take(self, n: int, append_to=None) -> torch.Tensor:
        """Up to n ids (CPU int64), filled in order: first the free tail of page `append_to`
        (appendable() of it), then fresh pages."""
        P = self.page_size
        head = torch.empty(0, dtype=torch.int64)
        k = min(n, self.appendable(append_to))
        if k:
            e = int(self.end[append_to])
            head = append_to * P + torch.arange(e, e + k)
            self.live[append_to] += k
            self.end[append_to] += k
            n -= k
        n = min(n, self.available())
        if n == 0:
            return head
        npg = -(-n // P)
        pages = self._pages.take(npg)
        self.live[pages] = P
        self.live[pages[-1]] = n - (npg - 1) * P
        self.end[pages] = self.live[pages]
        return torch.cat([head, (pages[:, None] * P + torch.arange(P)).reshape(-1)[:n]])

    def give(self, ids: torch.Tensor) -> None:
        pages = ids // self.page_size
        self.live.index_add_(0, pages, torch.full_like(pages, -1))
        touched = pages.unique()
        empty = touched[self.live[touched] == 0]
        self.end[empty] = 0
        self._pages.give(empty)

    def check(self, what: str) -> None:
        self._pages.check(what)
        assert not bool((self.live < 0).any()), f"{what}: negative live count (double free)"
        assert not bool((self.live > self.end).any()), f"{what}: more live ids than handed out"
        free = torch.zeros(self.num_pages, dtype=torch.bool)
        self._pages._merge()
        free[self._pages._free] = True
        assert not bool((free & (self.live != 0)).any()), f"{what}: a free page holds live ids"
        assert not bool((~free & (self.live == 0)).any()), f"{what}: an empty page is not free (leak)"


class TieredSlotAllocator(TokenSlotAllocator):
    def __init__(self, pool: TieredKVPool, device: str = "cpu"):
        self.pool = pool
        super().__init__(pool.num_slots(TIER_FP16), device)
        pool.bind_occupancy(self.used_counts)

    def clear(self) -> None:
        super().clear()
        self._new_page_lists()

    def _new_page_lists(self) -> None:
        self._stores = {t: _IntPageList(self.pool.num_pages(t), self.pool.page_size) for t in INT_TIERS}

    # ------------------------------------------------------------------ per store
    def available_tier(self, tier: int) -> int:
        """Tokens a later alloc_tier can get: fp16 free slots, or whole free int pages."""
        return self.available_size() if tier == TIER_FP16 else self._stores[tier].available()

    def alloc_tier(self, tier: int, n: int, append_to: int | None = None, host: bool = False) -> torch.Tensor:
        """Up to n global ids of an int store (fewer when it is short), densely in order: the caller
        must pass a run's tokens of this tier in position order. append_to: a global id on a page
        whose every handed-out id the caller holds (its previous run's last page): that page's free
        tail is filled first, so the caller still holds a prefix [0, fill) of it. host: the ids on
        the host (the page lists live there), with no copy to the device."""
        store = self._stores[tier]
        page = None if append_to is None else int(self.pool.page_offset(tier, torch.tensor(append_to))[0])
        rel = store.take(n, page)
        ids = rel + self.pool.base(tier)
        return ids if host else ids.to(self.device)

    def tail_room(self, tier: int, append_to: int | None) -> int:
        """Slots alloc_tier(tier, n, append_to) can fill on append_to's page."""
        if append_to is None:
            return 0
        return self._stores[tier].appendable(int(self.pool.page_offset(tier, torch.tensor(append_to))[0]))

    def free(self, slots: torch.Tensor) -> None:
        """Device ids come to the host in ONE copy (a wait for the queued work) and are routed
        there: routing them on the device took a wait per mask (slot 0, fp16 only, each int
        tier) and per int store's copy back, e.g. for every radix leaf an eviction frees."""
        self._free_host(slots.cpu())

    def _free_host(self, slots: torch.Tensor) -> None:
        """free() on host ids: routed on the host, so no device op runs and the host never waits
        for the queued moves (the re-tier's ids are host ids); the fp16 ids reach the device free
        list through one pinned non-blocking copy (stream-ordered before any later use of it)."""
        slots = slots.reshape(-1).to(torch.int64)
        slots = slots[slots != 0]
        if not slots.numel():
            return
        tiers = self.pool.tier_of(slots)
        fp16 = slots[tiers == TIER_FP16]
        if fp16.numel():
            super().free(to_device(fp16, self.device))
        for t in INT_TIERS:
            ids = slots[tiers == t]
            if ids.numel():
                self._stores[t].give(ids - self.pool.base(t))
                if t == TIER_INT4 and self.pool.cold is not None:  # host copies lose a holder
                    self.pool.cold.release(ids)

    def reclaimable(self, slots: torch.Tensor) -> int:
        """Only fp16 ids count toward `alloc`."""
        return int(((slots > 0) & (slots < self.pool.base(TIER_INT8))).sum())

    def page_reclaimer(self, tier: int) -> Callable[[torch.Tensor], int]:
        """An eviction `reclaim` callback for an int store: tokens of whole pages freed since
        the previous call (freeing ids frees a page only with its last live id)."""
        last = [self.available_tier(tier)]

        def reclaim(_slots) -> int:
            now = self.available_tier(tier)
            gained, last[0] = now - last[0], now
            return gained
        return reclaim

    def count_tier(self, slots: torch.Tensor, tier: int) -> int:
        return int((self.pool.tier_of(slots) == tier).sum())

    def tier_of(self, slots: torch.Tensor) -> torch.Tensor:
        return self.pool.tier_of(slots).cpu()

    def used_counts(self) -> dict[int, int]:
        """Live tokens per store (int stores: handed-out ids, not whole pages)."""
        return {TIER_FP16: self.pool.num_slots(TIER_FP16) - self.available_size(),
                **{t: self._stores[t].used() for t in INT_TIERS}}

    def debug_check(self) -> None:
        super().debug_check()
        for t, store in self._stores.items():
            store.check(f"tier {t} page")

    # ------------------------------------------------------------------ re-tiering
    def retier(self, slots: torch.Tensor, tiers: torch.Tensor,
               make_room: Callable[[int, int], None] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Move tokens `slots` [m] (a run, in position order) to the tiers `tiers` [m] asks for;
        returns (new ids, tiers got).

        - Only fp16 tokens move: a token already at int8 / int4 stays where it is (moving it
          would punch a hole in its page), whatever it asks for; so a token never gains precision.
        - TIER_DROP frees an fp16 token's id and leaves slot 0 in its place.
        - Each int tier's tokens are allocated in position order, in one alloc_tier call.
        - A short store first calls make_room(tier, missing) (the caller may evict cache leaves);
          what still does not fit falls back one tier up: int4 -> int8 -> stays fp16.
        The old ids of moved and dropped tokens are freed; the caller rewrites its row.
        """
        return self.retier_runs([(slots, tiers)], make_room)[0]

    def retier_runs(self, runs: list, make_room: Callable[[int, int], None] | None = None) -> list:
        """retier for several runs [(slots, tiers[, tails]), ...] (e.g. every request a decode step
        demotes): each run gets its own pages (the prefix-fill invariant is per holder), and the
        data of all runs moves in ONE pool.move (one pass over the layers). tails {tier: global id}:
        the run's holder holds every handed-out id of that id's page (its previous run's last
        page of the tier): the run continues that page before taking fresh ones.
        -> [(new ids, tiers got)]."""
        out, src, dst, gone = [], [], [], []
        for run in runs:
            slots, tiers, tails = (*run, None)[:3]
            new, target, moved, drop = self._plan_retier(slots, tiers, make_room, tails)
            out.append((new, target))
            src.append(slots[moved])
            dst.append(new[moved])
            gone.append(slots[moved | drop])
        src, dst = torch.cat(src), torch.cat(dst)
        if src.numel():
            self.pool.move(src, dst)
        self.free(torch.cat(gone))
        return out

    def _plan_retier(self, slots: torch.Tensor, tiers: torch.Tensor, make_room, tails=None):
        """retier's id bookkeeping for one run, no data moved: (new ids, tiers got, moved mask,
        dropped mask)."""
        tails = tails or {}
        cur = self.pool.tier_of(slots)
        target = torch.where(cur == TIER_FP16, tiers.to(cur.device, torch.int8), cur)
        new = slots.clone()
        for tier in (TIER_INT4, TIER_INT8):  # int4 first: its overflow joins int8's demand
            idx = ((target == tier) & (cur != tier)).nonzero().squeeze(1)  # ascending: position order
            if not idx.numel():
                continue
            tail = tails.get(tier)
            short = idx.numel() - self.tail_room(tier, tail) - self.available_tier(tier)
            if short > 0 and make_room is not None:
                make_room(tier, short)
            # host ids (the page lists live there): no device round trip for host slots
            got = self.alloc_tier(tier, idx.numel(), tail, host=True)
            new[idx[: got.numel()]] = got.to(new.device)
            target[idx[got.numel():]] = tier - 1
        drop = (target == TIER_DROP) & (cur != TIER_DROP)
        new[drop] = 0
        moved = (new != slots) & (new != 0)
        return new, target, moved, drop

    def holed_pages(self, slots: torch.Tensor) -> torch.Tensor:
        """bool [m]: int ids of `slots` whose page this holder would see with a hole, i.e. not
        as slots [0, fill) (offsets of the page in `slots` != 0 .. count-1)."""
        bad = torch.zeros(slots.shape, dtype=torch.bool)
        flat = slots.reshape(-1).cpu()
        tiers = self.pool.tier_of(flat)
        for t in INT_TIERS:
            idx = (tiers == t).nonzero().squeeze(1)
            if not idx.numel():
                continue
            pages, offs = self.pool.page_offset(t, flat[idx])
            uniq, inv = pages.unique(return_inverse=True)
            count = torch.bincount(inv, minlength=uniq.numel())
            top = torch.full((uniq.numel(),), -1, dtype=torch.int64).scatter_reduce_(0, inv, offs, "amax")
            holed = (top + 1 != count)[inv]
            bad.view(-1)[idx[holed]] = True
        return bad

    def repack(self, slots: torch.Tensor, make_room: Callable[[int, int], None] | None = None) -> torch.Tensor:
        """Restore the prefix-fill invariant for a holder that keeps `slots` [m] (position
        order): int tokens of pages it would see with a hole are copied, codes bit for bit, to
        fresh pages of their tier (one alloc_tier per tier, position order) and their old ids
        are freed. Where the tier is short (after make_room(tier, n)), they go to fp16 (exact
        dequantized values; make_room(TIER_FP16, n) first). Returns the new ids (the caller
        rewrites its row / node)."""
        bad = self.holed_pages(slots).to(slots.device)
        if not bool(bad.any()):
            return slots
        new = slots.clone()
        tiers = self.pool.tier_of(slots)
        for t in INT_TIERS:
            idx = (bad & (tiers == t)).nonzero().squeeze(1)
            if not idx.numel():
                continue
            short = idx.numel() - self.available_tier(t)
            if short > 0 and make_room is not None:
                make_room(t, short)
            got = self.alloc_tier(t, idx.numel())
            rest = idx[got.numel():]
            if rest.numel():
                short = rest.numel() - self.available_size()
                if short > 0 and make_room is not None:
                    make_room(TIER_FP16, short)
                fp = self.alloc(rest.numel())
                if fp is None:
                    self.free(got)
                    raise RuntimeError(f"KV pool exhausted while relocating {rest.numel()} int tokens "
                                       f"of partly freed pages (tier {t})")
                got = torch.cat([got, fp.to(got.device)])
                logger.warning("tier %d store short: %d relocated tokens kept at fp16", t, rest.numel())
            new[idx] = got.to(new.device)
        moved = new != slots
        self.pool.move(slots[moved], new[moved])
        self.free(slots[moved])
        return new
