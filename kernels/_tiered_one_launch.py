"""One launch for every tier of tiered_pool_decode (config.one_launch): the kernel and its launcher.

The per-tier path launches one grid (B * Hkv, S) per tier store, so a b = 0.5 layer runs three
launches in stream order, and the two small tiers (the fp16 window, a few percent int4) each pay a
whole launch's ramp, one-step programs and their own tail behind the int8 launch (at batch 8, 32k
on an H100 they time 16.7 us and 20.9 us alone beside 185.1 us of int8, benchmarks/results/
attention_*.json "parts"). Here ONE grid (B * Hkv, S) covers all tiers: program (b, kv head, s)
takes the s-th of S equal BYTE shares of the request's steps, laid out tier after tier:

    weighted line of request b:  | fp16 steps x W16 | int8 steps x W8 | int4 steps x W4 |
                                 0               base8             base4            total
    program s: [s * total // S, (s + 1) * total // S); a step belongs to the program whose share
    holds its start, so every step is read by exactly one program (W_t = K + V bytes of a step)

Each tier's steps run in its own loop (its tile and stages), with its own (m, l, acc); the
states combine once per tier (log2-sum-exp), so one partial per program leaves, and the fused
merge reduces S partials, not 3 S. Tiers without tokens in a program run zero steps.
Scope: int tiers with one scale and zero per token-head (G = D) and fp16 q . K (no qk_int8);
tiered_pool_decode falls back to per-tier launches otherwise. The loop bodies are the step helpers
of _tiered_decode_kernels.py that the per-tier kernels run too (_fp16_step; _int_q_halves and the
_fold_* steps), so both paths convert and fold the same way.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ._split_k import NEG_BIG
from ._tiered_decode_kernels import (
    _finish, _fold_acc_rescale, _fold_qk_fp16, _fold_scales, _fold_update, _fp16_step, _int_q_halves,
    _int_step_codes, _request_pages,
)


@triton.jit
def _tier_range(lo_w, hi_w, base, steps, W: tl.constexpr, TILE: tl.constexpr):
    """Virtual-slot range [lo, hi) of a tier's steps whose weighted start lies in [lo_w, hi_w)."""
    i_lo = tl.minimum(tl.cdiv(tl.maximum(lo_w - base, 0), W), steps)
    i_hi = tl.minimum(tl.cdiv(tl.maximum(hi_w - base, 0), W), steps)
    return (i_lo * TILE).to(tl.int32), (i_hi * TILE).to(tl.int32)


@triton.jit
def _combine(m, l, acc, m_t, l_t, acc_t):
    """(m, l, acc) and a tier's (m_t, l_t, acc_t), log2 domain; two empty states stay empty."""
    m_new = tl.maximum(m, m_t)
    a = tl.exp2(m - m_new)
    b = tl.exp2(m_t - m_new)
    return m_new, l * a + l_t * b, acc * a[:, None] + acc_t * b[:, None]


@triton.jit
def _fp16_loop(q_ptr, q_rows, gmask, lo, hi, k_ptr, v_ptr, bt_row, fill_row, n_tok, n_pages, head_off, stride_p,
               qk_scale, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, TILE: tl.constexpr,
               FILLED: tl.constexpr, DOT_F32: tl.constexpr, STAGES: tl.constexpr):
    """The fp16 tier's steps [lo, hi) (step-granular) -> (acc [G, D], m, l)."""
    offs_d = tl.arange(0, HEAD_DIM)
    offs_t = tl.arange(0, TILE)
    q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=gmask[:, None], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_G], NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], dtype=tl.float32)
    for l0 in tl.range(lo, hi, TILE, num_stages=STAGES):
        m_i, l_i, acc = _fp16_step(q, k_ptr, v_ptr, bt_row, fill_row, n_tok, n_pages, l0, hi, head_off, stride_p,
                                   qk_scale, m_i, l_i, acc, offs_t, offs_d, HEAD_DIM, PAGE, TILE, FILLED, DOT_F32,
                                   False)
    return acc, m_i, l_i


@triton.jit
def _int_fold_loop(q_ptr, q_rows, gmask, lo, hi, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row, fill_row, n_tok, n_pages,
                   kv_head, stride_p, stride_h, qk_scale,
                   TIER: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
                   TILE: tl.constexpr, FILLED: tl.constexpr, FAST_CVT: tl.constexpr, DOT_CVT: tl.constexpr,
                   SUB_CVT: tl.constexpr, STAGES: tl.constexpr):
    """An int tier's steps [lo, hi), G = D (folded scales, fp16 q . K) -> (acc [G, D], m, l);
    int4's low / high halves are joined into acc's two halves at the end."""
    HALVES: tl.constexpr = TIER
    W: tl.constexpr = HEAD_DIM // HALVES
    KT: tl.constexpr = DOT_CVT  # no qk_int8 here: K reads [W, TILE] whenever the dots convert
    SUBK: tl.constexpr = SUB_CVT and KT
    SUBV: tl.constexpr = SUB_CVT and DOT_CVT
    qa, qb, q_sum, qa16, qb16 = _int_q_halves(q_ptr, q_rows, gmask, HALVES, W, KT)
    K_MUL = qk_scale
    if SUBK:
        K_MUL = qk_scale * 16777216.0  # 2^24: exact
    q_sum = q_sum * qk_scale
    m_i = tl.full([BLOCK_G], NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc_a = tl.zeros([BLOCK_G, W], dtype=tl.float32)
    acc_b = tl.zeros([BLOCK_G, W], dtype=tl.float32)
    for l0 in tl.range(lo, hi, TILE, num_stages=STAGES):
        kq, vq, srow2, tm = _int_step_codes(k_ptr, v_ptr, bt_row, fill_row, n_tok, n_pages, l0, kv_head,
                                            stride_p, stride_h, PAGE, TILE, W, 1, FILLED, KT)
        ks, kz, vs, vz = _fold_scales(ks_ptr, vs_ptr, srow2, tm, K_MUL, PAGE, TILE)
        qk = _fold_qk_fp16(qa16, qb16, kq, HALVES, KT, FAST_CVT, SUBK)
        m_i, l_i, acc_a, acc_b = _fold_update(qk, ks, kz, vs, vz, tm, vq, q_sum, m_i, l_i, acc_a, acc_b,
                                              HALVES, DOT_CVT, FAST_CVT, SUBV)
    acc_a, acc_b = _fold_acc_rescale(acc_a, acc_b, HALVES, DOT_CVT, SUBV)
    if HALVES == 2:
        # [G, W] low and high halves -> [G, D]: dims [0, W) from acc_a, [W, D) from acc_b
        acc_a = tl.reshape(tl.permute(tl.join(acc_a, acc_b), (0, 2, 1)), (BLOCK_G, HEAD_DIM))
    return acc_a, m_i, l_i


@triton.jit(do_not_specialize=["n_total"])
def _one_launch_kernel(
    q_ptr, o_part_ptr, lse_part_ptr, out_ptr, cnt_ptr,
    k16_ptr, v16_ptr, bt16_ptr, fill16_ptr, len16_ptr, npg16_ptr, stride_bt16, stride_f16, stride_p16, stride_h16,
    k8_ptr, v8_ptr, ks8_ptr, vs8_ptr, bt8_ptr, fill8_ptr, len8_ptr, npg8_ptr, stride_bt8, stride_f8, stride_p8,
    stride_h8,
    k4_ptr, v4_ptr, ks4_ptr, vs4_ptr, bt4_ptr, fill4_ptr, len4_ptr, npg4_ptr, stride_bt4, stride_f4, stride_p4,
    stride_h4,
    stride_qb, stride_qh, stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_outb, stride_outh,
    n_total, qk_scale,
    HAS16: tl.constexpr, HAS8: tl.constexpr, HAS4: tl.constexpr,
    PAGE16: tl.constexpr, PAGE8: tl.constexpr, PAGE4: tl.constexpr,
    TILE16: tl.constexpr, TILE8: tl.constexpr, TILE4: tl.constexpr,
    STAGES16: tl.constexpr, STAGES8: tl.constexpr, STAGES4: tl.constexpr,
    W16: tl.constexpr, W8: tl.constexpr, W4: tl.constexpr,
    FAST8: tl.constexpr, FAST4: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr, KV_GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
    FILLED: tl.constexpr, DOT_F32: tl.constexpr, DOT_CVT: tl.constexpr, SUB_CVT: tl.constexpr,
    DIRECT: tl.constexpr, FUSED_MERGE: tl.constexpr, FENCE: tl.constexpr,
    MERGE_H: tl.constexpr, MERGE_S: tl.constexpr, MERGE_PF: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    b = pid_bh // NUM_KV_HEADS
    kv_head = pid_bh % NUM_KV_HEADS
    offs_g = tl.arange(0, BLOCK_G)
    gmask = offs_g < KV_GROUP
    q_rows = b * stride_qb + (kv_head * KV_GROUP + offs_g) * stride_qh
    # ---- steps per tier and this program's byte share (int64: steps x bytes overflow int32)
    steps16 = tl.full([], 0, tl.int64)
    steps8 = tl.full([], 0, tl.int64)
    steps4 = tl.full([], 0, tl.int64)
    if HAS16:
        n16, p16 = _request_pages(len16_ptr, npg16_ptr, b, PAGE16, FILLED)
        steps16 = tl.cdiv(p16.to(tl.int64) * PAGE16, TILE16)
    if HAS8:
        n8, p8 = _request_pages(len8_ptr, npg8_ptr, b, PAGE8, FILLED)
        steps8 = tl.cdiv(p8.to(tl.int64) * PAGE8, TILE8)
    if HAS4:
        n4, p4 = _request_pages(len4_ptr, npg4_ptr, b, PAGE4, FILLED)
        steps4 = tl.cdiv(p4.to(tl.int64) * PAGE4, TILE4)
    base8 = steps16 * W16
    base4 = base8 + steps8 * W8
    total = base4 + steps4 * W4
    n_split = tl.num_programs(1)
    lo_w = (split * total) // n_split
    hi_w = ((split + 1) * total) // n_split
    m_i = tl.full([BLOCK_G], NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], dtype=tl.float32)
    if HAS16:
        lo, hi = _tier_range(lo_w, hi_w, 0, steps16, W16, TILE16)
        acc_t, m_t, l_t = _fp16_loop(q_ptr, q_rows, gmask, lo, hi, k16_ptr, v16_ptr, bt16_ptr + b * stride_bt16,
                                     fill16_ptr + b * stride_f16, n16, p16, kv_head * stride_h16, stride_p16,
                                     qk_scale, BLOCK_G, HEAD_DIM, PAGE16, TILE16, FILLED, DOT_F32, STAGES16)
        m_i, l_i, acc = _combine(m_i, l_i, acc, m_t, l_t, acc_t)
    if HAS8:
        lo, hi = _tier_range(lo_w, hi_w, base8, steps8, W8, TILE8)
        acc_t, m_t, l_t = _int_fold_loop(q_ptr, q_rows, gmask, lo, hi, k8_ptr, v8_ptr, ks8_ptr, vs8_ptr,
                                         bt8_ptr + b * stride_bt8, fill8_ptr + b * stride_f8, n8, p8, kv_head,
                                         stride_p8, stride_h8, qk_scale, 1, BLOCK_G, HEAD_DIM, PAGE8, TILE8,
                                         FILLED, FAST8, DOT_CVT, SUB_CVT, STAGES8)
        m_i, l_i, acc = _combine(m_i, l_i, acc, m_t, l_t, acc_t)
    if HAS4:
        lo, hi = _tier_range(lo_w, hi_w, base4, steps4, W4, TILE4)
        acc_t, m_t, l_t = _int_fold_loop(q_ptr, q_rows, gmask, lo, hi, k4_ptr, v4_ptr, ks4_ptr, vs4_ptr,
                                         bt4_ptr + b * stride_bt4, fill4_ptr + b * stride_f4, n4, p4, kv_head,
                                         stride_p4, stride_h4, qk_scale, 2, BLOCK_G, HEAD_DIM, PAGE4, TILE4,
                                         FILLED, FAST4, DOT_CVT, SUB_CVT, STAGES4)
        m_i, l_i, acc = _combine(m_i, l_i, acc, m_t, l_t, acc_t)
    _finish(acc, acc, m_i, l_i, o_part_ptr, lse_part_ptr, out_ptr, cnt_ptr, b, kv_head, pid_bh,
            split, n_total, offs_g, gmask,
            stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_outb, stride_outh,
            KV_GROUP, HEAD_DIM, 1, DIRECT, FUSED_MERGE, FENCE, MERGE_H, MERGE_S, MERGE_PF)
