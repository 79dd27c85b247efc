"""Split-K flash-decoding over the paged tiered KV cache (fp16 / int8 / int4 pages, GQA).

    decode_attention_tiered(q, layer, tables, sm_scale=None, pages_per_split=None) -> o

q  [B, Hq, D] model dtype, one new token per request; o [B, Hq, D] like q.
layer: TieredKVLayer (see paged_layout.py); tables: TieredBlockTables for the batch.

Stage 1, grid (B * Hkv, S16 + S8 + S4): program (b, kv-head, split) owns a run of pages of
ONE tier of request b and all Hq/Hkv query heads that share that kv-head, so every K/V page
is read once per kv-head. Pages are dequantized in registers (fp32 math, then the model
dtype) and fed to tl.dot; the running (max, sum, acc) is written as a partial result:

    split id s:   [0, S16)           fp16 pages  [s*pps16, (s+1)*pps16)
                  [S16, S16+S8)      int8 pages  [(s-S16)*pps8, ...)
                  [S16+S8, S)        int4 pages  ...

The fp16 tier's loop may take several pages per step (`pages_per_iter`, one [PPI * PAGE, D] tile
gathered from PPI pages; default_pages_per_iter picks it from the tile size). Pages per split are
scaled by the tier's bytes per page so every split moves about the same
bytes; S is chosen to give ~SPLIT_WAVES programs per SM. With EVEN_SPLITS each request instead
divides its own pages of a tier evenly over that tier's splits (ppsT = cdiv(pages_b, ST)): the
plan can then be fixed for a wide table (CUDA graphs) without short requests running all their
pages in one split. A tier may get 0 splits (a caller that knows it holds no token: the
pure-fp16 backend). Stage 2, grid (B * Hq): log-sum-exp merge of the S partials; with S == 1
stage 1 writes the output itself and there is no stage 2. Attention over a set is order-free
(K is post-RoPE), so per-tier partials merge exactly like split-K partials of one sequence.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from . import tier_codec as tc
from ._tiles import (
    _dequant_tile, _load_page_raw, _load_page_tile, is_interpret, next_pow2, num_sms,
)
from .paged_layout import TieredBlockTables, TieredKVLayer, gather_request_kv

LOG2E = 1.4426950408889634
SPLIT_WAVES = 4  # stage-1 programs per SM we aim for
NEG_BIG: tl.constexpr = tl.constexpr(-1.0e30)  # finite "-inf": exp2 of empty splits stays NaN-free

if is_interpret():
    _DECODE_CONFIGS = [triton.Config({}, num_warps=4, num_stages=1)]
else:
    _DECODE_CONFIGS = [
        triton.Config({}, num_warps=w, num_stages=s) for w in (4, 8) for s in (2, 3, 4)
    ]
# fp16-only batches (no int8 / int4 splits) use this config without tuning. Measured on an H200
# (benchmarks/kernels/decode_plan.py, graph plan, bf16): 4 warps beat 8 by ~25% at SmolLM2 and
# ~15% at Llama-3-8B heads, stages barely matter. Tuning would otherwise happen on whatever batch
# comes first; under CUDA-graph capture that is all-padding rows (empty), i.e. noise.
_FP16_ONLY_CONFIG = (4, 2)  # (num_warps, num_stages)


# fp16 K (or V) elements one loop step loads: with page 64, head_dim 64 takes two pages a step and
# head_dim 128 one. Measured on an H200 (benchmarks/kernels/decode_plan.py --pages-per-iter, graph
# plan, bf16): SmolLM2 heads at batch 256 35.7 us with two pages vs 39.7 us with one (four:
# 37.8); Llama-3-8B heads at batch 64 40.9 vs 42.8 us with two vs one, at batch 128 equal.
FP16_STEP_ELEMS = 8192
MAX_PAGES_PER_ITER = 4


def default_pages_per_iter(page_size: int, head_dim: int) -> int:
    """fp16 pages per decode loop step: FP16_STEP_ELEMS per step, 1 to MAX_PAGES_PER_ITER
    (both sizes are powers of two, so the result is one too)."""
    return max(1, min(MAX_PAGES_PER_ITER, FP16_STEP_ELEMS // (page_size * head_dim)))


def _prune_configs(configs, named_args, **kwargs):
    if kwargs.get("FP16_ONLY") and not is_interpret():
        return [c for c in configs if (c.num_warps, c.num_stages) == _FP16_ONLY_CONFIG]
    return configs


@triton.jit
def _store_split_result(acc, m_i, l_i, o_part_ptr, lse_part_ptr, b, split, q_heads, offs_d, gmask,
                        stride_ob, stride_oh, stride_os, stride_lb, stride_lh, DIRECT: tl.constexpr):
    """Epilogue of every split-K decode kernel: normalize one split's (acc, m, l) for the rows
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
def _softmax_step(acc, m_i, l_i, q, k, v, tmask, qk_scale):
    s = tl.dot(q, tl.trans(k)) * qk_scale  # [M, PAGE]
    s = tl.where(tmask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    pr = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(pr, 1)
    acc = acc * alpha[:, None] + tl.dot(pr.to(v.dtype), v)
    return acc, m_new, l_i


@triton.jit
def _attend_pages(
    acc, m_i, l_i, q, bt_row_ptr, n_tok, p_lo, p_hi,
    data_k_ptr, data_v_ptr, ks_ptr, kz_ptr, vs_ptr, vz_ptr,
    stride_p, stride_h, stride_sp, stride_sh, kv_head, qk_scale,
    TIER: tl.constexpr, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, GROUP_SIZE: tl.constexpr,
    PREFETCH: tl.constexpr, FAST: tl.constexpr,
):
    """Online-softmax accumulate pages [p_lo, p_hi) of one tier (log2 domain).
    q [M, D]; acc [M, D] fp32; m_i, l_i [M] fp32.

    PREFETCH (quantized tiers): the raw bytes of page p+1 are loaded into registers before
    page p is dequantized, so the next page's DRAM latency overlaps this page's ALU work
    (register-destination loads are not covered by Triton's async-copy pipeliner)."""
    offs_t = tl.arange(0, PAGE)
    if PREFETCH and TIER != 0:
        live = p_lo < p_hi
        page = tl.load(bt_row_ptr + p_lo, mask=live, other=0).to(tl.int64)
        tm = offs_t < tl.where(live, n_tok - p_lo * PAGE, 0)
        base = page * stride_p + kv_head * stride_h
        sbase = page * stride_sp + kv_head * stride_sh
        kq, ks, kz = _load_page_raw(data_k_ptr, ks_ptr, kz_ptr, base, sbase, offs_t, tm,
                                    TIER, HEAD_DIM, GROUP_SIZE)
        vq, vs, vz = _load_page_raw(data_v_ptr, vs_ptr, vz_ptr, base, sbase, offs_t, tm,
                                    TIER, HEAD_DIM, GROUP_SIZE)
        for p in range(p_lo, p_hi):
            nxt = p + 1 < p_hi
            page_n = tl.load(bt_row_ptr + p + 1, mask=nxt, other=0).to(tl.int64)
            tm_n = offs_t < tl.where(nxt, n_tok - (p + 1) * PAGE, 0)
            base_n = page_n * stride_p + kv_head * stride_h
            sbase_n = page_n * stride_sp + kv_head * stride_sh
            kq_n, ks_n, kz_n = _load_page_raw(data_k_ptr, ks_ptr, kz_ptr, base_n, sbase_n,
                                              offs_t, tm_n, TIER, HEAD_DIM, GROUP_SIZE)
            vq_n, vs_n, vz_n = _load_page_raw(data_v_ptr, vs_ptr, vz_ptr, base_n, sbase_n,
                                              offs_t, tm_n, TIER, HEAD_DIM, GROUP_SIZE)
            k = _dequant_tile(kq, ks, kz, q.dtype, TIER, PAGE, HEAD_DIM, FAST)
            v = _dequant_tile(vq, vs, vz, q.dtype, TIER, PAGE, HEAD_DIM, FAST)
            tmask = offs_t < n_tok - p * PAGE
            acc, m_i, l_i = _softmax_step(acc, m_i, l_i, q, k, v, tmask, qk_scale)
            kq, ks, kz, vq, vs, vz = kq_n, ks_n, kz_n, vq_n, vs_n, vz_n
    else:
        for p in range(p_lo, p_hi):
            page = tl.load(bt_row_ptr + p).to(tl.int64)
            tmask = offs_t < n_tok - p * PAGE
            base = page * stride_p + kv_head * stride_h
            sbase = page * stride_sp + kv_head * stride_sh
            k = _load_page_tile(data_k_ptr, ks_ptr, kz_ptr, base, sbase, offs_t, tmask,
                                q.dtype, TIER, PAGE, HEAD_DIM, GROUP_SIZE, FAST)
            v = _load_page_tile(data_v_ptr, vs_ptr, vz_ptr, base, sbase, offs_t, tmask,
                                q.dtype, TIER, PAGE, HEAD_DIM, GROUP_SIZE, FAST)
            acc, m_i, l_i = _softmax_step(acc, m_i, l_i, q, k, v, tmask, qk_scale)
    return acc, m_i, l_i


@triton.jit
def _attend_fp16_multi(
    acc, m_i, l_i, q, bt_row_ptr, n_tok, p_lo, p_hi, k_ptr, v_ptr, stride_p, stride_h, kv_head, qk_scale,
    PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, PAGES_PER_ITER: tl.constexpr,
):
    """_attend_pages for the fp16 tier, PAGES_PER_ITER pages per step: one [PPI * PAGE, D] tile
    of K and of V gathered from PPI pages. More bytes in flight per step and fewer dependent
    page-id -> K/V round trips; the split's last step masks pages past p_hi."""
    offs_n = tl.arange(0, PAGES_PER_ITER * PAGE)
    offs_d = tl.arange(0, HEAD_DIM)
    page_of = offs_n // PAGE
    in_page = (offs_n % PAGE).to(tl.int64) * HEAD_DIM
    for p in range(p_lo, p_hi, PAGES_PER_ITER):
        live = p + page_of < p_hi
        page = tl.load(bt_row_ptr + p + page_of, mask=live, other=0).to(tl.int64)
        tmask = live & (offs_n < n_tok - p * PAGE)
        rows = page * stride_p + kv_head * stride_h + in_page
        k = tl.load(k_ptr + rows[:, None] + offs_d[None, :], mask=tmask[:, None], other=0.0)
        v = tl.load(v_ptr + rows[:, None] + offs_d[None, :], mask=tmask[:, None], other=0.0)
        acc, m_i, l_i = _softmax_step(acc, m_i, l_i, q, k, v, tmask, qk_scale)
    return acc, m_i, l_i


@triton.jit
def _split_pages(local_split, n_tok, pps, n_split, PAGE: tl.constexpr, EVEN: tl.constexpr):
    """Page range [p_lo, p_hi) of split `local_split` (0-based within its tier); empty past the
    request's pages, so such splits are no-ops."""
    n_pages = tl.cdiv(n_tok, PAGE)
    if EVEN:
        pps = tl.cdiv(n_pages, n_split)
    p_lo = local_split * pps
    return p_lo, tl.minimum(p_lo + pps, n_pages)


@triton.autotune(configs=_DECODE_CONFIGS,
                 key=["HEAD_DIM", "PAGE", "BLOCK_G", "GROUP_SIZE", "PREFETCH", "FAST_DEQUANT", "FP16_ONLY",
                      "PAGES_PER_ITER"],
                 prune_configs_by={"early_config_prune": _prune_configs})
@triton.jit
def _decode_tiered_kernel(
    q_ptr, o_part_ptr, lse_part_ptr,
    k16_ptr, v16_ptr,
    k8_ptr, v8_ptr, k8s_ptr, k8z_ptr, v8s_ptr, v8z_ptr,
    k4_ptr, v4_ptr, k4s_ptr, k4z_ptr, v4s_ptr, v4z_ptr,
    bt16_ptr, bt8_ptr, bt4_ptr, len16_ptr, len8_ptr, len4_ptr, order_ptr,
    stride_qb, stride_qh, stride_bt16, stride_bt8, stride_bt4,
    stride_p16, stride_h16, stride_p8, stride_h8, stride_p4, stride_h4,
    stride_sp8, stride_sh8, stride_sp4, stride_sh4,
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
    n_split16, n_split8, pps16, pps8, pps4, qk_scale,
    NUM_KV_HEADS: tl.constexpr, KV_GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr, GROUP_SIZE: tl.constexpr, PAGE: tl.constexpr,
    PREFETCH: tl.constexpr, FAST_DEQUANT: tl.constexpr, EVEN_SPLITS: tl.constexpr,
    FP16_ONLY: tl.constexpr, DIRECT: tl.constexpr, PAGES_PER_ITER: tl.constexpr, ORDERED: tl.constexpr,
):
    """DIRECT (a single split per request): o_part_ptr is the output [B, Hq, D] in the model
    dtype (stride_os unused) and gets the normalized result; no LSE, no merge pass.
    ORDERED: program row i serves request order_ptr[i] (a permutation of the batch, longest
    first), so the GPU starts the longest requests first and the short ones fill the tail."""
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    b = pid_bh // NUM_KV_HEADS
    if ORDERED:
        b = tl.load(order_ptr + b)
    kv_head = pid_bh % NUM_KV_HEADS

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_DIM)
    gmask = offs_g < KV_GROUP
    q_heads = kv_head * KV_GROUP + offs_g
    q = tl.load(q_ptr + b * stride_qb + q_heads[:, None] * stride_qh + offs_d[None, :],
                mask=gmask[:, None], other=0.0)

    acc = tl.zeros([BLOCK_G, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([BLOCK_G], NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    if split < n_split16:
        n_tok = tl.load(len16_ptr + b)
        p_lo, p_hi = _split_pages(split, n_tok, pps16, n_split16, PAGE, EVEN_SPLITS)
        if PAGES_PER_ITER > 1:
            acc, m_i, l_i = _attend_fp16_multi(
                acc, m_i, l_i, q, bt16_ptr + b * stride_bt16, n_tok, p_lo, p_hi, k16_ptr, v16_ptr,
                stride_p16, stride_h16, kv_head, qk_scale, PAGE, HEAD_DIM, PAGES_PER_ITER)
        else:
            acc, m_i, l_i = _attend_pages(
                acc, m_i, l_i, q, bt16_ptr + b * stride_bt16, n_tok, p_lo, p_hi,
                k16_ptr, v16_ptr, k16_ptr, k16_ptr, k16_ptr, k16_ptr,
                stride_p16, stride_h16, 0, 0, kv_head, qk_scale,
                0, PAGE, HEAD_DIM, GROUP_SIZE, False, False)
    elif split < n_split16 + n_split8:
        n_tok = tl.load(len8_ptr + b)
        p_lo, p_hi = _split_pages(split - n_split16, n_tok, pps8, n_split8, PAGE, EVEN_SPLITS)
        acc, m_i, l_i = _attend_pages(
            acc, m_i, l_i, q, bt8_ptr + b * stride_bt8, n_tok, p_lo, p_hi,
            k8_ptr, v8_ptr, k8s_ptr, k8z_ptr, v8s_ptr, v8z_ptr,
            stride_p8, stride_h8, stride_sp8, stride_sh8, kv_head, qk_scale,
            1, PAGE, HEAD_DIM, GROUP_SIZE, PREFETCH, FAST_DEQUANT)
    else:
        n_tok = tl.load(len4_ptr + b)
        n_split4 = tl.num_programs(1) - n_split16 - n_split8
        p_lo, p_hi = _split_pages(split - n_split16 - n_split8, n_tok, pps4, n_split4, PAGE, EVEN_SPLITS)
        acc, m_i, l_i = _attend_pages(
            acc, m_i, l_i, q, bt4_ptr + b * stride_bt4, n_tok, p_lo, p_hi,
            k4_ptr, v4_ptr, k4s_ptr, k4z_ptr, v4s_ptr, v4z_ptr,
            stride_p4, stride_h4, stride_sp4, stride_sh4, kv_head, qk_scale,
            2, PAGE, HEAD_DIM, GROUP_SIZE, PREFETCH, FAST_DEQUANT)

    _store_split_result(acc, m_i, l_i, o_part_ptr, lse_part_ptr, b, split, q_heads, offs_d, gmask,
                        stride_ob, stride_oh, stride_os, stride_lb, stride_lh, DIRECT)


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


def merge_splits(o_part: torch.Tensor, lse_part: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Stage 2 of every split-K decode here: out [B, Hq, D] = the LSE-weighted sum of the S
    partials o_part [B, Hq, S, D] (fp32, normalized per split) with lse_part [B, Hq, S] (log2)."""
    B, Hq, S, D = o_part.shape
    _merge_splits_kernel[(B * Hq,)](
        o_part, lse_part, out, S,
        o_part.stride(0), o_part.stride(1), o_part.stride(2),
        lse_part.stride(0), lse_part.stride(1), out.stride(0), out.stride(1),
        NUM_HEADS=Hq, HEAD_DIM=D, BLOCK_S=min(16, next_pow2(S)), num_warps=4,
    )
    return out


def _tier_page_weight(tier: int, head_dim: int, group_size: int, elem_bytes: int) -> float:
    return tc.payload_bytes(tier, head_dim, group_size, elem_bytes) / (head_dim * elem_bytes)


def plan_splits(tables: TieredBlockTables, num_kv_heads: int, head_dim: int, group_size: int,
                elem_bytes: int, device: torch.device, pages_per_split=None,
                split_waves: int = SPLIT_WAVES):
    """-> (pps16, pps8, pps4), (S16, S8, S4). Uses only the block-table widths (no sync)."""
    maxp = [int(tables.tables[t].shape[1]) for t in tc.TIERS]
    if pages_per_split is None:
        B = tables.batch_size
        target = max(1, math.ceil(split_waves * num_sms(device) / max(1, B * num_kv_heads)))
        w = [_tier_page_weight(t, head_dim, group_size, elem_bytes) for t in tc.TIERS]
        work = sum(mp * wt for mp, wt in zip(maxp, w))
        per_split = max(work / target, 1.0)
        pages_per_split = [max(1, int(per_split / wt)) for wt in w]
    pps = tuple(int(p) for p in pages_per_split)
    splits = tuple(triton.cdiv(mp, p) for mp, p in zip(maxp, pps))
    return pps, splits


def longest_first_order(tables: TieredBlockTables, elem_weights=(1.0, 0.5, 0.25)) -> torch.Tensor:
    """int32 [B]: the batch's requests by decreasing work (tier tokens weighted by their bytes per
    token), on the device without a host sync (capturable in a CUDA graph)."""
    work = sum(ln.to(torch.float32) * w for ln, w in zip(tables.lens, elem_weights))
    return torch.argsort(work, descending=True).to(torch.int32)


def decode_attention_tiered(
    q: torch.Tensor, layer: TieredKVLayer, tables: TieredBlockTables,
    sm_scale: Optional[float] = None, pages_per_split=None, out: Optional[torch.Tensor] = None,
    prefetch: bool = True, split_waves: int = SPLIT_WAVES, fast_dequant: bool = True,
    split_plan=None, check: bool = True, even_splits: bool = False, pages_per_iter: Optional[int] = None,
    request_order: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Decode attention of q [B, Hq, D] over each request's tiered cache -> [B, Hq, D].

    pages_per_split: (fp16, int8, int4) pages per stage-1 program, default planned from the
    block-table widths (plan_splits); prefetch: register double-buffering of quantized pages;
    split_waves: stage-1 programs per SM the planner aims for; fast_dequant: fp16 bit-trick
    dequantization (see _tiles._dequant_tile) instead of the codec-exact fp32 path.
    split_plan: a plan_splits result for these tables, reused as is (callers that run many
    layers over one batch plan once); check=False skips the layout checks of `layer` and
    `tables` (callers that checked them once). Splits past a request's length are no-ops, so
    a plan for wider tables than the requests need stays exact (CUDA-graph decode);
    even_splits: each request spreads its own pages over the planned split counts (module doc);
    pages_per_iter: fp16 pages per loop step, a power of two (default: default_pages_per_iter);
    quantized tiers always take one.
    request_order: int32 [B], a permutation of the batch; the kernel's programs take the requests
    in this order (longest_first_order: the GPU runs the long requests first, so the short ones
    fill the tail instead of a long one running alone at the end)."""
    if check:
        layer.check()
    B, Hq, D = q.shape
    Hkv, PAGE = layer.num_kv_heads, layer.page_size
    assert q.dtype == layer.dtype and D == layer.head_dim, (q.dtype, layer.dtype, D)
    assert q.stride(-1) == 1, "q: last dim must be contiguous"
    assert Hq % Hkv == 0, (Hq, Hkv)
    assert PAGE >= 16 and PAGE & (PAGE - 1) == 0, "PAGE must be a power of two >= 16"
    assert D & (D - 1) == 0 and D >= 16, "head_dim must be a power of two >= 16"
    if check:
        tables.check(PAGE)
    assert tables.batch_size == B
    if pages_per_iter is None:
        pages_per_iter = default_pages_per_iter(PAGE, D)
    assert pages_per_iter >= 1 and pages_per_iter & (pages_per_iter - 1) == 0, pages_per_iter
    sm_scale = 1.0 / math.sqrt(D) if sm_scale is None else sm_scale
    kv_group = Hq // Hkv
    if split_plan is None:
        split_plan = plan_splits(tables, Hkv, D, layer.group_size, q.element_size(), q.device,
                                 pages_per_split, split_waves)
    pps, splits = split_plan
    S = sum(splits)
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(-1) == 1
    direct = S == 1  # one split: stage 1 writes the result, no partials, no merge
    if direct:
        o_part, lse_part = out.unsqueeze(2), out.new_empty((1, 1, 1), dtype=torch.float32)
    else:
        o_part = torch.empty((B, Hq, S, D), dtype=torch.float32, device=q.device)
        lse_part = torch.empty((B, Hq, S), dtype=torch.float32, device=q.device)
    f16, i8, i4 = layer.pages
    bt, ln = tables.tables, tables.lens
    _decode_tiered_kernel[(B * Hkv, S)](
        q, o_part, lse_part,
        f16.k, f16.v,
        i8.k, i8.v, i8.k_scale, i8.k_zero, i8.v_scale, i8.v_zero,
        i4.k, i4.v, i4.k_scale, i4.k_zero, i4.v_scale, i4.v_zero,
        bt[0], bt[1], bt[2], ln[0], ln[1], ln[2],
        request_order if request_order is not None else ln[0],
        q.stride(0), q.stride(1), bt[0].stride(0), bt[1].stride(0), bt[2].stride(0),
        f16.k.stride(0), f16.k.stride(1), i8.k.stride(0), i8.k.stride(1),
        i4.k.stride(0), i4.k.stride(1),
        i8.k_scale.stride(0), i8.k_scale.stride(1), i4.k_scale.stride(0), i4.k_scale.stride(1),
        o_part.stride(0), o_part.stride(1), o_part.stride(2),
        lse_part.stride(0), lse_part.stride(1),
        splits[0], splits[1], pps[0], pps[1], pps[2], sm_scale * LOG2E,
        NUM_KV_HEADS=Hkv, KV_GROUP=kv_group, BLOCK_G=max(16, next_pow2(kv_group)),
        HEAD_DIM=D, GROUP_SIZE=layer.group_size, PAGE=PAGE, PREFETCH=prefetch,
        FAST_DEQUANT=fast_dequant, EVEN_SPLITS=even_splits,
        FP16_ONLY=splits[1] == 0 and splits[2] == 0, DIRECT=direct, PAGES_PER_ITER=pages_per_iter,
        ORDERED=request_order is not None,
    )
    if direct:
        return out
    merge_splits(o_part, lse_part, out)
    return out


def decode_attention_tiered_reference(q, layer: TieredKVLayer, tables: TieredBlockTables,
                                      sm_scale: Optional[float] = None) -> torch.Tensor:
    """Torch reference: dequantize each request's cache (tier_codec) and attend in fp32."""
    B, Hq, D = q.shape
    sm_scale = 1.0 / math.sqrt(D) if sm_scale is None else sm_scale
    group = Hq // layer.num_kv_heads
    out = torch.zeros_like(q, dtype=torch.float32)
    for b in range(B):
        k, v = gather_request_kv(layer, tables, b)  # [n, Hkv, D] fp32
        if k.shape[0] == 0:
            continue
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        s = torch.einsum("hd,nhd->hn", q[b].float(), k) * sm_scale
        out[b] = torch.einsum("hn,nhd->hd", s.softmax(-1), v)
    return out.to(q.dtype)
