"""LazyFreeList: queued frees join the list at the next allocation that needs them; with
sort_merged the ids handed out after a merge ascend (the tiered pool's fp16 rows)."""
from __future__ import annotations

import torch

from sgl_kvxfer.mem_cache.free_list import LazyFreeList


def test_merge_keeps_free_order_by_default():
    fl = LazyFreeList(0, 7, "cpu")
    taken = fl.take(6)
    fl.give(taken[[4, 1, 3]])
    assert fl.take(5).tolist() == [6, 7, 4, 1, 3]


def test_sort_merged_hands_out_ascending_ids():
    fl = LazyFreeList(1, 8, "cpu", sort_merged=True)
    taken = fl.take(7)  # 1..7, 8 stays free
    fl.give(taken[[5, 0, 3]])  # ids 6, 1, 4 freed out of order
    assert fl.available() == 4
    assert fl.take(4).tolist() == [1, 4, 6, 8]
    fl.check("slot")


def test_tiered_allocator_hands_a_new_prompt_ascending_fp16_rows():
    from sgl_kvxfer.mem_cache.allocator import TokenSlotAllocator
    from sgl_kvxfer.mem_cache.tiered_allocator import TieredSlotAllocator
    from sgl_kvxfer.mem_cache.tiered_pool import TierStorePlan, TieredKVPool

    assert not TokenSlotAllocator(8)._slots.sort_merged  # other allocators keep the free order
    pool = TieredKVPool(32, 2, 2, 16, torch.float16, "cpu", TierStorePlan(16, 16, 16), group_size=16, page_size=4)
    alloc = TieredSlotAllocator(pool, "cpu")
    first = alloc.alloc(12)
    alloc.free(first[torch.tensor([7, 2, 9, 0, 5])])  # freed out of order, as a re-tier frees
    ids = alloc.alloc(alloc.available_size())
    assert ids.tolist() == sorted(ids.tolist())
