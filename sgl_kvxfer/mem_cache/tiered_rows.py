"""What the paged kernels read from a TieredKVPool: layer views and per-batch block tables.

    tier_layer_view(pool, layer_id)             -> TieredKVLayer: fp16 store as pages of ONE
                                                   token, int stores as their PAGE-token pages
    tier_block_tables(pool, slots, seq_lens)    -> TieredBlockTables in the FILLED form
                                                   (kernels/paged_layout.py), per tier

Tables from request rows of global slot ids (tiered_pool.py), on the slots' device, no host
sync, every shape a function of slots.shape alone (CUDA-graph capturable):

    slots [B, L]   s == 0 (dropped) or column >= seq_len  -> key END (ignored)
                   live s                                  -> key s
    sort each row by key (ids are tier-major, page-major):
        [ fp16 ids | int8 ids, page by page | int4 ids, page by page | ignored ]
        0          n16                      n16+n8                   n16+n8+n4         L
    fp16 (PAGE 1): tables[0][b, j] = sorted[b, j], fills 1, num_pages = n16
    int tier t:    a page starts where the page id (s - base(t)) // PAGE changes; run-length
                   encoding gives tables[t][b, r] = r-th distinct page, fills[t][b, r] = its token
                   count, num_pages[t][b] = number of pages. The prefix-fill invariant
                   (tiered_allocator.py) makes that count the page's slots [0, fill).
    width L for every tier (a request may hold up to L partial pages); unused entries: page 0,
    fill 0.
"""
from __future__ import annotations

import torch

from sgl_kvxfer.kernels.paged_layout import TieredBlockTables, TieredKVLayer, TierPages, int_tier_pages
from sgl_kvxfer.mem_cache.tiered_pool import TieredKVPool
from sgl_kvxfer.spectrum.tiers import TIER_FP16, TIER_INT4, TIER_INT8


def tier_block_tables(pool: TieredKVPool, slots: torch.Tensor, seq_lens: torch.Tensor) -> TieredBlockTables:
    """slots int64 [B, L] (req_to_token rows), seq_lens [B] -> filled TieredBlockTables, every
    tensor int32 of width L. Dropped tokens (slot 0) and columns >= seq_len are left out. On CUDA
    the run-length encoding is two launches (kernels/tier_tables.py), elsewhere their torch reference;
    the sort runs on int32 keys (half the radix passes of int64)."""
    B, L = slots.shape
    dev, end = slots.device, pool.id_end
    cols = torch.arange(L, device=dev)
    live = (cols[None, :] < seq_lens[:, None]) & (slots != 0)
    keys = torch.where(live, slots, end).to(torch.int32).sort(dim=1).values
    # imported here: triton.jit reads TRITON_INTERPRET when the kernel module loads (utils/triton_cpu.py)
    from sgl_kvxfer.kernels.tier_tables import tier_tables, tier_tables_reference

    build = tier_tables if keys.is_cuda else tier_tables_reference
    return build(keys, pool.base(TIER_INT8), pool.base(TIER_INT4), end, pool.page_size)


def tier_layer_view(pool: TieredKVPool, layer_id: int) -> TieredKVLayer:
    """The layer's stores as TierPages (no copy): fp16 [n16 + 2, Hkv, 1, D], int stores as their
    page-head blocks. An empty int store (e.g. no int8 at b = 0.25) is replaced by a one-page zero
    placeholder: its counts are 0, it is never read (TierPages.num_pages tells the backend)."""
    def placeholder(t):
        store = pool.stores[t][layer_id]
        if store.num_pages:
            return store
        return int_tier_pages(t, 1, pool.page_size, pool.num_kv_heads, pool.head_dim, pool.group_size, pool.device)

    fp16 = TierPages(TIER_FP16, pool.k16[layer_id][:, :, None, :], pool.v16[layer_id][:, :, None, :])
    quant = [placeholder(t) for t in (TIER_INT8, TIER_INT4)]
    layer = TieredKVLayer((fp16, *quant), pool.head_dim, pool.group_size)
    layer.check(uniform=False)
    return layer
