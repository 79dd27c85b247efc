"""Relocate int tokens inside one int tier's page-head blocks, codes bit for bit: one launch per (layer, tier).

    relocate_codes(store, src_page, src_off, dst_page, dst_off) -> None
    relocate_codes_reference(...)                               (torch: TierPages.codes / put_codes)

store  TierPages of an int tier (paged_layout.py): k, v uint8 [P, Hkv, BLOCK]
src_page, src_off, dst_page, dst_off   int64 [n]: token i moves from (src_page[i], src_off[i]) to
       (dst_page[i], dst_off[i]) in every kv head: its K code row, its V code column, the four
       scale / zero entries. What TieredKVPool.move does for int -> same-int moves (the cold tier's
       page repair, the allocator's repack).
grid (n, Hkv). NOTE: every source is read and every destination written by the same launch, so
the destinations must not be sources of the same call (the caller checks; the torch path, which
gathers everything first, has no such limit).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .paged_layout import TierPages
from .tier_codec import TIER_FP16


@triton.jit
def _relocate_kernel(k_ptr, v_ptr, hk_ptr, hv_ptr, sp_ptr, so_ptr, dp_ptr, do_ptr, stride_p, stride_h,
                     PAGE: tl.constexpr, W: tl.constexpr, NG: tl.constexpr, BLOCK_W: tl.constexpr,
                     BLOCK_NG: tl.constexpr):
    i = tl.program_id(0)
    h = tl.program_id(1)
    so = tl.load(so_ptr + i).to(tl.int64)
    do = tl.load(do_ptr + i).to(tl.int64)
    sblk = tl.load(sp_ptr + i).to(tl.int64) * stride_p + h * stride_h  # bytes
    dblk = tl.load(dp_ptr + i).to(tl.int64) * stride_p + h * stride_h
    c = tl.arange(0, BLOCK_W)
    cm = c < W
    # K codes token-major [PAGE, W]; V codes dim-major [W, PAGE]
    tl.store(k_ptr + dblk + do * W + c, tl.load(k_ptr + sblk + so * W + c, mask=cm), mask=cm)
    tl.store(v_ptr + dblk + c * PAGE + do, tl.load(v_ptr + sblk + c * PAGE + so, mask=cm), mask=cm)
    # scale [PAGE, NG] then zero [PAGE, NG], fp16, behind the codes (element offsets of the fp16 view)
    g = tl.arange(0, BLOCK_NG)
    gm = g < NG
    s0 = sblk // 2 + PAGE * W // 2 + so * NG + g
    d0 = dblk // 2 + PAGE * W // 2 + do * NG + g
    for part in tl.static_range(2):
        at = part * PAGE * NG
        tl.store(hk_ptr + d0 + at, tl.load(hk_ptr + s0 + at, mask=gm), mask=gm)
        tl.store(hv_ptr + d0 + at, tl.load(hv_ptr + s0 + at, mask=gm), mask=gm)


def relocate_codes(store: TierPages, src_page: torch.Tensor, src_off: torch.Tensor, dst_page: torch.Tensor,
                   dst_off: torch.Tensor) -> None:
    """Move tokens (src_page, src_off) -> (dst_page, dst_off) of `store`, codes bit for bit
    (module docstring). No host sync."""
    assert isinstance(store, TierPages) and store.tier != TIER_FP16, "int page-head blocks only"
    assert store.k.is_contiguous() and store.v.is_contiguous() and store.k.stride() == store.v.stride()
    n = src_page.numel()
    assert src_off.numel() == dst_page.numel() == dst_off.numel() == n
    width, ng = store.width, store.num_groups
    assert (store.page * width) % 2 == 0
    if n == 0:
        return
    _relocate_kernel[(n, store.num_kv_heads)](
        store.k, store.v, store.k.view(torch.float16), store.v.view(torch.float16),
        src_page.contiguous(), src_off.contiguous(), dst_page.contiguous(), dst_off.contiguous(),
        store.k.stride(0), store.k.stride(1), PAGE=store.page, W=width, NG=ng,
        BLOCK_W=triton.next_power_of_2(width), BLOCK_NG=triton.next_power_of_2(ng), num_warps=1)


def relocate_codes_reference(store: TierPages, src_page, src_off, dst_page, dst_off) -> None:
    """Torch reference: every stream gathered, then written."""
    store.put_codes(dst_page, dst_off, store.codes(src_page, src_off))
