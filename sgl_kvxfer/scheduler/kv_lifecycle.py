"""KV slot lifecycle of requests: admit (prefix match + lock), grow, cache, release.

Owns the ownership rules of mem_cache/prefix_cache.py from the request side. With the radix
cache disabled, `tree` is None and every slot is private to its request.

Page mode (allocator.page_size P > 1): the tree holds whole pages only, so `prefix_len` is
always a multiple of P and a request's partial last page is private to it:

    row:  [ prefix (tree pages, locked) | private full pages | private partial page ]
          0                    prefix_len (P-aligned)          floor(kv_len, P)    kv_len
"""
from __future__ import annotations

import torch

from sgl_kvxfer.mem_cache.allocator import TokenSlotAllocator
from sgl_kvxfer.mem_cache.paged_allocator import pages_needed
from sgl_kvxfer.mem_cache.radix_cache import RadixCache
from sgl_kvxfer.mem_cache.req_to_token import ReqToTokenPool
from sgl_kvxfer.scheduler.req import Req
from sgl_kvxfer.utils.host_copy import int64_to_device


class KVLifecycle:
    def __init__(self, allocator: TokenSlotAllocator, req_to_token: ReqToTokenPool, use_radix: bool):
        self.allocator = allocator
        self.page_size = getattr(allocator, "page_size", 1)
        self.req_to_token = req_to_token
        self.tree = RadixCache(allocator, self.page_size) if use_radix else None

    def available_tokens(self) -> int:
        """Slots obtainable now: free plus evictable."""
        evictable = self.tree.evictable_size() if self.tree else 0
        return self.allocator.available_size() + evictable

    def match(self, req: Req) -> int:
        """Prefix length the cache could serve (no side effects beyond LRU touch)."""
        if self.tree is None:
            return 0
        slots, _ = self.tree.match_prefix(req.fill_ids[: req.prefix_match_limit()])
        return int(slots.numel())

    def admit(self, req: Req) -> bool:
        """Give `req` a table row and its cached prefix (locked). False if no row is free."""
        row = self.req_to_token.alloc()
        if row is None:
            return False
        req.req_pool_idx = row
        if self.tree is not None:
            slots, node = self.tree.match_prefix(req.fill_ids[: req.prefix_match_limit()])
            self.tree.inc_lock_ref(node)
            req.last_node = node
            if slots.numel():
                self.req_to_token.write(row, 0, slots)
            req.prefix_len = req.kv_len = int(slots.numel())
        if req.num_retractions == 0:  # a recomputation after retraction keeps its first report
            req.cached_tokens = req.prefix_len
        return True

    def admit_external(self, req: Req) -> bool:
        """A row for a request whose prompt KV is written from outside (PD decode): no prefix
        match; positions get slots as the KV arrives (`alloc` + a row write, kv_len grows), and
        `release` frees what arrived. False if no row is free."""
        row = self.req_to_token.alloc()
        if row is None:
            return False
        req.req_pool_idx, req.prefix_len, req.kv_len = row, 0, 0
        if self.tree is not None:
            req.last_node = self.tree.root
            self.tree.inc_lock_ref(req.last_node)
        return True

    def slots_needed(self, starts: list[int], lens: list[int]) -> int:
        """Free slots that `alloc(reqs, lens, starts)` takes (whole fresh pages in page mode)."""
        if self.page_size == 1:
            return sum(lens)
        return pages_needed(starts, lens, self.page_size) * self.page_size

    def make_room(self, n: int) -> bool:
        """Evict unlocked cache leaves until `n` slots are free. False when they cannot be (what
        could be evicted is evicted anyway, as an allocation attempt would)."""
        short = n - self.allocator.available_size()
        if short > 0 and self.tree is not None:
            self.tree.evict(short)
        return self.allocator.available_size() >= n

    def alloc(self, reqs: list[Req], lens: list[int] | None = None,
              starts: list[int] | None = None) -> torch.Tensor | None:
        """Slots for the next `lens[i]` positions (default 1: decode) of each request, from
        position `starts[i]` (default `kv_len`; the overlap scheduler allocates one step ahead
        of it) on, concatenated; evicts unlocked cache leaves if needed. None (and nothing
        changed) when the pool cannot cover them all."""
        starts = [r.kv_len for r in reqs] if starts is None else starts
        P, at_boundary = self.page_size, None
        if lens is None:  # decode, the hot case: one pass finds the rows that open a page
            at_boundary = [i for i, s in enumerate(starts) if s % P == 0] if P > 1 else None
            need = len(reqs) if P == 1 else len(at_boundary) * P
        else:
            need = self.slots_needed(starts, lens)
        if not self.make_room(need):
            return None
        if P == 1:
            return self.allocator.alloc(need)
        table = self.req_to_token.table
        # one host->device copy for both index lists
        idx = int64_to_device(([r.req_pool_idx for r in reqs], [max(st - 1, 0) for st in starts]), table.device)
        rows, last_pos = idx.split(len(reqs))
        if at_boundary is not None:
            return self.allocator.alloc_decode(table[rows, last_pos], at_boundary)
        return self.allocator.alloc_extend(table[rows, last_pos], starts, lens)

    def cache(self, req: Req, finished: bool) -> None:
        """Hand the request's computed KV to the prefix cache (or free it without one).

        finished=False keeps the request running on the cache's copy of its tokens: its row is
        rewritten to the tree's slots and its lock moves to the new last node.
        """
        row, kv_len = req.req_pool_idx, req.kv_len
        # A view of the row: insert clones what the tree keeps; what is freed is cloned first
        # (the row is rewritten below and reused once the request is gone).
        slots = self.req_to_token.read(row, kv_len)
        if self.tree is None or not req.share_prefix:  # every slot private (the root stays locked)
            if finished:
                self.allocator.free(slots.clone())
                if self.tree is not None and req.last_node is not None:
                    self.tree.dec_lock_ref(req.last_node)
                self._release_row(req)
            return
        cached_len = kv_len - kv_len % self.page_size  # the tree takes whole pages only
        tokens = req.fill_ids[:cached_len]
        if hasattr(self.allocator, "repack"):
            self._repack_kept(req, tokens, slots)
        present = self.tree.insert(tokens, slots[:cached_len])
        if present > req.prefix_len:  # our duplicates of tokens someone else cached first
            self.allocator.free(slots[req.prefix_len : present].clone())
        if finished:
            if cached_len < kv_len:  # the private partial last page
                self.allocator.free(slots[cached_len:].clone())
            self.tree.dec_lock_ref(req.last_node)
            self._release_row(req)
            return
        if present > req.prefix_len:  # the row must point at the cached copies instead
            new_slots, node = self.tree.match_prefix(tokens)
            assert new_slots.numel() == cached_len, "inserted tokens must match back in full"
            self.req_to_token.write(row, 0, new_slots)  # whole pages: the partial tail is untouched
        else:  # the tree took the row's own slots: the row already holds them (no tensor op)
            matched, node = self.tree.match_node(tokens)
            assert matched == cached_len, "inserted tokens must match back in full"
        self.tree.inc_lock_ref(node)
        self.tree.dec_lock_ref(req.last_node)
        req.last_node, req.prefix_len = node, cached_len

    def _repack_kept(self, req: Req, tokens: list[int], slots: torch.Tensor) -> None:
        """Tiered pool: when the tree already holds [prefix_len, present) (someone cached them
        first), we keep only [present, kv_len) of our runs, a suffix of their int pages; move
        what would be seen with a hole to fresh pages (tiered_allocator.py, prefix-fill
        invariant) and rewrite the row (`slots` is its view) before the tree takes it."""
        present, node = self.tree.match_node(tokens)
        if present <= req.prefix_len or present >= req.kv_len:
            return
        self.tree.inc_lock_ref(node)  # make_room must not evict the path we dedupe against
        try:
            new = self.allocator.repack(slots[present:req.kv_len].clone(), self.make_room_tier)
        finally:
            self.tree.dec_lock_ref(node)
        self.req_to_token.write(req.req_pool_idx, present, new)

    def make_room_tier(self, tier: int, n: int) -> None:
        """Evict unlocked leaves until n more tokens of a tiered pool's store are free."""
        if self.tree is None:
            return
        if tier == 0:
            self.tree.evict(n)
        else:
            self.tree.evict(n, reclaim=self.allocator.page_reclaimer(tier))

    def release(self, req: Req) -> None:
        """Drop a request's KV without caching it (retraction)."""
        if req.req_pool_idx is None:
            return
        private = self.req_to_token.read(req.req_pool_idx, req.kv_len, start=req.prefix_len).clone()
        self.allocator.free(private)
        if self.tree is not None and req.last_node is not None:
            self.tree.dec_lock_ref(req.last_node)
        self._release_row(req)

    def _release_row(self, req: Req) -> None:
        self.req_to_token.free(req.req_pool_idx)
        req.req_pool_idx, req.last_node = None, None
        req.prefix_len = req.kv_len = 0

    def flush(self) -> None:
        if self.tree is not None:
            self.tree.reset()
