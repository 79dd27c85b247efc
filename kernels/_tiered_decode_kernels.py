"""The jitted kernels of tiered_pool_decode.py (its module docstring describes them): one per tier
family (fp16 rows / int8 and int4 page-head blocks), their shared epilogue with the fused merge,
and the separate merge. Their loop bodies are step helpers (_fp16_step; _int_q_halves and the
_fold_* steps for G = D) that the one-launch kernel (_tiered_one_launch.py) runs too: one source
for the loads, conversions, folding and online softmax of both paths."""
from __future__ import annotations

import triton
import triton.language as tl

from ._split_k import NEG_BIG
from ._tiles import _cvt_hi16_one, _cvt_lo_one, _cvt_nibbles, _cvt_u8, _cvt_u8_one, _gpu_fence


# ---------------------------------------------------------------------------------------------
# shared pieces

@triton.jit
def _split_range(n_pages, split, n_split, PAGE: tl.constexpr, TILE: tl.constexpr):
    """[lo, hi) virtual-slot range of this split: steps [s * n // S, (s + 1) * n // S)."""
    steps = tl.cdiv(n_pages * PAGE, TILE)
    lo = (split * steps) // n_split
    hi = ((split + 1) * steps) // n_split
    return lo * TILE, hi * TILE


@triton.jit
def _request_pages(len_ptr, npg_ptr, b, PAGE: tl.constexpr, FILLED: tl.constexpr):
    """Request b's tokens in a tier and its listed pages (FILLED: the table's count; dense: whole
    pages up to the last token)."""
    n_tok = tl.load(len_ptr + b)
    if FILLED:
        n_pages = tl.load(npg_ptr + b)
    else:
        n_pages = tl.cdiv(n_tok, PAGE)
    return n_tok, n_pages


@triton.jit
def _softmax_update(m_i, l_i, s):
    """s [M, N] fp32 masked scores (log2 domain) -> (m_new, l_new, alpha, p)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    return m_new, l_i * alpha + tl.sum(p, 1), alpha, p


@triton.jit
def _page_of_step(bt_row_ptr, fill_row_ptr, n_tok, n_pages, l0, offs,
                  PAGE: tl.constexpr, TILE: tl.constexpr, FILLED: tl.constexpr):
    """PAGE >= TILE: the step's page (int64 scalar), its first slot and the slot mask [TILE].

    NOTE: the page id and the fill load side by side, neither waits on the other (a scalar load is
    never software-pipelined, so each step pays their latency once, not twice). Every step of a
    split's range lies in a listed page: PAGE is a multiple of TILE, so the range ends at
    n_pages * PAGE and j < n_pages."""
    j = l0 // PAGE
    # NOTE: l0 is a multiple of TILE and PAGE of TILE, so s0 is too. Triton cannot prove it, and
    # without the hint the dim-major V codes and the scales (contiguous along the slots) look
    # byte-aligned: too narrow for cp.async, so Triton 3.6 loads them synchronously every step.
    s0 = tl.multiple_of(l0 % PAGE, TILE)
    page = tl.load(bt_row_ptr + j).to(tl.int64)
    if FILLED:
        fill = tl.load(fill_row_ptr + j)
    else:
        fill = n_tok - j * PAGE
    return page, s0, (s0 + offs) < fill


@triton.jit
def _merge_chunk(lrow, orow, c, n_total, hmask, offs_s, offs_d, stride_os):
    """Partials c + [0, MERGE_S) of the merged rows: lse [H, S] (NEG_BIG past n_total) and o
    [H, S, D], loaded side by side (neither waits on the other) through L2 (.cg: other programs
    of this launch wrote them). All masked off past n_total: no memory traffic."""
    s = c + offs_s
    lmask = hmask[:, None] & (s < n_total)[None, :]
    lse = tl.load(lrow[:, None] + s[None, :], mask=lmask, other=NEG_BIG, cache_modifier=".cg")
    o = tl.load(orow[:, None, None] + s[None, :, None] * stride_os + offs_d[None, None, :],
                mask=lmask[:, :, None], other=0.0, cache_modifier=".cg")
    return lse, o


@triton.jit
def _merge_group(o_part_ptr, lse_part_ptr, out_ptr, b, kv_head, n_total,
                 stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_outb, stride_outh,
                 KV_GROUP: tl.constexpr, MERGE_H: tl.constexpr, HEAD_DIM: tl.constexpr,
                 MERGE_S: tl.constexpr, MERGE_PF: tl.constexpr):
    """out rows (b, q heads of kv_head) = LSE-weighted sum of the n_total partials, MERGE_S at a
    time (one pass, running max); empty partials (lse NEG_BIG) weigh 0.

    NOTE: the merging program is a serial tail of the launch (33 partials per tier at batch 1), so
    its L2 round trips are kept few: a chunk's partials load beside its lse, and with MERGE_PF the
    next chunk's loads are issued before this chunk is reduced (the loop carries them), so
    consecutive chunks overlap their round trips (two chunks of registers live). An empty split
    never wrote its partial (it may hold NaN): the select below, not the weight 0, keeps it out."""
    offs_h = tl.arange(0, MERGE_H)
    offs_s = tl.arange(0, MERGE_S)
    offs_d = tl.arange(0, HEAD_DIM)
    hmask = offs_h < KV_GROUP
    heads = kv_head * KV_GROUP + offs_h
    lrow = lse_part_ptr + b * stride_lb + heads * stride_lh  # [H]
    orow = o_part_ptr + b * stride_ob + heads * stride_oh
    m = tl.full([MERGE_H], NEG_BIG, dtype=tl.float32)
    l = tl.zeros([MERGE_H], dtype=tl.float32)
    acc = tl.zeros([MERGE_H, HEAD_DIM], dtype=tl.float32)
    if MERGE_PF:
        lse, o = _merge_chunk(lrow, orow, 0, n_total, hmask, offs_s, offs_d, stride_os)
    for c in range(0, n_total, MERGE_S):
        if MERGE_PF:  # the next chunk in flight while this one is reduced
            lse_n, o_n = _merge_chunk(lrow, orow, c + MERGE_S, n_total, hmask, offs_s, offs_d, stride_os)
        else:
            lse, o = _merge_chunk(lrow, orow, c, n_total, hmask, offs_s, offs_d, stride_os)
        live = lse > NEG_BIG * 0.5
        m_new = tl.maximum(m, tl.max(lse, 1))
        w = tl.where(live, tl.exp2(lse - m_new[:, None]), 0.0)
        o = tl.where(live[:, :, None], o, 0.0)
        alpha = tl.exp2(m - m_new)
        acc = acc * alpha[:, None] + tl.sum(o * w[:, :, None], 1)
        l = l * alpha + tl.sum(w, 1)
        m = m_new
        if MERGE_PF:
            lse = lse_n
            o = o_n
    res = acc / tl.where(l > 0, l, 1.0)[:, None]
    optr = out_ptr + b * stride_outb + heads[:, None] * stride_outh + offs_d[None, :]
    tl.store(optr, res.to(out_ptr.dtype.element_ty), mask=hmask[:, None])


@triton.jit
def _finish(acc_a, acc_b, m_i, l_i, o_part_ptr, lse_part_ptr, out_ptr, cnt_ptr, b, kv_head, pid_bh,
            split_id, n_total, offs_g, gmask,
            stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_outb, stride_outh,
            KV_GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HALVES: tl.constexpr, DIRECT: tl.constexpr,
            FUSED_MERGE: tl.constexpr, FENCE: tl.constexpr, MERGE_H: tl.constexpr, MERGE_S: tl.constexpr,
            MERGE_PF: tl.constexpr):
    """Epilogue of every tier kernel. acc_a [M, D] (HALVES 1) or the low / high halves acc_a,
    acc_b [M, D/2] (HALVES 2: int4). DIRECT: normalized o in the model dtype, no partial.
    Otherwise the fp32 partial (only when the split holds a token) and its lse, then, with
    FUSED_MERGE, the (b, kv head)'s last program over all launches merges."""
    W: tl.constexpr = HEAD_DIM // HALVES
    offs_w = tl.arange(0, W)
    heads = kv_head * KV_GROUP + offs_g
    nonempty = l_i > 0
    inv = 1.0 / tl.where(nonempty, l_i, 1.0)
    if DIRECT:
        optr = out_ptr + b * stride_outb + heads[:, None] * stride_outh + offs_w[None, :]
        tl.store(optr, (acc_a * inv[:, None]).to(out_ptr.dtype.element_ty), mask=gmask[:, None])
        if HALVES == 2:
            tl.store(optr + W, (acc_b * inv[:, None]).to(out_ptr.dtype.element_ty), mask=gmask[:, None])
    else:
        pmask = gmask & nonempty
        optr = o_part_ptr + b * stride_ob + heads[:, None] * stride_oh + split_id * stride_os + offs_w[None, :]
        tl.store(optr, acc_a * inv[:, None], mask=pmask[:, None])
        if HALVES == 2:
            tl.store(optr + W, acc_b * inv[:, None], mask=pmask[:, None])
        lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), NEG_BIG)
        tl.store(lse_part_ptr + b * stride_lb + heads * stride_lh + split_id, lse, mask=gmask)
        if FUSED_MERGE:
            # NOTE: every thread's partial stores must be visible GPU-wide before the counter
            # says so: a fence per thread, a CTA barrier, then one acq_rel atomic (thread 0).
            if FENCE:
                _gpu_fence(offs_g)
            tl.debug_barrier()
            done = tl.atomic_add(cnt_ptr + pid_bh, 1, sem="acq_rel")
            if done == n_total - 1:
                _merge_group(o_part_ptr, lse_part_ptr, out_ptr, b, kv_head, n_total,
                             stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_outb, stride_outh,
                             KV_GROUP, MERGE_H, HEAD_DIM, MERGE_S, MERGE_PF)
                tl.store(cnt_ptr + pid_bh, 0)  # ready for the next launch (stream order)


@triton.jit
def _merge_kernel(o_part_ptr, lse_part_ptr, out_ptr, n_total,
                  stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_outb, stride_outh,
                  NUM_KV_HEADS: tl.constexpr, KV_GROUP: tl.constexpr, MERGE_H: tl.constexpr,
                  HEAD_DIM: tl.constexpr, MERGE_S: tl.constexpr, MERGE_PF: tl.constexpr):
    pid = tl.program_id(0)
    _merge_group(o_part_ptr, lse_part_ptr, out_ptr, pid // NUM_KV_HEADS, pid % NUM_KV_HEADS, n_total,
                 stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_outb, stride_outh,
                 KV_GROUP, MERGE_H, HEAD_DIM, MERGE_S, MERGE_PF)


# ---------------------------------------------------------------------------------------------
# fp16 tier

@triton.jit
def _fp16_step(q, k_ptr, v_ptr, bt_row, fill_row, n_tok, n_pages, l0, hi, head_off, stride_p, qk_scale,
               m_i, l_i, acc, offs_t, offs_d,
               HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, TILE: tl.constexpr, FILLED: tl.constexpr,
               DOT_F32: tl.constexpr, ROWS: tl.constexpr):
    """One step of the fp16 tier, virtual slots [l0, l0 + TILE), into (m_i, l_i, acc [G, D]) ->
    the updated state. ROWS (PAGE < TILE): the step's slots from hi on (the split's end) are not
    this split's. The body of _fp16_tier_kernel's loop and of the one-launch kernel's fp16 loop."""
    if PAGE >= TILE:
        page, s0, tm = _page_of_step(bt_row, fill_row, n_tok, n_pages, l0, offs_t, PAGE, TILE, FILLED)
        rows = page * stride_p + head_off + (s0 + offs_t).to(tl.int64) * HEAD_DIM
    else:  # TILE / PAGE pages a step, page id (and fill) per slot; PAGE 1: a row gather
        slot = l0 + offs_t
        j = slot // PAGE
        s = slot % PAGE
        if ROWS:
            listed = slot < hi  # this split's slots: every one of them lies in a listed page
        else:
            listed = j < n_pages
        # NOTE: page ids and fills load side by side (no load waits on a loaded value but the
        # rows on their page ids), so the software pipeline prefetches both a stage ahead
        page = tl.load(bt_row + j, mask=listed, other=0).to(tl.int64)
        if FILLED:
            fill = tl.load(fill_row + j, mask=listed, other=0)
            tm = s < fill
        else:
            tm = (slot < n_tok) & listed
        rows = page * stride_p + head_off + s.to(tl.int64) * HEAD_DIM
    rows = tl.multiple_of(rows, 8)
    # NOTE: no load waits on a loaded fill (it would hold the rows back a pipeline stage): the
    # rows of listed pages load whole, the fills only mask the scores. So every slot of a
    # listed page must hold finite values (0 * NaN in P @ V would poison the row): the
    # engine's fp16 store is zero-initialized and written with finite K / V only.
    if PAGE >= TILE:  # the step lies in a listed page
        k = tl.load(k_ptr + rows[:, None] + offs_d[None, :])
        v = tl.load(v_ptr + rows[:, None] + offs_d[None, :])
    else:
        k = tl.load(k_ptr + rows[:, None] + offs_d[None, :], mask=listed[:, None], other=0.0)
        v = tl.load(v_ptr + rows[:, None] + offs_d[None, :], mask=listed[:, None], other=0.0)
    if DOT_F32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s_qk = tl.dot(q, tl.trans(k)) * qk_scale
    s_qk = tl.where(tm[None, :], s_qk, float("-inf"))
    m_i, l_i, alpha, p = _softmax_update(m_i, l_i, s_qk)
    return m_i, l_i, acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)


@triton.jit(do_not_specialize=["split_base", "n_total"])  # one binary for every split count
def _fp16_tier_kernel(
    q_ptr, o_part_ptr, lse_part_ptr, out_ptr, cnt_ptr, k_ptr, v_ptr,
    bt_ptr, fill_ptr, len_ptr, npg_ptr,
    stride_qb, stride_qh, stride_bt, stride_f, stride_p, stride_h,
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_outb, stride_outh,
    split_base, n_total, qk_scale,
    NUM_KV_HEADS: tl.constexpr, KV_GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr, TILE: tl.constexpr, FILLED: tl.constexpr, DOT_F32: tl.constexpr,
    ROW_SPLITS: tl.constexpr,
    DIRECT: tl.constexpr, FUSED_MERGE: tl.constexpr, FENCE: tl.constexpr,
    MERGE_H: tl.constexpr, MERGE_S: tl.constexpr, MERGE_PF: tl.constexpr,
):
    """ROW_SPLITS (PAGE < TILE only): split s takes the virtual slots
    [s * n // S, (s + 1) * n // S) of the n = n_pages * PAGE listed ones, cut at any slot, not at a
    step boundary: every split of a request reads the same number of rows (+-1), where step-cut
    splits differ by a whole step (batch 1 at 32k, tile 64, S 33: 15 or 16 steps, so the programs
    an SM holds carry 30 to 32 steps). A split's slots past its end are masked off at the load
    (other = 0: never read) and at the scores."""
    ROWS: tl.constexpr = ROW_SPLITS and PAGE < TILE
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    b = pid_bh // NUM_KV_HEADS
    kv_head = pid_bh % NUM_KV_HEADS
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_t = tl.arange(0, TILE)
    gmask = offs_g < KV_GROUP
    q_rows = b * stride_qb + (kv_head * KV_GROUP + offs_g) * stride_qh
    q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=gmask[:, None], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    n_tok, n_pages = _request_pages(len_ptr, npg_ptr, b, PAGE, FILLED)
    if ROWS:
        n_slots = n_pages.to(tl.int64) * PAGE
        lo = ((split * n_slots) // tl.num_programs(1)).to(tl.int32)
        hi = (((split + 1) * n_slots) // tl.num_programs(1)).to(tl.int32)
    else:
        lo, hi = _split_range(n_pages, split, tl.num_programs(1), PAGE, TILE)
    bt_row = bt_ptr + b * stride_bt
    fill_row = fill_ptr + b * stride_f
    head_off = kv_head * stride_h
    m_i = tl.full([BLOCK_G], NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], dtype=tl.float32)
    for l0 in tl.range(lo, hi, TILE):
        m_i, l_i, acc = _fp16_step(q, k_ptr, v_ptr, bt_row, fill_row, n_tok, n_pages, l0, hi, head_off, stride_p,
                                   qk_scale, m_i, l_i, acc, offs_t, offs_d, HEAD_DIM, PAGE, TILE, FILLED, DOT_F32, ROWS)
    _finish(acc, acc, m_i, l_i, o_part_ptr, lse_part_ptr, out_ptr, cnt_ptr, b, kv_head, pid_bh,
            split_base + split, n_total, offs_g, gmask,
            stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_outb, stride_outh,
            KV_GROUP, HEAD_DIM, 1, DIRECT, FUSED_MERGE, FENCE, MERGE_H, MERGE_S, MERGE_PF)


# ---------------------------------------------------------------------------------------------
# int8 / int4 tiers

@triton.jit
def _round_i8(x):
    """Round half away from zero to int8 (|x| <= 127.5)."""
    return tl.where(x >= 0, x + 0.5, x - 0.5).to(tl.int8)


@triton.jit
def _dequant_half(codes, sc_ptr, zr_ptr, srow, offs_c, tm, CH0: tl.constexpr, GROUP_SIZE: tl.constexpr):
    """G < D: codes [TILE, W] (exact fp16 integers) of channels CH0 + c -> values in fp16, each
    with the scale / zero of its group (srow [TILE]: the slot's first scale, fp16 index)."""
    g = (CH0 + offs_c) // GROUP_SIZE
    sc = tl.load(sc_ptr + srow[:, None] + g[None, :], mask=tm[:, None], other=0.0).to(tl.float32)
    zr = tl.load(zr_ptr + srow[:, None] + g[None, :], mask=tm[:, None], other=0.0).to(tl.float32)
    return (codes.to(tl.float32) * sc + zr).to(tl.float16)


@triton.jit
def _int_step_codes(k_ptr, v_ptr, bt_row, fill_row, n_tok, n_pages, l0, kv_head, stride_p, stride_h,
                    PAGE: tl.constexpr, TILE: tl.constexpr, W: tl.constexpr, NG: tl.constexpr,
                    FILLED: tl.constexpr, KT: tl.constexpr):
    """One step's raw codes of an int tier: K [TILE, W] (KT: [W, TILE], the B operand of q . K
    read transposed by address, no tl.trans), V [TILE, W] (read dim-major), the fp16
    index of each slot's first scale as [R, C] = [1, TILE] (PAGE >= TILE) or [TILE / PAGE, PAGE]
    (one row per page: scales load per page-run, contiguous and 16-byte aligned, then reshape to
    [TILE]; one flat [TILE] index would lose that alignment to the reshape) and the slot mask [TILE].

    NOTE: the codes are loaded without a mask. A slot mask varies along V's contiguous axis (the
    slots of a dim-major page), and with it Triton loads V one byte per instruction (PAGE 256, 8
    warps: 128 byte loads per thread per step, which also keep ~128 registers live and bypass the
    cp.async pipeline). Every address stays inside the store: a step's slots lie in a listed page,
    and a slot past the request's pages reads page 0 (the store holds >= 1 page: the launcher
    checks). Codes of masked slots are finite integers whatever the bytes; their scores are set
    to -inf and their V scales and zeros to 0, so they add nothing.

        PAGE >= TILE   one page: a scalar page id, every stream one contiguous run
        PAGE <  TILE   TILE / PAGE listed pages, their ids and fills loaded as a vector, each
                       page's runs contiguous ([pages, PAGE, W] loads reshaped to [TILE, W])"""
    SCALE0: tl.constexpr = PAGE * W // 2  # fp16 index of the scales inside a block
    offs_c = tl.arange(0, W)
    if PAGE >= TILE:
        offs_t = tl.arange(0, TILE)
        page, s0, tm = _page_of_step(bt_row, fill_row, n_tok, n_pages, l0, offs_t, PAGE, TILE, FILLED)
        blk = tl.multiple_of(page * stride_p + kv_head * stride_h, 16)
        slot = s0 + offs_t
        if KT:
            kq = tl.load(k_ptr + blk + slot[None, :] * W + offs_c[:, None])
        else:
            kq = tl.load(k_ptr + blk + slot[:, None] * W + offs_c[None, :])
        vq = tl.load(v_ptr + blk + offs_c[None, :] * PAGE + slot[:, None])
        srow = (blk // 2 + SCALE0 + slot * NG)[None, :]
    else:
        NP: tl.constexpr = TILE // PAGE
        j = l0 // PAGE + tl.arange(0, NP)
        offs_s = tl.arange(0, PAGE)
        if FILLED:
            fill = tl.load(fill_row + j, mask=j < n_pages, other=0)
        else:
            fill = n_tok - j * PAGE
        page = tl.load(bt_row + j, mask=j < n_pages, other=0).to(tl.int64)  # not behind the fills
        blk = tl.multiple_of(page * stride_p + kv_head * stride_h, 16)
        tm3 = offs_s[None, :] < fill[:, None]  # [NP, PAGE]
        if KT:
            kq = tl.load(k_ptr + blk[None, :, None] + offs_s[None, None, :] * W + offs_c[:, None, None])
            kq = tl.reshape(kq, (W, TILE))
        else:
            kq = tl.load(k_ptr + blk[:, None, None] + offs_s[None, :, None] * W + offs_c[None, None, :])
            kq = tl.reshape(kq, (TILE, W))
        vq = tl.load(v_ptr + blk[:, None, None] + offs_c[None, None, :] * PAGE + offs_s[None, :, None])
        vq = tl.reshape(vq, (TILE, W))
        tm = tl.reshape(tm3, (TILE,))
        srow = blk[:, None] // 2 + SCALE0 + offs_s[None, :] * NG
    return kq, vq, srow, tm


@triton.jit
def _int_q_halves(q_ptr, q_rows, gmask, HALVES: tl.constexpr, W: tl.constexpr, KT: tl.constexpr):
    """q rows of an int tier's program -> (qa, qb, q_sum, qa16, qb16): the fp32 low / high halves
    [G, W] (HALVES 1: qb is qa), their sum over D (the zero-point term of every folded score, no
    softmax scale yet) and the fp16 dot operands (KT and HALVES 2: qb16 holds q / 16)."""
    offs_c = tl.arange(0, W)
    qa = tl.load(q_ptr + q_rows[:, None] + offs_c[None, :], mask=gmask[:, None], other=0.0).to(tl.float32)
    q_sum = tl.sum(qa, 1)
    qb = qa
    if HALVES == 2:
        qb = tl.load(q_ptr + q_rows[:, None] + W + offs_c[None, :], mask=gmask[:, None], other=0.0).to(tl.float32)
        q_sum += tl.sum(qb, 1)
    qa16 = qa.to(tl.float16)
    qb16 = qb.to(tl.float16)
    if KT and HALVES == 2:
        # the high nibbles convert as 16 * hi: q's high half takes the 1/16 instead of every score
        # (a power of two: the same fp16 mantissas wherever q / 16 stays normal, |q| >= 2^-10)
        qb16 = (qb * 0.0625).to(tl.float16)
    return qa, qb, q_sum, qa16, qb16


@triton.jit
def _fold_scales(ks_ptr, vs_ptr, srow2, tm, K_MUL, ZERO_OFF: tl.constexpr, TILE: tl.constexpr):
    """G = D: one step's per-slot K scale (times K_MUL), K zero, V scale and V zero [TILE] fp32;
    ZERO_OFF = PAGE * NG, the fp16 distance from a block's scales to its zeros.

    NOTE: unmasked, like the codes: a slot mask along the scales' contiguous axis would make each a
    2-byte load outside the cp.async pipeline (the pipeliner skips loads under 4 bytes), paid in
    full every step. A masked slot's K scale / zero only reach its score (set to -inf); its V scale
    / zero are zeroed here (garbage may be NaN). V's scale and zero load as one [TILE, 2] tensor:
    the software pipeliner prefetches only loads that feed a tl.dot operand, and the zero alone
    feeds none (the zero-point sum)."""
    ks = tl.reshape(tl.load(ks_ptr + srow2), (TILE,)).to(tl.float32) * K_MUL
    kz = tl.reshape(tl.load(ks_ptr + srow2 + ZERO_OFF), (TILE,)).to(tl.float32)
    vsz = tl.load(vs_ptr + srow2[:, :, None] + tl.arange(0, 2)[None, None, :] * ZERO_OFF)
    vs, vz = tl.split(tl.reshape(vsz, (TILE, 2)).to(tl.float32))
    return ks, kz, tl.where(tm, vs, 0.0), tl.where(tm, vz, 0.0)


@triton.jit
def _fold_qk_fp16(qa16, qb16, kq, HALVES: tl.constexpr, KT: tl.constexpr, FAST_CVT: tl.constexpr,
                  SUBK: tl.constexpr):
    """G = D, fp16 q . K on one step's raw codes -> qk [G, TILE] fp32, before the K scale and zero
    (SUBK: in units of 2^-24; KT: K read [W, TILE], converted in the dot operand layout)."""
    if KT:
        if HALVES == 1:
            qk = tl.dot(qa16, _cvt_u8_one(kq, FAST_CVT, SUBK))
        else:  # qb16 holds q / 16 (_int_q_halves)
            qk = tl.dot(qb16, _cvt_hi16_one(kq, FAST_CVT, SUBK))
            qk = tl.dot(qa16, _cvt_lo_one(kq, FAST_CVT, SUBK), qk)
    else:
        if HALVES == 1:
            qk = tl.dot(qa16, tl.trans(_cvt_u8(kq, FAST_CVT)))
        else:
            k_lo, k_hi = _cvt_nibbles(kq, FAST_CVT)
            qk = tl.dot(qa16, tl.trans(k_lo))
            qk = tl.dot(qb16, tl.trans(k_hi), qk)
    return qk


@triton.jit
def _fold_update(qk, ks, kz, vs, vz, tm, vq, q_sum, m_i, l_i, acc_a, acc_b,
                 HALVES: tl.constexpr, DOT_CVT: tl.constexpr, FAST_CVT: tl.constexpr, SUBV: tl.constexpr):
    """G = D: one step's scores (qk * ks + q_sum * kz, the softmax scale already in ks and q_sum),
    online softmax and P @ V on V's raw codes -> (m_i, l_i, acc_a, acc_b).

    DOT_CVT: acc_a in units of U_V, acc_b in units of 16 * U_V (U_V = 2^-24 with SUBV, else 1);
    _fold_acc_rescale takes them out after the loop. HALVES 1: acc_b stays as it is."""
    U_V: tl.constexpr = 5.9604644775390625e-08 if SUBV else 1.0
    s_qk = qk * ks[None, :] + q_sum[:, None] * kz[None, :]
    s_qk = tl.where(tm[None, :], s_qk, float("-inf"))
    m_i, l_i, alpha, p = _softmax_update(m_i, l_i, s_qk)
    pw = (p * vs[None, :]).to(tl.float16)
    zero = tl.sum(p * vz[None, :], 1)[:, None]
    if DOT_CVT:
        if HALVES == 1:
            acc_a = tl.dot(pw, _cvt_u8_one(vq, FAST_CVT, SUBV), acc_a * alpha[:, None]) + zero * U_V
        else:
            acc_a = tl.dot(pw, _cvt_lo_one(vq, FAST_CVT, SUBV), acc_a * alpha[:, None]) + zero * U_V
            acc_b = tl.dot(pw, _cvt_hi16_one(vq, FAST_CVT, SUBV), acc_b * alpha[:, None]) + zero * (16.0 * U_V)
    elif HALVES == 1:
        acc_a = tl.dot(pw, _cvt_u8(vq, FAST_CVT), acc_a * alpha[:, None]) + zero
    else:
        v_lo, v_hi = _cvt_nibbles(vq, FAST_CVT)
        acc_a = tl.dot(pw, v_lo, acc_a * alpha[:, None]) + zero
        acc_b = tl.dot(pw, v_hi, acc_b * alpha[:, None]) + zero
    return m_i, l_i, acc_a, acc_b


@triton.jit
def _fold_acc_rescale(acc_a, acc_b, HALVES: tl.constexpr, DOT_CVT: tl.constexpr, SUBV: tl.constexpr):
    """After _fold_update's loop: the accumulators back to plain units (exact: powers of two)."""
    U_V: tl.constexpr = 5.9604644775390625e-08 if SUBV else 1.0
    if SUBV:
        acc_a = acc_a * 16777216.0  # 2^24
    if DOT_CVT and HALVES == 2:
        acc_b = acc_b * (0.0625 / U_V)  # the high accumulator held 16 * U_V * ((p * vs) @ hi + zero)
    return acc_a, acc_b


@triton.jit(do_not_specialize=["split_base", "n_total"])  # one binary for every split count
def _int_tier_kernel(
    q_ptr, o_part_ptr, lse_part_ptr, out_ptr, cnt_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr,
    bt_ptr, fill_ptr, len_ptr, npg_ptr,
    stride_qb, stride_qh, stride_bt, stride_f, stride_p, stride_h,
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_outb, stride_outh,
    split_base, n_total, qk_scale,
    TIER: tl.constexpr, NUM_KV_HEADS: tl.constexpr, KV_GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr, GROUP_SIZE: tl.constexpr, PAGE: tl.constexpr, TILE: tl.constexpr,
    FILLED: tl.constexpr, QK_INT8: tl.constexpr, FAST_CVT: tl.constexpr, DOT_CVT: tl.constexpr,
    SUB_CVT: tl.constexpr,
    DIRECT: tl.constexpr, FUSED_MERGE: tl.constexpr, FENCE: tl.constexpr,
    MERGE_H: tl.constexpr, MERGE_S: tl.constexpr, MERGE_PF: tl.constexpr,
):
    """TIER 1 (int8) or 2 (int4). Block of (page, kv head), bytes from k_ptr / v_ptr +
    page * stride_p + kv_head * stride_h (module docstring of paged_layout.py):
        K codes [PAGE, W] | scale [PAGE, NG] | zero [PAGE, NG]     (ks_ptr: the same bytes as fp16)
        V codes [W, PAGE] | scale [PAGE, NG] | zero [PAGE, NG]"""
    HALVES: tl.constexpr = TIER  # int8: one accumulator over D; int4: low and high halves
    W: tl.constexpr = HEAD_DIM // HALVES
    NG: tl.constexpr = HEAD_DIM // GROUP_SIZE
    FOLD: tl.constexpr = NG == 1
    # DOT_CVT (FOLD, fp16 q . K): K read [W, TILE] and every conversion a one-result op, so the
    # codes enter the dot operand layout before they become fp16 (see _tiles.py); int4 high nibbles
    # convert as 16 * hi (no shift): their dots carry a factor 16 that is taken out exactly (a
    # power of two) from q . K at once and from the high accumulator at the end
    # SUB_CVT (with DOT_CVT): codes convert to c * 2^-24, exact fp16 subnormals (no bias to
    # subtract; tensor cores take fp16 subnormals as they are): every such dot carries a factor
    # U = 2^-24, taken out exactly by a power-of-two multiply (scores: folded into the K scale)
    KT: tl.constexpr = DOT_CVT and FOLD and not QK_INT8
    SUBK: tl.constexpr = SUB_CVT and KT
    SUBV: tl.constexpr = SUB_CVT and DOT_CVT and FOLD
    FOLD_CVT: tl.constexpr = DOT_CVT and FOLD
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    b = pid_bh // NUM_KV_HEADS
    kv_head = pid_bh % NUM_KV_HEADS
    offs_g = tl.arange(0, BLOCK_G)
    offs_c = tl.arange(0, W)
    gmask = offs_g < KV_GROUP
    q_rows = b * stride_qb + (kv_head * KV_GROUP + offs_g) * stride_qh
    qa, qb, q_sum, qa16, qb16 = _int_q_halves(q_ptr, q_rows, gmask, HALVES, W, KT)
    if QK_INT8:
        qmax = tl.max(tl.abs(qa), 1)
        if HALVES == 2:
            qmax = tl.maximum(qmax, tl.max(tl.abs(qb), 1))
        q_sc = tl.where(qmax > 0, qmax / 127.0, 1.0)
        qa8 = _round_i8(qa / q_sc[:, None])
        qb8 = _round_i8(qb / q_sc[:, None])
        q8_sum = tl.sum(qa8.to(tl.int32), 1).to(tl.float32)
        # the zero-point term takes the same rounded q as the codes' term: every score is then
        # exactly q~ . k^ with q~ = q8 * q_sc (the torch reference over q~ matches to fp32 rounding)
        if HALVES == 2:
            q_sum = (q8_sum + tl.sum(qb8.to(tl.int32), 1).to(tl.float32)) * q_sc
        else:
            q_sum = q8_sum * q_sc

    # FOLD: score = qk * (ks * K_MUL) + (q_sum * qk_scale) * kz, the softmax scale and SUBK's 2^24
    # carried by the per-token K scale and the per-row zero-point sum: two ops per score element
    K_MUL = qk_scale
    if SUBK:
        K_MUL = qk_scale * 16777216.0  # 2^24: exact
    q_sum = q_sum * qk_scale
    n_tok, n_pages = _request_pages(len_ptr, npg_ptr, b, PAGE, FILLED)
    lo, hi = _split_range(n_pages, split, tl.num_programs(1), PAGE, TILE)
    bt_row = bt_ptr + b * stride_bt
    fill_row = fill_ptr + b * stride_f
    m_i = tl.full([BLOCK_G], NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc_a = tl.zeros([BLOCK_G, W], dtype=tl.float32)
    acc_b = tl.zeros([BLOCK_G, W], dtype=tl.float32)
    for l0 in tl.range(lo, hi, TILE):
        kq, vq, srow2, tm = _int_step_codes(k_ptr, v_ptr, bt_row, fill_row, n_tok, n_pages, l0, kv_head,
                                            stride_p, stride_h, PAGE, TILE, W, NG, FILLED, KT)
        if FOLD:
            ks, kz, vs, vz = _fold_scales(ks_ptr, vs_ptr, srow2, tm, K_MUL, PAGE * NG, TILE)
            # ---- scores on raw codes
            if QK_INT8:
                if HALVES == 1:
                    kc8 = (kq ^ 0x80).to(tl.int8, bitcast=True)  # codes - 128
                    qi = tl.dot(qa8, tl.trans(kc8), out_dtype=tl.int32).to(tl.float32)
                    qk = (qi + 128.0 * q8_sum[:, None]) * q_sc[:, None]
                else:
                    qi = tl.dot(qa8, tl.trans((kq & 15).to(tl.int8, bitcast=True)), out_dtype=tl.int32)
                    qi += tl.dot(qb8, tl.trans((kq >> 4).to(tl.int8, bitcast=True)), out_dtype=tl.int32)
                    qk = qi.to(tl.float32) * q_sc[:, None]
            else:
                qk = _fold_qk_fp16(qa16, qb16, kq, HALVES, KT, FAST_CVT, SUBK)
            m_i, l_i, acc_a, acc_b = _fold_update(qk, ks, kz, vs, vz, tm, vq, q_sum, m_i, l_i, acc_a, acc_b,
                                                  HALVES, DOT_CVT, FAST_CVT, SUBV)
        else:
            # ---- G < D: per-element dequantization, plain dots
            srow = tl.reshape(srow2, (TILE,))
            if HALVES == 1:
                k = _dequant_half(_cvt_u8(kq, False), ks_ptr, ks_ptr + PAGE * NG, srow, offs_c, tm, 0, GROUP_SIZE)
                qk = tl.dot(qa16, tl.trans(k))
            else:
                k_lo, k_hi = _cvt_nibbles(kq, False)
                k_lo = _dequant_half(k_lo, ks_ptr, ks_ptr + PAGE * NG, srow, offs_c, tm, 0, GROUP_SIZE)
                k_hi = _dequant_half(k_hi, ks_ptr, ks_ptr + PAGE * NG, srow, offs_c, tm, W, GROUP_SIZE)
                qk = tl.dot(qa16, tl.trans(k_lo))
                qk = tl.dot(qb16, tl.trans(k_hi), qk)
            s_qk = tl.where(tm[None, :], qk * qk_scale, float("-inf"))
            m_i, l_i, alpha, p = _softmax_update(m_i, l_i, s_qk)
            p16 = p.to(tl.float16)
            if HALVES == 1:
                v = _dequant_half(_cvt_u8(vq, False), vs_ptr, vs_ptr + PAGE * NG, srow, offs_c, tm, 0, GROUP_SIZE)
                acc_a = tl.dot(p16, v, acc_a * alpha[:, None])
            else:
                v_lo, v_hi = _cvt_nibbles(vq, False)
                v_lo = _dequant_half(v_lo, vs_ptr, vs_ptr + PAGE * NG, srow, offs_c, tm, 0, GROUP_SIZE)
                v_hi = _dequant_half(v_hi, vs_ptr, vs_ptr + PAGE * NG, srow, offs_c, tm, W, GROUP_SIZE)
                acc_a = tl.dot(p16, v_lo, acc_a * alpha[:, None])
                acc_b = tl.dot(p16, v_hi, acc_b * alpha[:, None])
    acc_a, acc_b = _fold_acc_rescale(acc_a, acc_b, HALVES, FOLD_CVT, SUBV)
    _finish(acc_a, acc_b, m_i, l_i, o_part_ptr, lse_part_ptr, out_ptr, cnt_ptr, b, kv_head, pid_bh,
            split_base + split, n_total, offs_g, gmask,
            stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_outb, stride_outh,
            KV_GROUP, HEAD_DIM, HALVES, DIRECT, FUSED_MERGE, FENCE, MERGE_H, MERGE_S, MERGE_PF)
