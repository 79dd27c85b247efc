"""Extend (chunked prefill / radix-hit) attention over a tiered cached prefix + new tokens.

    extend_attention_tiered(q, k_new, v_new, qo_indptr, layer, prefix_tables,
                            sm_scale=None, max_extend_len=None, out=None, tiles=None) -> o

q            [N, Hq, D]  new query tokens of all requests, concatenated (model dtype)
k_new, v_new [N, Hkv, D] the same tokens' K (post-RoPE) / V, attended at full precision
qo_indptr    int32 [B+1] request b owns rows [qo_indptr[b], qo_indptr[b+1])
prefix_tables: TieredBlockTables of the cached PREFIX only (exclude the new tokens even if
             they were already stored into the pool), dense or filled form (paged_layout.py).
layer        TieredKVLayer; each tier has its own page size (any power of two: the engine's
             fp16 store is rows, PAGE 1; its int8 / int4 stores are pages of 16..256)
o            [N, Hq, D]

New token i of a request sees every prefix token (any tier, order-free) and new tokens
0..i (causal). grid = (B, Hkv, cdiv(max_extend_len, BLOCK_T)); a program takes BLOCK_T new
tokens x the KV_GROUP query heads of one kv-head as the rows of one tile
(row r -> token r // BLOCK_G, head r % BLOCK_G), so each prefix page is read once per
kv-head and query block.

Prefix walk, per tier (`_attend_prefix_tier`): BLOCK_P virtual slots a step over the listed
pages, virtual slot l = j * PAGE + s (slot s of listed page j):

    PAGE >= BLOCK_P   page j read in BLOCK_P-slot chunks (scalar page id and fill, rows contiguous)
    PAGE <  BLOCK_P   BLOCK_P / PAGE pages gathered per step (PAGE 1: a row gather)
    valid slot        dense: l < n_t          filled: j < num_pages and s < fills[j]

so a partial page anywhere in the list costs masked slots, never a wrong token. Quantized tiers
prefetch the next step's raw bytes into registers. With one scale group per token-head (G = D)
the int tiers skip per-element dequantization: codes go to tl.dot as exact integers and the
scale / zero are applied per score and per probability (`_prefix_step`, FOLD); otherwise the
tile is dequantized in registers (_tiles._dequant_tile, fast path) as the decode kernels do.

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

from ._tiles import _dequant_tile, _load_rows_raw, _u8_to_f16, is_interpret, next_pow2
from .decode_attention import LOG2E, NEG_BIG, _softmax_step
from .paged_layout import TieredBlockTables, TieredKVLayer, gather_request_kv
from .tuned_launch import TunedLauncher

# Prefix slots per loop step (BLOCK_P), any tier: a page of PAGE >= BLOCK_P is read in BLOCK_P-slot
# chunks, smaller pages (the fp16 rows at PAGE 1, int pages of 16-32) are gathered BLOCK_P / PAGE
# pages a step. 64 is what the kernel read per step at the pure-fp16 pool's PAGE 64 before.
PREFIX_TILE = 64
if is_interpret():
    _EXTEND_CONFIGS = [triton.Config({"BLOCK_ROWS": 16, "BLOCK_N": 16, "BLOCK_P": 16}, num_warps=4, num_stages=1)]
else:
    # NOTE: BLOCK_ROWS < 64 keeps tl.dot on mma.sync. With 64+ rows Triton 3.6 picks wgmma
    # and its TritonGPUOptimizeDotOperands pass crashes on the reshape/join-fed (dequantized)
    # K operand (seen on H200, 2026-11); revisit with a newer Triton or a staged fp16 copy.
    _EXTEND_CONFIGS = [
        triton.Config({"BLOCK_ROWS": r, "BLOCK_N": n, "BLOCK_P": PREFIX_TILE}, num_warps=w, num_stages=s)
        for r, n, w, s in ((32, 64, 4, 2), (32, 32, 2, 3), (16, 64, 2, 2), (32, 64, 4, 3))
    ]
# The tiled (graph) launch's config: the host builds tiles for its BLOCK_ROWS, so it is not tuned.
GRAPH_CONFIG = (dict(BLOCK_ROWS=16, BLOCK_N=16, BLOCK_P=16, num_warps=4, num_stages=1) if is_interpret()
                else dict(BLOCK_ROWS=32, BLOCK_N=64, BLOCK_P=PREFIX_TILE, num_warps=4, num_stages=2))


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
def _codes_tile(c, OUT_DTYPE: tl.constexpr, TIER: tl.constexpr, TILE: tl.constexpr,
                HEAD_DIM: tl.constexpr):
    """Raw codes [TILE, 1, W] uint8 (one scale group per row, G = D) -> [TILE, HEAD_DIM] codes as
    exact OUT_DTYPE integers (0..255 are exact in fp16 and bf16); int4: low nibble = even channel."""
    if TIER == 1:
        return tl.reshape(_u8_to_f16(c), (TILE, HEAD_DIM)).to(OUT_DTYPE)
    else:
        x = tl.join(_u8_to_f16(c & 15), _u8_to_f16(c >> 4))  # [TILE, 1, D/2, 2]
        return tl.reshape(x, (TILE, HEAD_DIM)).to(OUT_DTYPE)


@triton.jit
def _prefix_slots(bt_row_ptr, fill_row_ptr, n_tok, n_pages, l0, offs,
                  stride_p, stride_h, stride_sp, stride_sh, kv_head,
                  PAGE: tl.constexpr, TILE: tl.constexpr, W: tl.constexpr, NG: tl.constexpr,
                  FILLED: tl.constexpr):
    """Addresses of the TILE virtual slots [l0, l0 + TILE) of one tier's listed pages
    (virtual slot l = j * PAGE + s: slot s of listed page j) -> (row_off, srow_off, tmask).

        PAGE >= TILE   one page per step (page j = l0 // PAGE, slots l0 % PAGE + [0, TILE)):
                       scalar page id and fill, rows contiguous
        PAGE <  TILE   TILE / PAGE pages per step, page id (and fill) gathered per slot;
                       PAGE = 1 is a row gather (the engine's slot-granular fp16 store)

    Valid slots: dense form l < n_tok; filled form j < n_pages and s < fills[j] (each listed
    page holds a prefix of its slots). row_off / srow_off: element offsets of the slot's
    (kv-head) data row [W] and scale row [NG]."""
    if PAGE >= TILE:
        j = l0 // PAGE
        s = l0 % PAGE + offs
        if FILLED:
            fill = tl.load(fill_row_ptr + j, mask=j < n_pages, other=0)
        else:
            fill = n_tok - j * PAGE
        tmask = s < fill
        page = tl.load(bt_row_ptr + j, mask=fill > 0, other=0).to(tl.int64)
    else:
        l = l0 + offs
        j = l // PAGE
        s = l % PAGE
        if FILLED:
            live = j < n_pages
            fill = tl.load(fill_row_ptr + j, mask=live, other=0)
            tmask = s < fill
        else:
            tmask = l < n_tok
        page = tl.load(bt_row_ptr + j, mask=tmask, other=0).to(tl.int64)
    row_off = page * stride_p + kv_head * stride_h + s * W
    srow_off = page * stride_sp + kv_head * stride_sh + s * NG
    return row_off, srow_off, tmask


@triton.jit
def _prefix_step(acc, m_i, l_i, q, q_sum, kq, ks, kz, vq, vs, vz, tmask, qk_scale,
                 TIER: tl.constexpr, TILE: tl.constexpr, HEAD_DIM: tl.constexpr,
                 FOLD: tl.constexpr, DOT_F32: tl.constexpr):
    """One online-softmax step over a tile of raw K/V (from _load_rows_raw).

    FOLD (int tiers, one scale/zero per row: G = D): the codes go to tl.dot as exact integers
    and the per-token scale and zero are applied outside the inner products,
        score = ks * (q . codes_k) + kz * sum(q)
        o    += (p * vs) @ codes_v + sum(p * vz)       (per output row, every channel)
    in fp32, instead of dequantizing every element (q . k is then not rounded through fp16 k).
    Otherwise: dequantize to q's dtype (_dequant_tile, fast path) and a plain step.
    DOT_F32: tl.dot on fp32 operands (the interpreter's bf16 dot is wrong)."""
    if FOLD and TIER != 0:
        if DOT_F32:
            qd = q.to(tl.float32)
            kc = _codes_tile(kq, tl.float32, TIER, TILE, HEAD_DIM)
            vc = _codes_tile(vq, tl.float32, TIER, TILE, HEAD_DIM)
        else:
            qd = q
            kc = _codes_tile(kq, q.dtype, TIER, TILE, HEAD_DIM)
            vc = _codes_tile(vq, q.dtype, TIER, TILE, HEAD_DIM)
        ks1 = tl.reshape(ks, (TILE,)).to(tl.float32)
        kz1 = tl.reshape(kz, (TILE,)).to(tl.float32)
        vs1 = tl.reshape(vs, (TILE,)).to(tl.float32)
        vz1 = tl.reshape(vz, (TILE,)).to(tl.float32)
        qk = tl.dot(qd, tl.trans(kc))
        s = (qk * ks1[None, :] + q_sum[:, None] * kz1[None, :]) * qk_scale
        s = tl.where(tmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        pr = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(pr, 1)
        pv = tl.dot((pr * vs1[None, :]).to(vc.dtype), vc) + tl.sum(pr * vz1[None, :], 1)[:, None]
        acc = acc * alpha[:, None] + pv
        return acc, m_new, l_i
    else:
        k = _dequant_tile(kq, ks, kz, q.dtype, TIER, TILE, HEAD_DIM, True)
        v = _dequant_tile(vq, vs, vz, q.dtype, TIER, TILE, HEAD_DIM, True)
        if DOT_F32:
            return _softmax_step(acc, m_i, l_i, q.to(tl.float32), k.to(tl.float32), v.to(tl.float32),
                                 tmask, qk_scale)
        else:
            return _softmax_step(acc, m_i, l_i, q, k, v, tmask, qk_scale)


@triton.jit
def _attend_prefix_tier(
    acc, m_i, l_i, q, q_sum, bt_row_ptr, fill_row_ptr, n_tok, n_pages,
    data_k_ptr, data_v_ptr, ks_ptr, kz_ptr, vs_ptr, vz_ptr,
    stride_p, stride_h, stride_sp, stride_sh, kv_head, qk_scale,
    TIER: tl.constexpr, PAGE: tl.constexpr, TILE: tl.constexpr, HEAD_DIM: tl.constexpr,
    GROUP_SIZE: tl.constexpr, FILLED: tl.constexpr, FOLD: tl.constexpr, DOT_F32: tl.constexpr,
):
    """Online-softmax accumulate all of one tier's cached prefix of a request, TILE virtual
    slots a step (_prefix_slots). Quantized tiers prefetch: step i+1's raw bytes are loaded
    into registers before step i is dequantized (the table -> data load chain is dependent)."""
    NG: tl.constexpr = HEAD_DIM // GROUP_SIZE
    W: tl.constexpr = HEAD_DIM // 2 if TIER == 2 else HEAD_DIM
    offs = tl.arange(0, TILE)
    if FILLED:
        l_end = n_pages * PAGE
    else:
        l_end = n_tok
    if TIER == 0:
        offs_d = tl.arange(0, HEAD_DIM)
        for l0 in range(0, l_end, TILE):
            ro, so, tm = _prefix_slots(bt_row_ptr, fill_row_ptr, n_tok, n_pages, l0, offs,
                                       stride_p, stride_h, 0, 0, kv_head, PAGE, TILE, W, NG, FILLED)
            k = tl.load(data_k_ptr + ro[:, None] + offs_d[None, :], mask=tm[:, None], other=0.0)
            v = tl.load(data_v_ptr + ro[:, None] + offs_d[None, :], mask=tm[:, None], other=0.0)
            if DOT_F32:
                acc, m_i, l_i = _softmax_step(acc, m_i, l_i, q.to(tl.float32), k.to(tl.float32),
                                              v.to(tl.float32), tm, qk_scale)
            else:
                acc, m_i, l_i = _softmax_step(acc, m_i, l_i, q, k, v, tm, qk_scale)
    else:
        ro, so, tm = _prefix_slots(bt_row_ptr, fill_row_ptr, n_tok, n_pages, 0, offs,
                                   stride_p, stride_h, stride_sp, stride_sh, kv_head, PAGE, TILE, W, NG, FILLED)
        kq, ks, kz = _load_rows_raw(data_k_ptr, ks_ptr, kz_ptr, ro, so, tm, TIER, HEAD_DIM, GROUP_SIZE)
        vq, vs, vz = _load_rows_raw(data_v_ptr, vs_ptr, vz_ptr, ro, so, tm, TIER, HEAD_DIM, GROUP_SIZE)
        for l0 in range(0, l_end, TILE):
            ro_n, so_n, tm_n = _prefix_slots(bt_row_ptr, fill_row_ptr, n_tok, n_pages, l0 + TILE, offs,
                                             stride_p, stride_h, stride_sp, stride_sh, kv_head,
                                             PAGE, TILE, W, NG, FILLED)
            kq_n, ks_n, kz_n = _load_rows_raw(data_k_ptr, ks_ptr, kz_ptr, ro_n, so_n, tm_n,
                                              TIER, HEAD_DIM, GROUP_SIZE)
            vq_n, vs_n, vz_n = _load_rows_raw(data_v_ptr, vs_ptr, vz_ptr, ro_n, so_n, tm_n,
                                              TIER, HEAD_DIM, GROUP_SIZE)
            acc, m_i, l_i = _prefix_step(acc, m_i, l_i, q, q_sum, kq, ks, kz, vq, vs, vz, tm, qk_scale,
                                         TIER, TILE, HEAD_DIM, FOLD, DOT_F32)
            kq, ks, kz, vq, vs, vz, tm = kq_n, ks_n, kz_n, vq_n, vs_n, vz_n, tm_n
    return acc, m_i, l_i


@triton.autotune(configs=_EXTEND_CONFIGS,
                 key=["HEAD_DIM", "PAGE16", "PAGE8", "PAGE4", "BLOCK_G", "GROUP_SIZE", "FILLED", "FOLD", "DOT_F32"])
@triton.jit
def _extend_tiered_kernel(
    q_ptr, kn_ptr, vn_ptr, o_ptr, qo_indptr_ptr, tile_req_ptr, tile_blk_ptr,
    k16_ptr, v16_ptr,
    k8_ptr, v8_ptr, k8s_ptr, k8z_ptr, v8s_ptr, v8z_ptr,
    k4_ptr, v4_ptr, k4s_ptr, k4z_ptr, v4s_ptr, v4z_ptr,
    bt16_ptr, bt8_ptr, bt4_ptr, len16_ptr, len8_ptr, len4_ptr,
    fill16_ptr, fill8_ptr, fill4_ptr, npg16_ptr, npg8_ptr, npg4_ptr,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_on, stride_oh,
    stride_bt16, stride_bt8, stride_bt4, stride_f16, stride_f8, stride_f4,
    stride_p16, stride_h16, stride_p8, stride_h8, stride_p4, stride_h4,
    stride_sp8, stride_sh8, stride_sp4, stride_sh4,
    qk_scale,
    KV_GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr, GROUP_SIZE: tl.constexpr,
    PAGE16: tl.constexpr, PAGE8: tl.constexpr, PAGE4: tl.constexpr, FILLED: tl.constexpr,
    FOLD: tl.constexpr, DOT_F32: tl.constexpr,
    BLOCK_ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr, TILED: tl.constexpr,
):
    if TILED:
        tile = tl.program_id(0)
        b = tl.load(tile_req_ptr + tile)
        blk = tl.load(tile_blk_ptr + tile)
    else:
        b = tl.program_id(0)
        blk = tl.program_id(2)
    kv_head = tl.program_id(1)
    BLOCK_T: tl.constexpr = BLOCK_ROWS // BLOCK_G  # new tokens per program
    q_start = tl.load(qo_indptr_ptr + b)
    n_new = tl.load(qo_indptr_ptr + b + 1) - q_start
    if blk * BLOCK_T >= n_new:
        return

    offs_r = tl.arange(0, BLOCK_ROWS)
    offs_d = tl.arange(0, HEAD_DIM)
    tok = blk * BLOCK_T + offs_r // BLOCK_G  # index among the request's new tokens
    g = offs_r % BLOCK_G
    rmask = (tok < n_new) & (g < KV_GROUP)
    head = kv_head * KV_GROUP + g
    row_q = (q_start + tok).to(tl.int64) * stride_qn + head * stride_qh
    q = tl.load(q_ptr + row_q[:, None] + offs_d[None, :], mask=rmask[:, None], other=0.0)
    if FOLD:
        q_sum = tl.sum(q.to(tl.float32), 1)  # the zero-point term of every int-tier score
    else:
        q_sum = tl.zeros([BLOCK_ROWS], dtype=tl.float32)  # unused

    acc = tl.zeros([BLOCK_ROWS, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([BLOCK_ROWS], NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_ROWS], dtype=tl.float32)

    # ---- cached prefix: every tier, every listed page (non-causal: all precede the new tokens)
    npg16 = tl.load(npg16_ptr + b)  # listed pages (filled form; the dense form passes lens, unused)
    npg8 = tl.load(npg8_ptr + b)
    npg4 = tl.load(npg4_ptr + b)
    acc, m_i, l_i = _attend_prefix_tier(
        acc, m_i, l_i, q, q_sum, bt16_ptr + b * stride_bt16, fill16_ptr + b * stride_f16,
        tl.load(len16_ptr + b), npg16,
        k16_ptr, v16_ptr, k16_ptr, k16_ptr, k16_ptr, k16_ptr,
        stride_p16, stride_h16, 0, 0, kv_head, qk_scale,
        0, PAGE16, BLOCK_P, HEAD_DIM, GROUP_SIZE, FILLED, FOLD, DOT_F32)
    acc, m_i, l_i = _attend_prefix_tier(
        acc, m_i, l_i, q, q_sum, bt8_ptr + b * stride_bt8, fill8_ptr + b * stride_f8,
        tl.load(len8_ptr + b), npg8,
        k8_ptr, v8_ptr, k8s_ptr, k8z_ptr, v8s_ptr, v8z_ptr,
        stride_p8, stride_h8, stride_sp8, stride_sh8, kv_head, qk_scale,
        1, PAGE8, BLOCK_P, HEAD_DIM, GROUP_SIZE, FILLED, FOLD, DOT_F32)
    acc, m_i, l_i = _attend_prefix_tier(
        acc, m_i, l_i, q, q_sum, bt4_ptr + b * stride_bt4, fill4_ptr + b * stride_f4,
        tl.load(len4_ptr + b), npg4,
        k4_ptr, v4_ptr, k4s_ptr, k4z_ptr, v4s_ptr, v4z_ptr,
        stride_p4, stride_h4, stride_sp4, stride_sh4, kv_head, qk_scale,
        2, PAGE4, BLOCK_P, HEAD_DIM, GROUP_SIZE, FILLED, FOLD, DOT_F32)

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
    row_o = (q_start + tok).to(tl.int64) * stride_on + head * stride_oh
    tl.store(o_ptr + row_o[:, None] + offs_d[None, :], o.to(o_ptr.dtype.element_ty),
             mask=rmask[:, None])


def extend_attention_tiered(
    q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, qo_indptr: torch.Tensor,
    layer: TieredKVLayer, prefix_tables: TieredBlockTables, sm_scale: Optional[float] = None,
    max_extend_len: Optional[int] = None, out: Optional[torch.Tensor] = None, check: bool = True,
    tiles: Optional[tuple[torch.Tensor, torch.Tensor]] = None, fold_scales: bool = True,
) -> torch.Tensor:
    """check=False skips the layout checks of `layer` and `prefix_tables` (callers that
    checked them once, e.g. an attention backend running many layers over one batch).
    tiles: (tile_req, tile_blk) int32 device tensors from build_tiles: the tiled launch (module
    doc), which reads no host value of the batch (max_extend_len is then unused).
    Tiers may have different page sizes (any power of two, 1 included); prefix_tables may be in
    the dense or the filled form (paged_layout.py). fold_scales (G = D only): apply the int
    tiers' per-token scale / zero outside the inner products (see _prefix_step)."""
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

    def grid(meta):
        block_t = max(1, meta["BLOCK_ROWS"] // block_g)
        return (B, Hkv, triton.cdiv(max_extend_len, block_t))

    if tiles is not None:
        assert block_g <= GRAPH_CONFIG["BLOCK_ROWS"], "the tiled launch needs kv_group <= its BLOCK_ROWS"
        assert tiles[0].dtype == tiles[1].dtype == torch.int32 and tiles[0].shape == tiles[1].shape
        launch, tile_args = functools.partial(_launch_tiled, (tiles[0].shape[0], Hkv)), tiles
    else:
        # the autotuner's key: its key arguments and every tensor argument's dtype
        tune_key = (D, pages, block_g, layer.group_size, filled, dot_f32, fold, q.dtype, k_new.dtype,
                    out.dtype, qo_indptr.dtype, f16.k.dtype, i8.k.dtype, i8.k_scale.dtype, i8.k_zero.dtype,
                    i4.k.dtype, i4.k_scale.dtype, i4.k_zero.dtype, bt[0].dtype, bt[1].dtype, bt[2].dtype,
                    ln[0].dtype, ln[1].dtype, ln[2].dtype, fills[0].dtype, npg[0].dtype)
        launch, tile_args = functools.partial(_launch_extend, tune_key, grid), (qo_indptr, qo_indptr)
    launch(
        q, k_new, v_new, out, qo_indptr, *tile_args,
        f16.k, f16.v,
        i8.k, i8.v, i8.k_scale, i8.k_zero, i8.v_scale, i8.v_zero,
        i4.k, i4.v, i4.k_scale, i4.k_zero, i4.v_scale, i4.v_zero,
        bt[0], bt[1], bt[2], ln[0], ln[1], ln[2],
        fills[0], fills[1], fills[2], npg[0], npg[1], npg[2],
        q.stride(0), q.stride(1), k_new.stride(0), k_new.stride(1),
        out.stride(0), out.stride(1),
        bt[0].stride(0), bt[1].stride(0), bt[2].stride(0),
        fills[0].stride(0), fills[1].stride(0), fills[2].stride(0),
        f16.k.stride(0), f16.k.stride(1), i8.k.stride(0), i8.k.stride(1),
        i4.k.stride(0), i4.k.stride(1),
        i8.k_scale.stride(0), i8.k_scale.stride(1), i4.k_scale.stride(0), i4.k_scale.stride(1),
        sm_scale * LOG2E,
        KV_GROUP=kv_group, BLOCK_G=block_g, HEAD_DIM=D, GROUP_SIZE=layer.group_size,
        PAGE16=pages[0], PAGE8=pages[1], PAGE4=pages[2], FILLED=filled, FOLD=fold, DOT_F32=dot_f32,
        TILED=tiles is not None,
    )
    return out


_launch_extend = TunedLauncher(_extend_tiered_kernel)


def _launch_tiled(grid, *args, **kwargs) -> None:
    """The tiled launch at GRAPH_CONFIG, past the autotuner (its tiles are built for that config)."""
    _extend_tiered_kernel.fn[grid](*args, **kwargs, **GRAPH_CONFIG)


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
