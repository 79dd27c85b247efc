"""Decode attention mass per key, read straight from the tiered pool: the cold tier's scoring pass.

    pool_token_mass(q, rows, lens, k16, int8, int4, b8, b4, scale, out) -> out   (max-accumulated)
    pool_token_mass_layers(qs, rows, lens, k16s, int8s, int4s, b8, b4, scale, out) -> out
                                          (several layers: one launch each, one torch tail for all)
    pool_token_mass_reference(...)                                               (torch: same result)

q      [n, Hq, D] one decode query per row (a probed layer's tap, rows gathered)
rows   int64 [n, W] global slot ids of the tiered pool, position order (the req_to_token rows);
       slot 0 is a dropped token, positions >= lens[i] are padding: both are masked
lens   int32/int64 [n]
k16    [S16, Hkv, D] the layer's fp16 store (model dtype); ids [0, b8) index it
int8, int4   TierPages of the layer's int stores (page-head blocks, paged_layout.py);
       id s in [b8, b4) is int8 token (s - b8) // PAGE, slot (s - b8) % PAGE; ids >= b4 int4
out    float32 [n, W]: out = max(out, p) with

    p[i, j] = max over query heads h of softmax_j(q[i, h] . k[i, j, h // G] * scale)

One launch per call, grid (n, cdiv(W, TILE)), every program looping over the kv heads:
  _logits_kernel   the logits (log2 domain, NEG_BIG where masked) of every query head   [n, Hq, W]
                   and per tile and head the (max, sum) of their exp2                  [n, Hq, T]
then torch on the device: each row's log-sum-exp per head from the tiles' parts [n, Hq], and
p = max over heads of exp2(logit - lse) [n, W] into out. K is read once, dequantized in
registers; the fp32 logits (Hq x W x 4 bytes a row) are the only intermediate; no padded copy of
the keys and no host sync. A token's three tier loads are masked by its id range, so each lane
reads only the store it lives in.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._split_k import NEG_BIG
from .paged_layout import TierPages, code_width
from .tier_codec import TIER_INT4, TIER_INT8, dequantize

LOG2E = 1.4426950408889634
_MASKED = float(NEG_BIG.value)  # what the kernel stores for a masked logit


@triton.jit
def _tile_slots(rows_ptr, n_tok, t0, b8, b4, TILE: tl.constexpr):
    """Slot ids [TILE, 1] of positions [t0, t0 + TILE) of one row and the masks of the live ones
    (inside the row, not dropped) per store. Per-token values stay [TILE, 1] columns of the
    [TILE, D] key layout, never 1-D vectors: Triton 3.6's layout pass (sm_90, TILE 32) fails on
    1-D selects used in two 2-D layouts."""
    offs_t = t0 + tl.arange(0, TILE)[:, None]
    inside = offs_t < n_tok
    slot = tl.load(rows_ptr + offs_t, mask=inside, other=0).to(tl.int64)
    live = inside & (slot != 0)
    return slot, live, live & (slot < b8), live & (slot >= b8) & (slot < b4), live & (slot >= b4)


@triton.jit
def _keys_tile(slot, is16, is8, is4, kv_head, k16_ptr, k8_ptr, h8_ptr, k4_ptr, h4_ptr, b8, b4,
               stride_s16, stride_h16, stride_p8, stride_h8, stride_p4, stride_h4,
               HEAD_DIM: tl.constexpr, G: tl.constexpr, PAGE: tl.constexpr):
    """Keys [TILE, D] (fp32) of one kv head at the slots [TILE, 1] (_tile_slots). Both int tiers
    are dequantized in the fp16 keys' layout: each channel gathers its group's scale / zero
    (offs_d // G) and, for int4, its byte and nibble; no tile is reshaped, permuted or joined."""
    offs_d = tl.arange(0, HEAD_DIM)[None, :]
    k = tl.load(k16_ptr + slot * stride_s16 + kv_head * stride_h16 + offs_d, mask=is16, other=0.0).to(tl.float32)
    NG: tl.constexpr = HEAD_DIM // G
    grp = offs_d // G
    # int8: codes [PAGE, D] token-major, then scale [PAGE, NG] and zero [PAGE, NG] fp16
    r8 = tl.where(is8, slot - b8, 0)
    blk8 = (r8 // PAGE) * stride_p8 + kv_head * stride_h8  # bytes
    off8 = r8 % PAGE
    c8 = tl.load(k8_ptr + blk8 + off8 * HEAD_DIM + offs_d, mask=is8, other=0)
    s8 = blk8 // 2 + PAGE * HEAD_DIM // 2 + off8 * NG + grp  # [TILE, D], fp16 units
    sc8 = tl.load(h8_ptr + s8, mask=is8, other=0.0).to(tl.float32)
    z8 = tl.load(h8_ptr + s8 + PAGE * NG, mask=is8, other=0.0).to(tl.float32)
    k = tl.where(is8, c8.to(tl.float32) * sc8 + z8, k)
    # int4: codes [PAGE, D/2], byte j = channel j (low nibble) | channel j + D/2 (high nibble)
    HALF: tl.constexpr = HEAD_DIM // 2
    r4 = tl.where(is4, slot - b4, 0)
    blk4 = (r4 // PAGE) * stride_p4 + kv_head * stride_h4
    off4 = r4 % PAGE
    byte = tl.load(k4_ptr + blk4 + off4 * HALF + offs_d % HALF, mask=is4, other=0).to(tl.int32)
    c4 = (byte >> tl.where(offs_d < HALF, 0, 4)) & 0xF
    s4 = blk4 // 2 + PAGE * HALF // 2 + off4 * NG + grp
    sc4 = tl.load(h4_ptr + s4, mask=is4, other=0.0).to(tl.float32)
    z4 = tl.load(h4_ptr + s4 + PAGE * NG, mask=is4, other=0.0).to(tl.float32)
    return tl.where(is4, c4.to(tl.float32) * sc4 + z4, k)


@triton.jit
def _head_logits(q_ptr, head, k, live, qk_scale, HEAD_DIM: tl.constexpr):
    """Masked logits [TILE, 1] (log2 domain) of query head `head` (q_ptr: the row's q [Hq, D])
    against the key tile k [TILE, D]: a broadcast product and a row sum, no tl.dot (a group of 4
    query heads is too small for one, and the fp32 dot's registers spill)."""
    q = tl.load(q_ptr + head * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :]).to(tl.float32)
    s = tl.sum(k * q, 1, keep_dims=True) * qk_scale
    return tl.where(live, s, NEG_BIG)


@triton.jit
def _logits_kernel(q_ptr, rows_ptr, lens_ptr, k16_ptr, k8_ptr, h8_ptr, k4_ptr, h4_ptr, m_ptr, l_ptr, s_ptr,
                   width, b8, b4, qk_scale, stride_qb, stride_r,
                   stride_s16, stride_h16, stride_p8, stride_h8, stride_p4, stride_h4, stride_pb, stride_ph,
                   stride_sb, stride_sh,
                   NUM_KV_HEADS: tl.constexpr, KV_GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, G: tl.constexpr,
                   PAGE: tl.constexpr, TILE: tl.constexpr):
    i = tl.program_id(0)
    tile = tl.program_id(1)
    n_tok = tl.load(lens_ptr + i)
    offs_t = tile * TILE + tl.arange(0, TILE)[:, None]
    slot, live, is16, is8, is4 = _tile_slots(rows_ptr + i * stride_r, n_tok, tile * TILE, b8, b4, TILE)
    for kv_head in tl.range(0, NUM_KV_HEADS, num_stages=1):  # a loop, not unrolled or pipelined: one key tile live
        k = _keys_tile(slot, is16, is8, is4, kv_head, k16_ptr, k8_ptr, h8_ptr, k4_ptr, h4_ptr, b8, b4,
                       stride_s16, stride_h16, stride_p8, stride_h8, stride_p4, stride_h4, HEAD_DIM, G, PAGE)
        for g in tl.static_range(KV_GROUP):
            head = kv_head * KV_GROUP + g
            s = _head_logits(q_ptr + i * stride_qb, head, k, live, qk_scale, HEAD_DIM)
            m = tl.max(tl.max(s, 1), 0)
            l = tl.sum(tl.sum(tl.where(live, tl.exp2(s - m), 0.0), 1), 0)
            at = i * stride_pb + head * stride_ph + tile
            tl.store(m_ptr + at, m)
            tl.store(l_ptr + at, l)
            tl.store(s_ptr + i * stride_sb + head * stride_sh + offs_t, s, mask=offs_t < width)


NUM_WARPS = 8


def launch_constants(hq: int, hkv: int, d: int, group: int, page: int, tile: int) -> dict:
    """The constexprs pool_token_mass launches _logits_kernel with (also what the offline sm_90
    compile test compiles)."""
    return dict(NUM_KV_HEADS=hkv, KV_GROUP=hq // hkv, HEAD_DIM=d, G=group, PAGE=page, TILE=tile)


def _check_int(store: TierPages, tier: int, hkv: int, d: int, group: int, page: int) -> None:
    assert isinstance(store, TierPages) and store.tier == tier, "int stores must be page-head blocks"
    assert store.num_kv_heads == hkv and store.head_dim == d and store.group_size == group and store.page == page
    assert store.k.is_contiguous() and (page * code_width(tier, d)) % 2 == 0


def pool_token_mass(q: torch.Tensor, rows: torch.Tensor, lens: torch.Tensor, k16: torch.Tensor, int8: TierPages,
                    int4: TierPages, b8: int, b4: int, scale: float, out: torch.Tensor, tile: int = 16) -> torch.Tensor:
    """out = max(out, per-key head-max attention probability) (module docstring). No host sync."""
    return pool_token_mass_layers([q], rows, lens, [k16], [int8], [int4], b8, b4, scale, out, tile)


def pool_token_mass_layers(qs: list, rows: torch.Tensor, lens: torch.Tensor, k16s: list, int8s: list, int4s: list,
                           b8: int, b4: int, scale: float, out: torch.Tensor, tile: int = 16) -> torch.Tensor:
    """pool_token_mass of several layers at once (qs[l] against the stores k16s[l], int8s[l],
    int4s[l]): one logits launch per layer into one buffer [L, n, Hq, W], then ONE torch tail
    for all of them: out = max(out, max over layers and heads of p). The same values as one
    pool_token_mass call per layer (a max of maxes), in a third of the launches for two layers."""
    assert len(qs) == len(k16s) == len(int8s) == len(int4s) >= 1
    n, hq, d = qs[0].shape
    assert out.dtype == torch.float32 and out.shape == rows.shape and out.is_contiguous() and rows.shape[0] == n
    assert rows.dtype == torch.int64 and rows.stride(-1) == 1 and lens.shape == (n,)
    width = rows.shape[1]
    if n == 0 or width == 0:
        return out
    tiles = triton.cdiv(width, tile)
    qk_scale = float(scale) * LOG2E
    dev = qs[0].device
    part_m = torch.empty((len(qs), n, hq, tiles), dtype=torch.float32, device=dev)
    part_l = torch.empty_like(part_m)
    logits = torch.empty((len(qs), n, hq, width), dtype=torch.float32, device=dev)
    lens = lens.contiguous()
    for at, (q, k16, int8, int4) in enumerate(zip(qs, k16s, int8s, int4s)):
        _launch_logits(q, rows, lens, k16, int8, int4, b8, b4, qk_scale, part_m[at], part_l[at], logits[at], tile)
    # log2-sum-exp2 per (layer, row, query head) of the tiles' parts (empty tiles: m NEG_BIG, l 0)
    top = part_m.amax(dim=3, keepdim=True)
    lse = top + torch.log2((part_l * torch.exp2(part_m - top)).sum(dim=3, keepdim=True).clamp_min(1e-30))
    # masked logits are NEG_BIG: their probability is 0 (also in a row with no live key)
    p = torch.where(logits > 0.5 * _MASKED, torch.exp2(logits - lse), 0.0).amax(dim=2).amax(dim=0)
    torch.maximum(out, p, out=out)
    return out


def _launch_logits(q, rows, lens, k16, int8: TierPages, int4: TierPages, b8: int, b4: int, qk_scale: float,
                   part_m, part_l, logits, tile: int) -> None:
    """One _logits_kernel launch: the logits [n, Hq, W] and tile parts [n, Hq, T] of one layer."""
    n, hq, d = q.shape
    _, hkv, d16 = k16.shape
    assert d16 == d and hq % hkv == 0 and d & (d - 1) == 0 and d >= 16, (q.shape, k16.shape)
    assert q.is_contiguous() and k16.stride(-1) == 1
    group, page = int8.group_size, int8.page
    _check_int(int8, TIER_INT8, hkv, d, group, page)
    _check_int(int4, TIER_INT4, hkv, d, group, page)
    assert group & (group - 1) == 0 and d % group == 0
    k8, k4 = (x if x.numel() else torch.zeros(2, dtype=torch.uint8, device=q.device) for x in (int8.k, int4.k))
    stores = (k16, k8, k8.view(torch.float16), k4, k4.view(torch.float16))
    strides = (k16.stride(0), k16.stride(1), int8.k.stride(0), int8.k.stride(1), int4.k.stride(0), int4.k.stride(1))
    _logits_kernel[(n, part_m.shape[-1])](q, rows, lens, *stores, part_m, part_l, logits, rows.shape[1], b8, b4,
                                          qk_scale, q.stride(0), rows.stride(0), *strides, part_m.stride(0),
                                          part_m.stride(1), logits.stride(0), logits.stride(1),
                                          **launch_constants(hq, hkv, d, group, page, tile), num_warps=NUM_WARPS)


def pool_token_mass_reference(q, rows, lens, k16, int8: TierPages, int4: TierPages, b8: int, b4: int, scale: float,
                              out: torch.Tensor) -> torch.Tensor:
    """Torch reference of pool_token_mass: the keys gathered and dequantized (tier_codec), one
    masked softmax per row and query head, the max over heads, max-accumulated into out."""
    n, hq, d = q.shape
    hkv = k16.shape[1]
    width = rows.shape[1]
    keys = torch.zeros((n, width, hkv, d), dtype=torch.float32, device=q.device)
    flat = rows.reshape(-1)
    for tier, store, base, end in ((TIER_INT8, int8, b8, b4), (TIER_INT4, int4, b4, None)):
        sel = (flat >= base) & ((flat < end) if end is not None else True)
        if bool(sel.any()):
            r = flat[sel] - base
            page, off = r // store.page, r % store.page
            k = dequantize(store.k_codes[page, :, off], store.k_scale[page, :, off], store.k_zero[page, :, off],
                           8 if tier == TIER_INT8 else 4, store.group_size, torch.float32)
            keys.view(-1, hkv, d)[sel] = k
    sel = (flat > 0) & (flat < b8)
    keys.view(-1, hkv, d)[sel] = k16[flat[sel]].float()
    live = (rows != 0) & (torch.arange(width, device=rows.device)[None, :] < lens.to(rows.device)[:, None])
    group = hq // hkv
    logits = torch.einsum("bkgd,btkd->bkgt", q.float().view(n, hkv, group, d), keys) * scale
    logits = logits.masked_fill(~live[:, None, None, :], -math.inf)
    p = torch.softmax(logits, dim=-1).nan_to_num(0.0).amax(dim=(1, 2))
    return torch.maximum(out, p, out=out)
