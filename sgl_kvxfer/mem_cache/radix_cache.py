"""Token radix tree over KV slots, with lock reference counts and LRU eviction of leaves.

Each edge holds a run of token ids (`key`) and the KV slots of those tokens (`value`), plus
optional per-token precision tiers (`tiers`, SpectrumKV). A node is *protected* while any
running request holds a lock on it or on a descendant; only unprotected leaves are evictable.

    root ── "The cat" ──┬── " sat" (leaf)
                        └── " ran" ── " away" (leaf)
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
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class RadixCache(PrefixCache):
    def __init__(self, allocator: TokenSlotAllocator):
        self.allocator = allocator
        self.reset_state()

    def reset_state(self) -> None:
        self.root = TreeNode()
        self.root.lock_ref = 1  # the root is never evicted
        self._evictable = 0
        self._protected = 0

    # ------------------------------------------------------------------ lookup
    def match_prefix(self, key):
        node, slots = self.root, []
        node.last_access = next(_clock)
        while key:
            child = node.children.get(key[0])
            if child is None:
                break
            n = _common_len(child.key, key)
            if n < len(child.key):
                child = self._split(child, n)
            slots.append(child.value)
            child.last_access = next(_clock)
            node, key = child, key[n:]
        value = torch.cat(slots) if slots else torch.empty(0, dtype=torch.int64)
        return value, node

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
        upper.children = {child.key[n]: child}
        child.parent.children[child.key[0]] = upper
        child.parent = upper
        child.key, child.value = child.key[n:], child.value[n:]
        if child.tiers is not None:
            child.tiers = child.tiers[n:]
        return upper

    # ------------------------------------------------------------------ insert
    def insert(self, key, slots, tiers: torch.Tensor | None = None):
        node, done = self.root, 0
        node.last_access = next(_clock)
        while done < len(key):
            child = node.children.get(key[done])
            if child is None:
                rest = TreeNode(node, list(key[done:]), slots[done:].clone(),
                                None if tiers is None else tiers[done:].clone())
                node.children[key[done]] = rest
                self._evictable += len(rest.key)
                return done
            n = _common_len(child.key, key[done:])
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
    def evict(self, num_tokens):
        heap = [(n.last_access, id(n), n) for n in self._leaves() if n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < num_tokens:
            _, _, leaf = heapq.heappop(heap)
            self.allocator.free(leaf.value)
            freed += len(leaf.key)
            self._evictable -= len(leaf.key)
            parent = leaf.parent
            del parent.children[leaf.key[0]]
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
