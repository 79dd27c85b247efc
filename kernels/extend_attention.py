"""Extend (chunked prefill / radix-hit) attention over a tiered cached prefix + new tokens.

    extend_attention_tiered(q, k_new, v_new, qo_indptr, layer, prefix_tables,
                            sm_scale=None, max_extend_len=None, out=None, tiles=None,
                            max_prefix_len=None, int_tiers=True) -> o

q            [N, Hq, D]  new query tokens of all requests, concatenated (model dtype)
k_new, v_new [N, Hkv, D] the same tokens' K (post-RoPE) / V, attended at full precision
qo_indptr    int32 [B+1] request b owns rows [qo_indptr[b], qo_indptr[b+1])
prefix_tables: TieredBlockTables of the cached PREFIX only (exclude the new tokens even if
             they were already stored into the pool), dense or filled form (paged_layout.py).
layer        TieredKVLayer; each tier has its own page size (any power of two: the engine's
             fp16 store is rows, PAGE 1; its int8 / int4 stores are pages of 16..256)
o            [N, Hq, D]

New token i of a request sees every prefix token (any tier, order-free) and new tokens
0..i (causal). grid = (cdiv(max_extend_len, BLOCK_T), Hkv, B) (BLOCKS_FIRST); a program takes
BLOCK_T new tokens x the KV_GROUP query heads of one kv-head as the rows of one tile
(row r -> token r // BLOCK_G, head r % BLOCK_G), so each prefix page is read once per
kv-head and query block.

Two passes (int_tiers=True): PASS_FP16 attends the fp16 prefix and the new tokens and stores
each row's log2-sum-exp; PASS_INT attends the int8 / int4 prefix and merges it into the
output in place. Only PASS_FP16 reads no dequantized operand, so only it is tuned over 64-128
rows (wgmma); PASS_INT runs at a fixed 32-row config. With int_tiers=False PASS_FP16 is the
only launch.

Prefix walk, per tier (`_attend_prefix_tier`): BLOCK_P virtual slots a step over the listed
pages, virtual slot l = j * PAGE + s (slot s of listed page j):

    PAGE >= BLOCK_P   page j read in BLOCK_P-slot chunks (scalar page id and fill, rows contiguous)
    PAGE <  BLOCK_P   BLOCK_P / PAGE pages gathered per step (PAGE 1: a row gather)
    valid slot        dense: l < n_t          filled: j < num_pages and s < fills[j]

so a partial page anywhere in the list costs masked slots, never a wrong token. The int tiers
are read as paged_layout.py's page-head blocks (K codes token-major, V codes dim-major, scales
behind the codes). With one scale group per token-head (G = D) they skip per-element
dequantization: codes go to tl.dot as exact integers (int4: low nibbles = the first half of the
head dim, high = the second) and the scale / zero are applied per score and per probability
(FOLD, `_attend_prefix_tier`); otherwise each element is dequantized with its group's scale.

Tiled launch (`tiles=(tile_req, tile_blk)`, CUDA-graph prefill): grid = (len(tile_req), Hkv)
and program t takes block tile_blk[t] of request tile_req[t], at the fixed config
GRAPH_CONFIG (BLOCK_T = graph_block_tokens(kv_group) new tokens per tile; build_tiles lists
them). The grid then depends on the tile buffer's length alone, not on the batch; spare tiles
name a request with no new tokens and return at once.
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import torch
import triton
import triton.language as tl

from ._split_k import LOG2E, NEG_BIG, _softmax_step
from ._tiles import _u8_to_f16, is_interpret, next_pow2
from .paged_layout import TieredBlockTables, TieredKVLayer, gather_request_kv
from .tuned_launch import TunedLauncher

# Prefix slots per loop step (BLOCK_P), any tier: a page of PAGE >= BLOCK_P is read in BLOCK_P-slot
# chunks, smaller pages (the fp16 rows at PAGE 1, int pages of 16-32) are gathered BLOCK_P / PAGE
# pages a step. 64 is what the kernel read per step at the pure-fp16 pool's PAGE 64 before.
PREFIX_TILE = 64
# The launch's passes (constexpr PASS of _extend_kernel):
PASS_ALL = 0  # every tier + the new tokens in one program (the tiled launch)
PASS_FP16 = 1  # the fp16 prefix + the new tokens; writes the rows' log2-sum-exp when asked
PASS_INT = 2  # the int8 / int4 prefix alone, merged in place into PASS_FP16's output by its lse
if is_interpret():
    _FP16_CONFIGS = [triton.Config({"BLOCK_ROWS": 16, "BLOCK_N": 16, "BLOCK_P": 16}, num_warps=4, num_stages=1)]
else:
    # NOTE: BLOCK_ROWS < 64 keeps tl.dot on mma.sync. With 64+ rows Triton 3.6 picks wgmma
    # and its TritonGPUOptimizeDotOperands pass crashes on the reshape/join-fed (dequantized)
    # K operand (seen on H200, 2026-11); revisit with a newer Triton or a staged fp16 copy.
    # So only PASS_FP16, which reads no int tier, is tuned over 64-128 rows (16-32 new tokens x
    # the query heads of one kv head: each prefix tile read 2-4x less often than at 32 rows),
    # with two 32-row configs as fallbacks.
    _FP16_CONFIGS = [
        triton.Config({"BLOCK_ROWS": r, "BLOCK_N": n, "BLOCK_P": p}, num_warps=w, num_stages=s)
        for r, n, p, w, s in ((128, 64, 64, 8, 2), (128, 64, 64, 4, 3), (128, 64, 128, 8, 2),
                              (64, 64, 64, 4, 3), (32, 32, 64, 2, 3), (32, 64, 64, 4, 3))
    ]
# Grid order of the untiled launch: (query blocks, kv heads, requests) when True, so the programs
# resident at once are mostly one request's query blocks of a few kv heads, walking the same
# prefix tiles together (L2 hits); (requests, kv heads, query blocks) when False. A module value
# (benchmarks/kernels/extend_prefix.py compares both), part of the tuning key.
BLOCKS_FIRST = True
# The tiled (graph) launch's config: the host builds tiles for its BLOCK_ROWS, so it is not tuned.
GRAPH_CONFIG = (dict(BLOCK_ROWS=16, BLOCK_N=16, BLOCK_P=16, num_warps=4, num_stages=1) if is_interpret()
                else dict(BLOCK_ROWS=32, BLOCK_N=64, BLOCK_P=PREFIX_TILE, num_warps=4, num_stages=2))
# PASS_INT's config, fixed: it merges into its output in place, so it cannot be autotuned (the
# autotuner's timing runs would merge again and again). BLOCK_N is unused there.
INT_PASS_CONFIG = GRAPH_CONFIG


def graph_block_tokens(kv_group: int) -> int:
    """New tokens per tile of the tiled launch (GRAPH_CONFIG rows over next_pow2(kv_group) heads)."""
    return max(1, GRAPH_CONFIG["BLOCK_ROWS"] // next_pow2(kv_group))


def max_tiles(num_tokens: int, num_reqs: int, block_tokens: int) -> int:
    """Tiles any batch of <= num_tokens new tokens over <= num_reqs requests needs: each request
    has at most one partial tile."""
    return -(-num_tokens // block_tokens) + num_reqs


def build_tiles(extend_lens, block_tokens: int, num_tiles: int, spare_req: int):
    """(tile_req, tile_blk) int32 numpy arrays of length num_tiles: every block of every request,
    deepest blocks first (a block's causal work grows with its index, so the long ones start
    first), then spare tiles (spare_req, 0), where spare_req must have no new tokens."""
    import numpy as np

    lens = np.asarray(extend_lens, dtype=np.int64)
    per_req = -(-lens // block_tokens)
    total = int(per_req.sum())
    assert total <= num_tiles, (total, num_tiles)
    req = np.repeat(np.arange(len(lens), dtype=np.int32), per_req)
    first = np.repeat(np.cumsum(per_req) - per_req, per_req)
    blk = (np.arange(total) - first).astype(np.int32)
    order = np.argsort(-blk, kind="stable")
    tile_req = np.full(num_tiles, spare_req, dtype=np.int32)
    tile_blk = np.zeros(num_tiles, dtype=np.int32)
    tile_req[:total], tile_blk[:total] = req[order], blk[order]
    return tile_req, tile_blk


@triton.jit
def _prefix_slots(bt_row_ptr, fill_row_ptr, n_tok, n_pages, l0, offs,
                  PAGE: tl.constexpr, TILE: tl.constexpr, FILLED: tl.constexpr):
    """The TILE virtual slots [l0, l0 + TILE) of one tier's listed pages (virtual slot
    l = j * PAGE + s: slot s of listed page j) -> (page int64, slot s, tmask), each [TILE].

        PAGE >= TILE   one page per step (page j = l0 // PAGE, slots l0 % PAGE + [0, TILE)):
                       scalar page id and fill, slots contiguous
        PAGE <  TILE   TILE / PAGE pages per step, page id (and fill) gathered per slot;
                       PAGE = 1 is a row gather (the engine's slot-granular fp16 store)

    Valid slots: dense form l < n_tok; filled form j < n_pages and s < fills[j] (each listed
    page holds a prefix of its slots)."""
    if PAGE >= TILE:
        j = l0 // PAGE
        s = l0 % PAGE + offs
        if FILLED:
            fill = tl.load(fill_row_ptr + j, mask=j < n_pages, other=0)
        else:
            fill = n_tok - j * PAGE
        tmask = s < fill
        page = tl.load(bt_row_ptr + j, mask=fill > 0, other=0).to(tl.int64) + offs * 0
    else:
        l = l0 + offs
        j = l // PAGE
        s = l % PAGE
        if FILLED:
            # page ids and fills load side by side (the page load is masked by the listing, not
            # by the fill): no load waits for another; a page id read for a slot past its fill
            # is a listed page's id and is only used under tmask
            live = j < n_pages
            fill = tl.load(fill_row_ptr + j, mask=live, other=0)
            page = tl.load(bt_row_ptr + j, mask=live, other=0).to(tl.int64)
            tmask = s < fill
        else:
            tmask = l < n_tok
            page = tl.load(bt_row_ptr + j, mask=tmask, other=0).to(tl.int64)
    return page, s, tmask


@triton.jit
def _full_codes(kq, TIER: tl.constexpr, TILE: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Raw codes [TILE, W] -> [TILE, HEAD_DIM] exact fp16 integers in channel order (int4: the
    low nibbles are channels [0, D/2), the high ones [D/2, D): tier_codec's split halves)."""
    if TIER == 1:
        return _u8_to_f16(kq)
    else:
        lo = _u8_to_f16(kq & 15)
        hi = _u8_to_f16(kq >> 4)
        return tl.reshape(tl.permute(tl.join(lo, hi), (0, 2, 1)), (TILE, HEAD_DIM))


@triton.jit
def _load_int_tile(data_ptr, half_ptr, blk, s, tmask, offs_d, TIER: tl.constexpr, V_MAJOR: tl.constexpr,
                   PAGE: tl.constexpr, TILE: tl.constexpr, HEAD_DIM: tl.constexpr, GROUP_SIZE: tl.constexpr,
                   FOLD: tl.constexpr):
    """K (V_MAJOR False) or V (True) of TILE slots of an int tier's page-head blocks (blk [TILE]:
    byte offset of each slot's block; paged_layout.py) -> (values [TILE, D] fp16, scale [TILE],
    zero [TILE]). FOLD (G = D): values are the codes (exact integers) and the scale / zero come
    back for the caller to fold; otherwise values dequantized per element (scale, zero then
    unused)."""
    W: tl.constexpr = HEAD_DIM if TIER == 1 else HEAD_DIM // 2
    NG: tl.constexpr = HEAD_DIM // GROUP_SIZE
    offs_c = tl.arange(0, W)
    if V_MAJOR:  # dim-major codes [W, PAGE]
        q = tl.load(data_ptr + blk[:, None] + offs_c[None, :] * PAGE + s[:, None], mask=tmask[:, None], other=0)
    else:
        q = tl.load(data_ptr + blk[:, None] + s[:, None] * W + offs_c[None, :], mask=tmask[:, None], other=0)
    x = _full_codes(q, TIER, TILE, HEAD_DIM)
    srow = blk // 2 + PAGE * W // 2 + s * NG  # fp16 index of the slot's first scale
    if FOLD:
        sc = tl.load(half_ptr + srow, mask=tmask, other=0.0).to(tl.float32)
        zr = tl.load(half_ptr + srow + PAGE * NG, mask=tmask, other=0.0).to(tl.float32)
        return x, sc, zr
    else:
        g = offs_d // GROUP_SIZE
        sc = tl.load(half_ptr + srow[:, None] + g[None, :], mask=tmask[:, None], other=0.0).to(tl.float32)
        zr = tl.load(half_ptr + srow[:, None] + PAGE * NG + g[None, :], mask=tmask[:, None], other=0.0)
        x = (x.to(tl.float32) * sc + zr.to(tl.float32)).to(tl.float16)
        return x, sc, sc


@triton.jit
def _attend_prefix_tier(
    acc, m_i, l_i, q, q_sum, bt_row_ptr, fill_row_ptr, n_tok, n_pages,
    data_k_ptr, data_v_ptr, half_k_ptr, half_v_ptr, stride_p, stride_h, kv_head, qk_scale,
    TIER: tl.constexpr, PAGE: tl.constexpr, TILE: tl.constexpr, HEAD_DIM: tl.constexpr,
    GROUP_SIZE: tl.constexpr, FILLED: tl.constexpr, FOLD: tl.constexpr, DOT_F32: tl.constexpr,
):
    """Online-softmax accumulate all of one tier's cached prefix of a request, TILE virtual
    slots a step (_prefix_slots). fp16: rows of the model dtype. int8 / int4: page-head blocks
    (paged_layout.py); FOLD (G = D): the codes go to tl.dot as exact integers and the per-token
    scale and zero are applied outside the inner products,
        score = ks * (q . codes_k) + kz * sum(q)
        o    += (p * vs) @ codes_v + sum(p * vz)       (per output row, every channel)
    in fp32 (int-tier dots on fp16 operands); G < D: tiles dequantized per element.
    DOT_F32: tl.dot on fp32 operands (the interpreter's bf16 dot is wrong)."""
    offs = tl.arange(0, TILE)
    offs_d = tl.arange(0, HEAD_DIM)
    if FILLED:
        l_end = n_pages * PAGE
    else:
        l_end = n_tok
    for l0 in range(0, l_end, TILE):
        page, s, tm = _prefix_slots(bt_row_ptr, fill_row_ptr, n_tok, n_pages, l0, offs, PAGE, TILE, FILLED)
        blk = page * stride_p + kv_head * stride_h
        if TIER == 0:
            rows = blk + s.to(tl.int64) * HEAD_DIM
            k = tl.load(data_k_ptr + rows[:, None] + offs_d[None, :], mask=tm[:, None], other=0.0)
            v = tl.load(data_v_ptr + rows[:, None] + offs_d[None, :], mask=tm[:, None], other=0.0)
            if DOT_F32:
                acc, m_i, l_i = _softmax_step(acc, m_i, l_i, q.to(tl.float32), k.to(tl.float32),
                                              v.to(tl.float32), tm, qk_scale)
            else:
                acc, m_i, l_i = _softmax_step(acc, m_i, l_i, q, k, v, tm, qk_scale)
        else:
            k, ks, kz = _load_int_tile(data_k_ptr, half_k_ptr, blk, s, tm, offs_d, TIER, False, PAGE, TILE,
                                       HEAD_DIM, GROUP_SIZE, FOLD)
            v, vs, vz = _load_int_tile(data_v_ptr, half_v_ptr, blk, s, tm, offs_d, TIER, True, PAGE, TILE,
                                       HEAD_DIM, GROUP_SIZE, FOLD)
            if DOT_F32:
                qd = q.to(tl.float32)
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            else:
                qd = q.to(tl.float16)
            if FOLD:
                qk = tl.dot(qd, tl.trans(k))
                sc = (qk * ks[None, :] + q_sum[:, None] * kz[None, :]) * qk_scale
                sc = tl.where(tm[None, :], sc, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(sc, 1))
                alpha = tl.exp2(m_i - m_new)
                pr = tl.exp2(sc - m_new[:, None])
                l_i = l_i * alpha + tl.sum(pr, 1)
                pv = tl.dot((pr * vs[None, :]).to(v.dtype), v) + tl.sum(pr * vz[None, :], 1)[:, None]
                acc = acc * alpha[:, None] + pv
                m_i = m_new
            else:
                acc, m_i, l_i = _softmax_step(acc, m_i, l_i, qd, k, v, tm, qk_scale)
    return acc, m_i, l_i


def prefix_bucket(max_prefix_len: Optional[int]) -> int:
    """The autotuner's bucket for a launch whose longest cached prefix is `max_prefix_len` tokens:
    0 for none (or not given), else its next power of two, clamped to [1024, 32768]. A prompt's
    first chunk reads no prefix and a chunk deep in a long prompt mostly its prefix; the config
    fastest for one is not for the other, and a key without the bucket keeps whichever the first
    launch (a warm-up's first chunk) tuned. Each bucket is tuned at its first launch."""
    if not max_prefix_len or max_prefix_len <= 0:
        return 0
    return min(max(next_pow2(int(max_prefix_len)), 1024), 32768)


@triton.jit
def _extend_kernel(
    q_ptr, kn_ptr, vn_ptr, o_ptr, lse_ptr, qo_indptr_ptr, tile_req_ptr, tile_blk_ptr,
    k16_ptr, v16_ptr,
    k8_ptr, v8_ptr, h8k_ptr, h8v_ptr,
    k4_ptr, v4_ptr, h4k_ptr, h4v_ptr,
    bt16_ptr, bt8_ptr, bt4_ptr, len16_ptr, len8_ptr, len4_ptr,
    fill16_ptr, fill8_ptr, fill4_ptr, npg16_ptr, npg8_ptr, npg4_ptr,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_on, stride_oh,
    stride_bt16, stride_bt8, stride_bt4, stride_f16, stride_f8, stride_f4,
    stride_p16, stride_h16, stride_p8, stride_h8, stride_p4, stride_h4,
    qk_scale, PREFIX_BUCKET,  # PREFIX_BUCKET: the autotuner's key only (prefix_bucket), unused here
    KV_GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr, GROUP_SIZE: tl.constexpr,
    PAGE16: tl.constexpr, PAGE8: tl.constexpr, PAGE4: tl.constexpr, FILLED: tl.constexpr,
    FOLD: tl.constexpr, DOT_F32: tl.constexpr,
    BLOCK_ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr, TILED: tl.constexpr,
    PASS: tl.constexpr, WRITE_LSE: tl.constexpr, BLOCKS_FIRST: tl.constexpr,
):
    """PASS_ALL: o = attention over every tier of the prefix and the causal new tokens.
    PASS_FP16: the same over the fp16 prefix and the new tokens only (int tiers not read, so no
    dequantized dot operand: the 64+-row configs compile); WRITE_LSE stores each row's
    log2-sum-exp in lse [N, Hq] fp32. PASS_INT: the int8 / int4 prefix only, merged into o by
    that lse: o = (2^lse o + 2^lse_int o_int) / (2^lse + 2^lse_int); a request without int
    tokens returns at once and keeps PASS_FP16's o."""
    if TILED:
        tile = tl.program_id(0)
        b = tl.load(tile_req_ptr + tile)
        blk = tl.load(tile_blk_ptr + tile)
    elif BLOCKS_FIRST:
        b = tl.program_id(2)
        blk = tl.program_id(0)
    else:
        b = tl.program_id(0)
        blk = tl.program_id(2)
    kv_head = tl.program_id(1)
    BLOCK_T: tl.constexpr = BLOCK_ROWS // BLOCK_G  # new tokens per program
    q_start = tl.load(qo_indptr_ptr + b)
    n_new = tl.load(qo_indptr_ptr + b + 1) - q_start
    if blk * BLOCK_T >= n_new:
        return
    npg16 = tl.load(npg16_ptr + b)  # listed pages (filled form; the dense form passes lens, unused)
    npg8 = tl.load(npg8_ptr + b)
    npg4 = tl.load(npg4_ptr + b)
    if PASS == 2:
        if FILLED:
            no_int = npg8 + npg4 == 0
        else:
            no_int = tl.load(len8_ptr + b) + tl.load(len4_ptr + b) == 0
        if no_int:
            return

    offs_r = tl.arange(0, BLOCK_ROWS)
    offs_d = tl.arange(0, HEAD_DIM)
    tok = blk * BLOCK_T + offs_r // BLOCK_G  # index among the request's new tokens
    g = offs_r % BLOCK_G
    rmask = (tok < n_new) & (g < KV_GROUP)
    head = kv_head * KV_GROUP + g
    row_q = (q_start + tok).to(tl.int64) * stride_qn + head * stride_qh
    q = tl.load(q_ptr + row_q[:, None] + offs_d[None, :], mask=rmask[:, None], other=0.0)
    if FOLD and PASS != 1:
        q_sum = tl.sum(q.to(tl.float32), 1)  # the zero-point term of every int-tier score
    else:
        q_sum = tl.zeros([BLOCK_ROWS], dtype=tl.float32)  # unused

    acc = tl.zeros([BLOCK_ROWS, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([BLOCK_ROWS], NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_ROWS], dtype=tl.float32)

    # ---- cached prefix: its tiers of this pass, every listed page (non-causal: all precede the
    # new tokens)
    if PASS != 2:
        acc, m_i, l_i = _attend_prefix_tier(
            acc, m_i, l_i, q, q_sum, bt16_ptr + b * stride_bt16, fill16_ptr + b * stride_f16,
            tl.load(len16_ptr + b), npg16,
            k16_ptr, v16_ptr, k16_ptr, k16_ptr, stride_p16, stride_h16, kv_head, qk_scale,
            0, PAGE16, BLOCK_P, HEAD_DIM, GROUP_SIZE, FILLED, FOLD, DOT_F32)
    if PASS != 1:
        acc, m_i, l_i = _attend_prefix_tier(
            acc, m_i, l_i, q, q_sum, bt8_ptr + b * stride_bt8, fill8_ptr + b * stride_f8,
            tl.load(len8_ptr + b), npg8,
            k8_ptr, v8_ptr, h8k_ptr, h8v_ptr, stride_p8, stride_h8, kv_head, qk_scale,
            1, PAGE8, BLOCK_P, HEAD_DIM, GROUP_SIZE, FILLED, FOLD, DOT_F32)
        acc, m_i, l_i = _attend_prefix_tier(
            acc, m_i, l_i, q, q_sum, bt4_ptr + b * stride_bt4, fill4_ptr + b * stride_f4,
            tl.load(len4_ptr + b), npg4,
            k4_ptr, v4_ptr, h4k_ptr, h4v_ptr, stride_p4, stride_h4, kv_head, qk_scale,
            2, PAGE4, BLOCK_P, HEAD_DIM, GROUP_SIZE, FILLED, FOLD, DOT_F32)

    row_o = (q_start + tok).to(tl.int64) * stride_on + head * stride_oh
    if PASS == 2:  # merge with PASS_FP16's rows (every row of this request sees its int tokens)
        row_l = (q_start + tok).to(tl.int64) * (KV_GROUP * tl.num_programs(1)) + head
        lse16 = tl.load(lse_ptr + row_l, mask=rmask, other=0.0)
        o16 = tl.load(o_ptr + row_o[:, None] + offs_d[None, :], mask=rmask[:, None], other=0.0).to(tl.float32)
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        lse_int = tl.where(l_i > 0, m_i + tl.log2(l_safe), NEG_BIG)
        m_both = tl.maximum(lse16, lse_int)
        w16 = tl.exp2(lse16 - m_both)
        w_int = tl.exp2(lse_int - m_both)
        o = (o16 * w16[:, None] + (acc / l_safe[:, None]) * w_int[:, None]) / (w16 + w_int)[:, None]
        tl.store(o_ptr + row_o[:, None] + offs_d[None, :], o.to(o_ptr.dtype.element_ty), mask=rmask[:, None])
        return

    # ---- new tokens, causal: row token i sees new tokens j <= i
    offs_n = tl.arange(0, BLOCK_N)
    n_hi = tl.minimum(n_new, (blk + 1) * BLOCK_T)
    for j0 in range(0, n_hi, BLOCK_N):
        j = j0 + offs_n
        jmask = j < n_new
        row_k = (q_start + j).to(tl.int64) * stride_kn + kv_head * stride_kh
        k = tl.load(kn_ptr + row_k[:, None] + offs_d[None, :], mask=jmask[:, None], other=0.0)
        v = tl.load(vn_ptr + row_k[:, None] + offs_d[None, :], mask=jmask[:, None], other=0.0)
        if DOT_F32:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32))) * qk_scale
        else:
            s = tl.dot(q, tl.trans(k)) * qk_scale
        s = tl.where(jmask[None, :] & (j[None, :] <= tok[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        pr = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(pr, 1)
        if DOT_F32:
            acc = acc * alpha[:, None] + tl.dot(pr, v.to(tl.float32))
        else:
            acc = acc * alpha[:, None] + tl.dot(pr.to(v.dtype), v)
        m_i = m_new

    o = acc / l_i[:, None]
    tl.store(o_ptr + row_o[:, None] + offs_d[None, :], o.to(o_ptr.dtype.element_ty),
             mask=rmask[:, None])
    if WRITE_LSE:  # l_i > 0: a row always sees its own token
        row_l = (q_start + tok).to(tl.int64) * (KV_GROUP * tl.num_programs(1)) + head
        tl.store(lse_ptr + row_l, m_i + tl.log2(l_i), mask=rmask)


_TUNE_KEY = ["HEAD_DIM", "PAGE16", "PAGE8", "PAGE4", "BLOCK_G", "GROUP_SIZE", "FILLED", "FOLD", "DOT_F32",
             "PREFIX_BUCKET", "PASS", "WRITE_LSE", "BLOCKS_FIRST"]
# PASS_FP16's launches go through the autotuner (TunedLauncher); PASS_ALL and PASS_INT run at
# fixed configs (_launch_fixed).
_extend_fp16_kernel = triton.autotune(configs=_FP16_CONFIGS, key=_TUNE_KEY)(_extend_kernel)


def extend_attention_tiered(
    q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, qo_indptr: torch.Tensor,
    layer: TieredKVLayer, prefix_tables: TieredBlockTables, sm_scale: Optional[float] = None,
    max_extend_len: Optional[int] = None, out: Optional[torch.Tensor] = None, check: bool = True,
    tiles: Optional[tuple[torch.Tensor, torch.Tensor]] = None, fold_scales: bool = True,
    max_prefix_len: Optional[int] = None, int_tiers: bool = True,
) -> torch.Tensor:
    """check=False skips the layout checks of `layer` and `prefix_tables` (callers that
    checked them once, e.g. an attention backend running many layers over one batch).
    tiles: (tile_req, tile_blk) int32 device tensors from build_tiles: the tiled launch (module
    doc), which reads no host value of the batch (max_extend_len is then unused).
    Tiers may have different page sizes (any power of two, 1 included); prefix_tables may be in
    the dense or the filled form (paged_layout.py). fold_scales (G = D only): apply the int
    tiers' per-token scale / zero outside the inner products (see _prefix_step).
    max_prefix_len: the batch's longest cached prefix, a host integer the scheduler knows: the
    launch is tuned per prefix_bucket of it (None: bucket 0, as a batch without a prefix).
    int_tiers: whether the prefix may hold int8 / int4 tokens. False (the paged fp16 pool, or a
    caller that knows every prefix is fp16; check=True verifies it): one PASS_FP16 launch at its
    wgmma-sized configs. True: PASS_FP16 over the fp16 prefix and the new tokens, then PASS_INT
    merging the int tiers in (its programs return at once for a request without int tokens).
    The tiled launch is always one PASS_ALL launch."""
    if check:
        layer.check(uniform=False)
    N, Hq, D = q.shape
    Hkv = layer.num_kv_heads
    pages = tuple(layer.page_size_of(t) for t in range(3))
    assert q.dtype == k_new.dtype == v_new.dtype == layer.dtype and D == layer.head_dim
    assert k_new.shape == v_new.shape == (N, Hkv, D), (k_new.shape, (N, Hkv, D))
    assert q.stride(-1) == 1 and k_new.stride(-1) == 1 and v_new.stride() == k_new.stride()
    assert Hq % Hkv == 0 and D >= 16 and D & (D - 1) == 0
    assert all(p >= 1 and p & (p - 1) == 0 for p in pages), pages
    assert qo_indptr.dtype == torch.int32 and qo_indptr.is_contiguous()
    B = qo_indptr.shape[0] - 1
    if check:
        prefix_tables.check(pages[0])
    assert prefix_tables.batch_size == B
    if max_extend_len is None and tiles is None:  # host sync; pass it in from the scheduler to avoid one
        max_extend_len = int((qo_indptr[1:] - qo_indptr[:-1]).max()) if B > 0 else 0
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.stride(-1) == 1
    if N == 0 or (tiles is None and max_extend_len == 0):
        return out
    sm_scale = 1.0 / math.sqrt(D) if sm_scale is None else sm_scale
    kv_group = Hq // Hkv
    block_g = next_pow2(kv_group)
    f16, i8, i4 = layer.pages
    bt, ln = prefix_tables.tables, prefix_tables.lens
    filled = prefix_tables.filled
    fills, npg = (prefix_tables.fills, prefix_tables.num_pages) if filled else (bt, ln)
    fold = fold_scales and layer.group_size == D
    dot_f32 = is_interpret() and q.dtype == torch.bfloat16

    if check and not int_tiers:  # (a host sync: callers on the hot path pass check=False)
        counts = (npg[1], npg[2]) if filled else (ln[1], ln[2])
        if any(bool((c[:B] != 0).any()) for c in counts):
            raise ValueError("int_tiers=False, but the prefix tables list int8 / int4 tokens")

    blocks_first = BLOCKS_FIRST

    def grid(meta):
        blocks = triton.cdiv(max_extend_len, max(1, meta["BLOCK_ROWS"] // block_g))
        return (blocks, Hkv, B) if blocks_first else (B, Hkv, blocks)

    bucket = prefix_bucket(max_prefix_len) if tiles is None else 0
    lse = qo_indptr  # a placeholder pointer unless PASS_FP16 writes the rows' lse for PASS_INT
    if tiles is not None:
        assert block_g <= GRAPH_CONFIG["BLOCK_ROWS"], "the tiled launch needs kv_group <= its BLOCK_ROWS"
        assert tiles[0].dtype == tiles[1].dtype == torch.int32 and tiles[0].shape == tiles[1].shape
        launches = [(functools.partial(_launch_fixed, (tiles[0].shape[0], Hkv), GRAPH_CONFIG), PASS_ALL)]
        tile_args = tiles
    else:
        if int_tiers:
            lse = torch.empty((N, Hq), dtype=torch.float32, device=q.device)
        # the autotuner's key: its key arguments and every tensor argument's dtype
        tune_key = (D, pages, block_g, layer.group_size, filled, dot_f32, fold, bucket, int_tiers, blocks_first,
                    q.dtype, k_new.dtype, out.dtype, lse.dtype, qo_indptr.dtype, f16.k.dtype, i8.k.dtype,
                    i4.k.dtype, bt[0].dtype, bt[1].dtype, bt[2].dtype, ln[0].dtype, ln[1].dtype, ln[2].dtype,
                    fills[0].dtype, npg[0].dtype)
        launches = [(functools.partial(_launch_fp16, tune_key, grid), PASS_FP16)]
        if int_tiers:
            fixed = grid(INT_PASS_CONFIG)
            launches.append((functools.partial(_launch_fixed, fixed, INT_PASS_CONFIG), PASS_INT))
        tile_args = (qo_indptr, qo_indptr)
    args = (q, k_new, v_new, out, lse, qo_indptr, *tile_args,
            f16.k, f16.v,
            i8.k, i8.v, i8.k.view(torch.float16), i8.v.view(torch.float16),
            i4.k, i4.v, i4.k.view(torch.float16), i4.v.view(torch.float16),
            bt[0], bt[1], bt[2], ln[0], ln[1], ln[2],
            fills[0], fills[1], fills[2], npg[0], npg[1], npg[2],
            q.stride(0), q.stride(1), k_new.stride(0), k_new.stride(1),
            out.stride(0), out.stride(1),
            bt[0].stride(0), bt[1].stride(0), bt[2].stride(0),
            fills[0].stride(0), fills[1].stride(0), fills[2].stride(0),
            f16.k.stride(0), f16.k.stride(1), i8.k.stride(0), i8.k.stride(1),
            i4.k.stride(0), i4.k.stride(1),
            sm_scale * LOG2E, bucket)
    constexprs = dict(KV_GROUP=kv_group, BLOCK_G=block_g, HEAD_DIM=D, GROUP_SIZE=layer.group_size,
                      PAGE16=pages[0], PAGE8=pages[1], PAGE4=pages[2], FILLED=filled, FOLD=fold,
                      DOT_F32=dot_f32, TILED=tiles is not None, BLOCKS_FIRST=blocks_first)
    for launch, pass_ in launches:  # in order on one stream: PASS_INT reads PASS_FP16's o and lse
        launch(*args, **constexprs, PASS=pass_, WRITE_LSE=pass_ == PASS_FP16 and int_tiers)
    return out


_launch_fp16 = TunedLauncher(_extend_fp16_kernel)


def _launch_fixed(grid, config, *args, **kwargs) -> None:
    """A launch at a fixed config, past the autotuner: the tiled launch (its tiles are built for
    GRAPH_CONFIG) and PASS_INT (in place: INT_PASS_CONFIG)."""
    _extend_kernel[grid](*args, **kwargs, **config)


def extend_attention_tiered_reference(q, k_new, v_new, qo_indptr, layer: TieredKVLayer,
                                      prefix_tables: TieredBlockTables, sm_scale=None):
    """Torch reference: dequantized prefix + fp16 new tokens, causal over the new ones, fp32."""
    N, Hq, D = q.shape
    sm_scale = 1.0 / math.sqrt(D) if sm_scale is None else sm_scale
    group = Hq // layer.num_kv_heads
    out = torch.zeros_like(q, dtype=torch.float32)
    for b in range(qo_indptr.shape[0] - 1):
        lo, hi = int(qo_indptr[b]), int(qo_indptr[b + 1])
        if hi == lo:
            continue
        kp, vp = gather_request_kv(layer, prefix_tables, b)
        k = torch.cat([kp, k_new[lo:hi].float()]).repeat_interleave(group, dim=1)
        v = torch.cat([vp, v_new[lo:hi].float()]).repeat_interleave(group, dim=1)
        n_pre, n = kp.shape[0], hi - lo
        s = torch.einsum("ihd,jhd->hij", q[lo:hi].float(), k) * sm_scale
        mask = torch.ones(n, n_pre + n, dtype=torch.bool, device=q.device)
        mask[:, n_pre:] = torch.tril(mask[:, n_pre:])
        s = s.masked_fill(~mask, float("-inf"))
        out[lo:hi] = torch.einsum("hij,jhd->ihd", s.softmax(-1), v)
    return out.to(q.dtype)
