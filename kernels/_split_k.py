"""Pieces every split-K decode kernel here shares: constants, the online-softmax step, the
per-split epilogue and the LSE merge of per-(request, q head) partials.

    split s of request b, q head h:  o_part [B, Hq, S, D] fp32 (normalized), lse_part [B, Hq, S]
                                     (log2 domain; an empty split: o = 0, lse = NEG_BIG)
    merge_splits(o_part, lse_part, out)   out[b, h] = sum_s 2^(lse_s - m) o_s / sum_s 2^(lse_s - m)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._tiles import next_pow2

LOG2E = 1.4426950408889634
NEG_BIG: tl.constexpr = tl.constexpr(-1.0e30)  # finite "-inf": exp2 of empty splits stays NaN-free


@triton.jit
def _softmax_step(acc, m_i, l_i, q, k, v, tmask, qk_scale):
    """One online-softmax step (log2 domain): q [M, D], k / v [N, D], tmask [N] -> acc, m, l."""
    s = tl.dot(q, tl.trans(k)) * qk_scale  # [M, N]
    s = tl.where(tmask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    pr = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(pr, 1)
    acc = acc * alpha[:, None] + tl.dot(pr.to(v.dtype), v)
    return acc, m_new, l_i


@triton.jit
def _store_split_result(acc, m_i, l_i, o_part_ptr, lse_part_ptr, b, split, q_heads, offs_d, gmask,
                        stride_ob, stride_oh, stride_os, stride_lb, stride_lh, DIRECT: tl.constexpr):
    """Epilogue of a split-K decode program: normalize one split's (acc, m, l) for the rows
    `q_heads` of request b. DIRECT (one split): the output itself, in its dtype. Otherwise the
    float32 partial and its log2-sum-exp for merge_splits; an empty split (a request without
    tokens there, or a padding row) stores 0 with lse = NEG_BIG, which the merge weighs as 0."""
    nonempty = l_i > 0
    o = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    if DIRECT:
        obase = b * stride_ob + q_heads * stride_oh
        tl.store(o_part_ptr + obase[:, None] + offs_d[None, :], o.to(o_part_ptr.dtype.element_ty),
                 mask=gmask[:, None])
    else:
        lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), NEG_BIG)
        obase = b * stride_ob + q_heads * stride_oh + split * stride_os
        tl.store(o_part_ptr + obase[:, None] + offs_d[None, :], o, mask=gmask[:, None])
        tl.store(lse_part_ptr + b * stride_lb + q_heads * stride_lh + split, lse, mask=gmask)


@triton.jit
def _merge_splits_kernel(
    o_part_ptr, lse_part_ptr, o_ptr, n_splits,
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_out_b, stride_out_h,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr,
):
    pid = tl.program_id(0)
    b = pid // NUM_HEADS
    h = pid % NUM_HEADS
    offs_d = tl.arange(0, HEAD_DIM)
    offs_b = tl.arange(0, BLOCK_S)
    lse_row = lse_part_ptr + b * stride_lb + h * stride_lh
    o_row = o_part_ptr + b * stride_ob + h * stride_oh
    # pass 1: global max of the split LSEs (log2 domain)
    m_vec = tl.full([BLOCK_S], NEG_BIG, dtype=tl.float32)
    for c in range(0, n_splits, BLOCK_S):
        offs_s = c + offs_b
        lse = tl.load(lse_row + offs_s, mask=offs_s < n_splits, other=NEG_BIG)
        m_vec = tl.maximum(m_vec, lse)
    m = tl.max(m_vec, 0)
    # pass 2: weights 2^(lse - m); empty splits have o = 0 (and weight 0 unless all are empty)
    acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
    l_vec = tl.zeros([BLOCK_S], dtype=tl.float32)
    for c in range(0, n_splits, BLOCK_S):
        offs_s = c + offs_b
        smask = offs_s < n_splits
        lse = tl.load(lse_row + offs_s, mask=smask, other=NEG_BIG)
        w = tl.where(smask, tl.exp2(lse - m), 0.0)
        o = tl.load(o_row + offs_s[:, None] * stride_os + offs_d[None, :], mask=smask[:, None],
                    other=0.0)
        acc += tl.sum(w[:, None] * o, 0)
        l_vec += w
    l_run = tl.sum(l_vec, 0)
    out = acc / l_run
    tl.store(o_ptr + b * stride_out_b + h * stride_out_h + offs_d,
             out.to(o_ptr.dtype.element_ty))


def split_outputs(out: torch.Tensor, num_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(o_part, lse_part) for a split-K decode's stage 1 into `out` [B, Hq, D]: one split writes
    `out` itself (o_part a [B, Hq, 1, D] view, lse unused; no merge), more write fp32 partials
    [B, Hq, S, D] and their lse [B, Hq, S] for merge_splits."""
    if num_splits == 1:
        return out.unsqueeze(2), out.new_empty((1, 1, 1), dtype=torch.float32)
    B, Hq, D = out.shape
    return (torch.empty((B, Hq, num_splits, D), dtype=torch.float32, device=out.device),
            torch.empty((B, Hq, num_splits), dtype=torch.float32, device=out.device))


def merge_splits(o_part: torch.Tensor, lse_part: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out [B, Hq, D] = the LSE-weighted sum of the S partials o_part [B, Hq, S, D] (fp32,
    normalized per split) with lse_part [B, Hq, S] (log2). One program per (request, q head)."""
    B, Hq, S, D = o_part.shape
    _merge_splits_kernel[(B * Hq,)](
        o_part, lse_part, out, S,
        o_part.stride(0), o_part.stride(1), o_part.stride(2),
        lse_part.stride(0), lse_part.stride(1), out.stride(0), out.stride(1),
        NUM_HEADS=Hq, HEAD_DIM=D, BLOCK_S=min(16, next_pow2(S)), num_warps=4,
    )
    return out
