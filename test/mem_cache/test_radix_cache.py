import random

import torch

from sgl_kvxfer.mem_cache.allocator import TokenSlotAllocator
from sgl_kvxfer.mem_cache.radix_cache import RadixCache, _common_len


def _insert(tree, alloc, tokens):
    slots = alloc.alloc(len(tokens))
    present = tree.insert(tokens, slots)
    alloc.free(slots[:present])  # duplicates of already-cached tokens stay with the caller
    return slots


def test_match_insert_split_and_sizes():
    alloc = TokenSlotAllocator(100)
    tree = RadixCache(alloc)
    s1 = _insert(tree, alloc, [1, 2, 3, 4])
    _insert(tree, alloc, [1, 2, 5])
    slots, node = tree.match_prefix([1, 2, 3, 9])
    assert slots.tolist() == s1[:3].tolist()
    assert tree.evictable_size() == 5  # [1,2] + [3,4] + [5]
    slots, _ = tree.match_prefix([7])
    assert slots.numel() == 0


def test_locked_nodes_survive_eviction_and_lru_order():
    alloc = TokenSlotAllocator(100)
    tree = RadixCache(alloc)
    _insert(tree, alloc, [1, 2, 3])
    _insert(tree, alloc, [4, 5])
    _, node = tree.match_prefix([1, 2, 3])
    tree.inc_lock_ref(node)
    assert tree.protected_size() == 3 and tree.evictable_size() == 2
    assert tree.evict(10) == 2  # only the unlocked leaf goes
    assert tree.match_prefix([1, 2, 3])[0].numel() == 3
    tree.dec_lock_ref(node)
    assert tree.evict(10) == 3
    assert tree.evictable_size() == 0 and tree.protected_size() == 0
    alloc.debug_check()
    assert alloc.available_size() == 100


def test_evict_lru_first():
    alloc = TokenSlotAllocator(100)
    tree = RadixCache(alloc)
    _insert(tree, alloc, [1, 1])
    _insert(tree, alloc, [2, 2])
    tree.match_prefix([1, 1])  # touch: [2, 2] is now least recently used
    tree.evict(1)
    assert tree.match_prefix([1, 1])[0].numel() == 2
    assert tree.match_prefix([2, 2])[0].numel() == 0


def test_split_keeps_lock_counts():
    alloc = TokenSlotAllocator(100)
    tree = RadixCache(alloc)
    _insert(tree, alloc, [1, 2, 3, 4])
    _, node = tree.match_prefix([1, 2, 3, 4])
    tree.inc_lock_ref(node)
    tree.match_prefix([1, 2])  # splits the locked edge
    tree.dec_lock_ref(node)
    assert tree.protected_size() == 0 and tree.evictable_size() == 4
    tree.reset()
    alloc.debug_check()
    assert alloc.available_size() == 100


def test_tiers_follow_tokens():
    alloc = TokenSlotAllocator(100)
    tree = RadixCache(alloc)
    slots = alloc.alloc(4)
    tree.insert([1, 2, 3, 4], slots, tiers=torch.tensor([0, 1, 2, 2], dtype=torch.int8))
    _, node = tree.match_prefix([1, 2, 3])
    assert tree.match_tiers(node).tolist() == [0, 1, 2]


def test_common_len_matches_a_token_by_token_scan():
    """_common_len's slice comparisons + binary search find the first mismatch exactly."""

    def scan(a, b):
        i = 0
        while i < min(len(a), len(b)) and a[i] == b[i]:
            i += 1
        return i

    rng = random.Random(0)
    for _ in range(3000):
        a = [rng.randrange(3) for _ in range(rng.randrange(40))]
        b = a[: rng.randrange(len(a) + 1)] + [rng.randrange(3) for _ in range(rng.randrange(6))]
        assert _common_len(a, b) == _common_len(b, a) == scan(a, b), (a, b)
