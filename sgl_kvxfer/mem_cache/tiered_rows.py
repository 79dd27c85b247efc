"""What the token-gather kernel reads from a TieredKVPool: store views and per-batch row tables.

    tier_store_views(pool, layer_id)        -> TieredKVLayer: the layer's three stores viewed
                                               as kernels/paged_layout.py pages of ONE token
    tier_row_tables(pool, slots, seq_lens)  -> TieredBlockTables: per tier, each request's
                                               store rows (a "page" id at PAGE = 1) and count

Row tables from request rows of global slot ids (tiered_pool.py), on the slots' device with no
host sync (the width L comes from the batch's CPU seq_lens):

    slots [B, L]   s == 0 (dropped) or column >= seq_len  -> key 3 (ignored)
                   0 < s < base(int8)                     -> key 0, fp16 row s   (row 0 = padding)
                   base(int8) <= s < base(int4)           -> key 1, int8 row s - base(int8)
                   base(int4) <= s                        -> key 2, int4 row s - base(int4)
    stable sort of each row by key:  [ fp16 rows | int8 rows | int4 rows | ignored ]
                                     0          n16        n16+n8     n16+n8+n4        L
    tables[t][b, j] = sorted[b, start_t + j]  for j < n_t  (start_t = n_<t; later columns hold
                      clamped, unrelated values the kernel never reads)
"""
from __future__ import annotations

import torch

from sgl_kvxfer.kernels.paged_layout import TieredBlockTables, TieredKVLayer, TierPages
from sgl_kvxfer.mem_cache.tiered_pool import TieredKVPool
from sgl_kvxfer.spectrum.tiers import TIER_FP16, TIER_INT4, TIER_INT8

_IGNORED = 3


def tier_row_tables(pool: TieredKVPool, slots: torch.Tensor, seq_lens: torch.Tensor) -> TieredBlockTables:
    """slots int64 [B, L] (req_to_token rows), seq_lens [B] -> per-tier int32 [B, L] row tables
    and int32 [B] counts. Dropped tokens (slot 0) and columns >= seq_len are left out."""
    B, L = slots.shape
    cols = torch.arange(L, device=slots.device)
    b8, b4 = pool.base(TIER_INT8), pool.base(TIER_INT4)
    live = (cols[None, :] < seq_lens[:, None]) & (slots != 0)
    tier = (slots >= b8).to(torch.int8) + (slots >= b4).to(torch.int8)
    key = torch.where(live, tier, torch.full_like(tier, _IGNORED))
    key_sorted, order = torch.sort(key, dim=1, stable=True)
    # python-int bases (no host-to-device copy): store row = slot id - base(tier)
    base = torch.where(key_sorted == TIER_INT8, b8, torch.where(key_sorted == TIER_INT4, b4, 0))
    rows = slots.gather(1, order) - base
    counts = [(key == t).sum(1, dtype=torch.int32) for t in (TIER_FP16, TIER_INT8, TIER_INT4)]
    starts = (torch.zeros_like(counts[0]), counts[0], counts[0] + counts[1])
    tables = tuple(rows.gather(1, (s[:, None] + cols[None, :]).clamp_(max=max(L - 1, 0))).to(torch.int32)
                   for s in starts)
    return TieredBlockTables(tables, tuple(counts))


def tier_store_views(pool: TieredKVPool, layer_id: int) -> TieredKVLayer:
    """The layer's stores as [R, Hkv, 1, W] views (no copy). An empty store (e.g. no int8 at
    b = 0.25) is replaced by a one-row zero placeholder: counts are 0, it is never read.
    NOTE: `resize_int_stores` (int4 probe) replaces the int stores; rebuild views after it."""
    def one_token_pages(x):
        if x.shape[0] == 0:
            x = torch.zeros((1, *x.shape[1:]), dtype=x.dtype, device=x.device)
        return x[:, :, None, :]

    fp16 = TierPages(TIER_FP16, one_token_pages(pool.k16[layer_id]), one_token_pages(pool.v16[layer_id]))
    quant = []
    for tier in (TIER_INT8, TIER_INT4):
        s = pool.stores[tier][layer_id]
        quant.append(TierPages(tier, *(one_token_pages(x) for x in (s.k, s.v, s.k_scale, s.k_zero,
                                                                     s.v_scale, s.v_zero))))
    return TieredKVLayer((fp16, *quant), pool.head_dim, pool.group_size)
