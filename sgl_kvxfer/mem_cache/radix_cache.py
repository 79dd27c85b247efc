"""Token radix tree over KV slots, with lock reference counts and LRU eviction of leaves.

Each edge holds a run of token ids (`key`) and the KV slots of those tokens (`value`), plus
optional per-token precision tiers (`tiers`, SpectrumKV). A node is *protected* while any
running request holds a lock on it or on a descendant; only unprotected leaves are evictable.
With a tiered pool, `insert` without tiers records the allocator's `tier_of(slots)`; slot 0 in
`value` is a dropped token (TIER_DROP): attention masks it and the allocator never frees it.

    root ── "The cat" ──┬── " sat" (leaf)
                        └── " ran" ── " away" (leaf)

Page mode (page_size P > 1, slots from PagedTokenSlotAllocator): every edge holds whole pages,
keys are matched and inserted only in whole pages (a tail shorter than P is ignored) and edges
split only at page boundaries, so a node's slots are whole pages that it alone owns. Children
are keyed by their first page of tokens (tuple), since two siblings may share a first token.
"""
from __future__ import annotations

import heapq
import itertools

import torch

from sgl_kvxfer.mem_cache.allocator import TokenSlotAllocator
from sgl_kvxfer.mem_cache.prefix_cache import PrefixCache

_clock = itertools.count()


class TreeNode:
    __slots__ = ("children", "parent", "key", "value", "tiers", "lock_ref", "last_access")

    def __init__(self, parent: "TreeNode | None" = None, key: list[int] | None = None,
                 value: torch.Tensor | None = None, tiers: torch.Tensor | None = None):
        self.children: dict[int, TreeNode] = {}
        self.parent = parent
        self.key = key or []
        self.value = value if value is not None else torch.empty(0, dtype=torch.int64)
        self.tiers = tiers
        self.lock_ref = 0
        self.last_access = next(_clock)


def _common_len(a: list[int], b: list[int]) -> int:
    """Length of the common prefix. Slice comparisons run in C: a full match (the common case
    when a request re-inserts what it matched) costs one, a partial one O(log n) of them."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n - 1  # invariant: a[:lo] == b[:lo] and a[:hi + 1] != b[:hi + 1]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class RadixCache(PrefixCache):
    def __init__(self, allocator: TokenSlotAllocator, page_size: int = 1):
        self.allocator = allocator
        self.page_size = page_size
        self.reset_state()

    def _child_key(self, key: list[int]):
        return key[0] if self.page_size == 1 else tuple(key[: self.page_size])

    def _page_floor(self, n: int) -> int:
        return n - n % self.page_size

    def reset_state(self) -> None:
        self.root = TreeNode()
        self.root.lock_ref = 1  # the root is never evicted
        self._evictable = 0
        self._protected = 0

    # ------------------------------------------------------------------ lookup
    def match_prefix(self, key):
        path, node = self._walk(key)
        value = torch.cat([n.value for n in path]) if path else torch.empty(0, dtype=torch.int64)
        return value, node

    def match_node(self, key) -> tuple[int, TreeNode]:
        """match_prefix without gathering the slots: (matched length, last node). No tensor op,
        for callers that already hold the slots (a request re-finding what it just inserted)."""
        path, node = self._walk(key)
        return sum(len(n.key) for n in path), node

    def _walk(self, key) -> tuple[list[TreeNode], TreeNode]:
        """Nodes along the longest cached prefix of `key` (splitting the last edge at the match
        end), LRU-touched, and the last of them (the root when nothing matched)."""
        node, path = self.root, []
        node.last_access = next(_clock)
        key = key[: self._page_floor(len(key))]
        while key:
            child = node.children.get(self._child_key(key))
            if child is None:
                break
            n = self._page_floor(_common_len(child.key, key))  # >= 1 page: the child key matched
            if n < len(child.key):
                child = self._split(child, n)
            path.append(child)
            child.last_access = next(_clock)
            node, key = child, key[n:]
        return path, node

    def match_tiers(self, node: TreeNode) -> torch.Tensor | None:
        """Tiers of the path root..node (None when no node on it carries tiers)."""
        parts, any_tiers = [], False
        while node is not self.root:
            any_tiers |= node.tiers is not None
            parts.append(node.tiers if node.tiers is not None else torch.zeros(len(node.key), dtype=torch.int8))
            node = node.parent
        return torch.cat(parts[::-1]) if any_tiers else None

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Split `child`'s edge after n tokens; returns the new upper node."""
        upper = TreeNode(child.parent, child.key[:n], child.value[:n],
                         None if child.tiers is None else child.tiers[:n])
        upper.lock_ref = child.lock_ref
        upper.children = {self._child_key(child.key[n:]): child}
        child.parent.children[self._child_key(child.key)] = upper
        child.parent = upper
        child.key, child.value = child.key[n:], child.value[n:]
        if child.tiers is not None:
            child.tiers = child.tiers[n:]
        return upper

    # ------------------------------------------------------------------ insert
    def insert(self, key, slots, tiers: torch.Tensor | None = None):
        node, done = self.root, 0
        node.last_access = next(_clock)
        key = key[: self._page_floor(len(key))]  # page mode: a partial last page stays private
        while done < len(key):
            child = node.children.get(self._child_key(key[done:]))
            if child is None:
                rest_tiers = None if tiers is None else tiers[done : len(key)].clone()
                if rest_tiers is None and hasattr(self.allocator, "tier_of"):  # tiered pool: id -> tier
                    rest_tiers = self.allocator.tier_of(slots[done : len(key)])
                rest = TreeNode(node, list(key[done:]), slots[done : len(key)].clone(), rest_tiers)
                node.children[self._child_key(rest.key)] = rest
                self._evictable += len(rest.key)
                return done
            n = self._page_floor(_common_len(child.key, key[done:]))
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = next(_clock)
            node, done = child, done + n
        return done

    # ------------------------------------------------------------------ locks
    def inc_lock_ref(self, node):
        while node is not self.root:
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
                self._protected += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node):
        while node is not self.root:
            assert node.lock_ref > 0, "dec_lock_ref on an unlocked node"
            if node.lock_ref == 1:
                self._evictable += len(node.key)
                self._protected -= len(node.key)
            node.lock_ref -= 1
            node = node.parent

    # ------------------------------------------------------------------ eviction
    def evict(self, num_tokens, reclaim=None):
        """Free LRU unlocked leaves until `reclaim(slots)` (default: the allocator's count of ids
        a later alloc can use) sums to `num_tokens`; returns that sum."""
        reclaim = reclaim or self.allocator.reclaimable
        heap = [(n.last_access, id(n), n) for n in self._leaves() if n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < num_tokens:
            _, _, leaf = heapq.heappop(heap)
            self.allocator.free(leaf.value)
            freed += reclaim(leaf.value)
            self._evictable -= len(leaf.key)
            parent = leaf.parent
            del parent.children[self._child_key(leaf.key)]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def _leaves(self):
        stack = [self.root]
        while stack:
            node = stack.pop()
            if not node.children and node is not self.root:
                yield node
            stack.extend(node.children.values())

    def evictable_size(self):
        return self._evictable

    def protected_size(self):
        return self._protected

    def total_size(self) -> int:
        return self._evictable + self._protected

    def reset(self):
        assert self._protected == 0, "flush while requests hold cache locks"
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            self.allocator.free(node.value)
            stack.extend(node.children.values())
        self.reset_state()
