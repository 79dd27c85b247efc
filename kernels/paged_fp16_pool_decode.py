"""Split-K flash-decoding over the paged fp16 pool (PagedFp16KVPool: `--attention-backend triton`
without tiers).

    paged_fp16_pool_decode(q, k_pages, v_pages, block_table, seq_lens, sm_scale=None, split_plan=None,
                           even_splits=False, pages_per_iter=None, request_order=None, out=None) -> o
    plan_fp16_splits(table_width, batch, num_kv_heads, device, pages_per_split=None) -> (pps, S)
    longest_first_order(seq_lens) -> int32 [B]
    paged_fp16_pool_decode_reference(q, k_pages, v_pages, block_table, seq_lens) -> o

q, o          [B, Hq, D] model dtype, one new token per request
k/v_pages     [num_pages, Hkv, PAGE, D] (the pool's per-layer buffers, head-major pages)
block_table   int32 [B, W]: page ids of each request, in order; seq_lens int32 [B] (keys, the
              new token included); columns past a request's pages may hold any valid page id

Stage 1, grid (B * Hkv, S): program (b, kv head, split) owns pages [split * pps, (split + 1) * pps)
of request b and all Hq/Hkv q heads of that kv head (the M rows of every tl.dot), so every page
is read once per kv head; `pages_per_iter` pages a loop step (one [PPI * PAGE, D] tile gathered
from PPI pages; default_pages_per_iter picks it from the tile size). S gives ~SPLIT_WAVES programs
per SM (plan_fp16_splits, from the table width alone: no sync). With even_splits each request
divides its own pages over the S splits (a plan fixed for a wide table, as CUDA graphs need,
without short requests running all their pages in one split). Stage 2 (_split_k.merge_splits):
the LSE merge; with S == 1 stage 1 writes o itself.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from ._split_k import LOG2E, NEG_BIG, _softmax_step, _store_split_result, merge_splits, split_outputs
from ._tiles import is_interpret, next_pow2, num_sms

SPLIT_WAVES = 4  # stage-1 programs per SM the planner aims for
# Launch config. Measured on an H200 (benchmarks/kernels/decode_plan.py, graph plan, bf16): 4 warps
# beat 8 by ~25% at SmolLM2 and ~15% at Llama-3-8B heads, stages barely matter.
NUM_WARPS, NUM_STAGES = 4, 2
# fp16 K (or V) elements one loop step loads: with page 64, head_dim 64 takes two pages a step and
# head_dim 128 one. Measured on an H200 (benchmarks/kernels/decode_plan.py --pages-per-iter, graph
# plan, bf16): SmolLM2 heads at batch 256 35.7 us with two pages vs 39.7 us with one (four:
# 37.8); Llama-3-8B heads at batch 64 40.9 vs 42.8 us with two vs one, at batch 128 equal.
FP16_STEP_ELEMS = 8192
MAX_PAGES_PER_ITER = 4


def default_pages_per_iter(page_size: int, head_dim: int) -> int:
    """Pages per decode loop step: FP16_STEP_ELEMS per step, 1 to MAX_PAGES_PER_ITER (both sizes
    are powers of two, so the result is one too)."""
    return max(1, min(MAX_PAGES_PER_ITER, FP16_STEP_ELEMS // (page_size * head_dim)))


@triton.jit
def _split_pages(local_split, n_tok, pps, n_split, PAGE: tl.constexpr, EVEN: tl.constexpr):
    """Page range [p_lo, p_hi) of a split; empty past the request's pages (a no-op split)."""
    n_pages = tl.cdiv(n_tok, PAGE)
    if EVEN:
        pps = tl.cdiv(n_pages, n_split)
    p_lo = local_split * pps
    return p_lo, tl.minimum(p_lo + pps, n_pages)


@triton.jit
def _paged_fp16_decode_kernel(
    q_ptr, o_part_ptr, lse_part_ptr, k_ptr, v_ptr, bt_ptr, len_ptr, order_ptr,
    stride_qb, stride_qh, stride_bt, stride_p, stride_h,
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
    pps, qk_scale,
    NUM_KV_HEADS: tl.constexpr, KV_GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr, PAGES_PER_ITER: tl.constexpr, EVEN_SPLITS: tl.constexpr, DIRECT: tl.constexpr,
    ORDERED: tl.constexpr, DOT_F32: tl.constexpr,
):
    """DIRECT (one split per request): o_part_ptr is o [B, Hq, D] and gets the normalized result.
    ORDERED: program row i serves request order_ptr[i] (longest first), so the GPU starts the
    longest requests first and the short ones fill the tail."""
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
    if DOT_F32:
        q = q.to(tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([BLOCK_G], NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    n_tok = tl.load(len_ptr + b)
    p_lo, p_hi = _split_pages(split, n_tok, pps, tl.num_programs(1), PAGE, EVEN_SPLITS)
    bt_row = bt_ptr + b * stride_bt
    offs_n = tl.arange(0, PAGES_PER_ITER * PAGE)
    page_of = offs_n // PAGE
    in_page = (offs_n % PAGE).to(tl.int64) * HEAD_DIM
    for p in range(p_lo, p_hi, PAGES_PER_ITER):
        if PAGES_PER_ITER == 1:
            page = tl.load(bt_row + p).to(tl.int64)
            tmask = offs_n < n_tok - p * PAGE
        else:  # one [PPI * PAGE, D] tile gathered from PPI pages; the split's last step masks past p_hi
            live = p + page_of < p_hi
            page = tl.load(bt_row + p + page_of, mask=live, other=0).to(tl.int64)
            tmask = live & (offs_n < n_tok - p * PAGE)
        rows = page * stride_p + kv_head * stride_h + in_page
        k = tl.load(k_ptr + rows[:, None] + offs_d[None, :], mask=tmask[:, None], other=0.0)
        v = tl.load(v_ptr + rows[:, None] + offs_d[None, :], mask=tmask[:, None], other=0.0)
        if DOT_F32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        acc, m_i, l_i = _softmax_step(acc, m_i, l_i, q, k, v, tmask, qk_scale)
    _store_split_result(acc, m_i, l_i, o_part_ptr, lse_part_ptr, b, split, q_heads, offs_d, gmask,
                        stride_ob, stride_oh, stride_os, stride_lb, stride_lh, DIRECT)


def plan_fp16_splits(table_width: int, batch: int, num_kv_heads: int, device: torch.device,
                     pages_per_split: Optional[int] = None, split_waves: int = SPLIT_WAVES) -> tuple[int, int]:
    """-> (pages per split, S) from the block table's width alone (no host sync): ~split_waves
    stage-1 programs per SM."""
    width = max(1, int(table_width))
    if pages_per_split is None:
        target = max(1, math.ceil(split_waves * num_sms(torch.device(device)) / max(1, batch * num_kv_heads)))
        pages_per_split = max(1, int(max(width / target, 1.0)))
    return int(pages_per_split), triton.cdiv(width, int(pages_per_split))


def longest_first_order(seq_lens: torch.Tensor) -> torch.Tensor:
    """int32 [B]: the batch's requests by decreasing length, on the device without a host sync
    (capturable in a CUDA graph)."""
    return torch.argsort(seq_lens.to(torch.float32), descending=True).to(torch.int32)


def paged_fp16_pool_decode(
    q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, block_table: torch.Tensor,
    seq_lens: torch.Tensor, sm_scale: Optional[float] = None, split_plan=None, even_splits: bool = False,
    pages_per_iter: Optional[int] = None, request_order: Optional[torch.Tensor] = None,
    out: Optional[torch.Tensor] = None, check: bool = True, num_warps: int = NUM_WARPS,
    num_stages: int = NUM_STAGES,
) -> torch.Tensor:
    """Decode attention of q [B, Hq, D] over the paged fp16 pool -> [B, Hq, D] (module doc).

    split_plan: plan_fp16_splits(...) reused across layers (a plan for a wider table than the
    requests need stays exact: splits past a request's pages are no-ops); request_order: int32 [B]
    permutation (longest_first_order); check=False skips the argument checks (callers that
    checked once per batch)."""
    B, Hq, D = q.shape
    _, Hkv, PAGE, _ = k_pages.shape
    if check:
        assert q.dtype == k_pages.dtype == v_pages.dtype and q.dtype in (torch.float16, torch.bfloat16)
        assert k_pages.shape == v_pages.shape and k_pages.shape[3] == D and k_pages.is_contiguous()
        assert v_pages.is_contiguous() and q.stride(-1) == 1 and Hq % Hkv == 0
        assert PAGE >= 16 and PAGE & (PAGE - 1) == 0 and D >= 16 and D & (D - 1) == 0, (PAGE, D)
        assert block_table.dtype == seq_lens.dtype == torch.int32 and block_table.stride(1) == 1
        assert block_table.shape[0] == seq_lens.shape[0] == B and seq_lens.is_contiguous()
    if pages_per_iter is None:
        pages_per_iter = default_pages_per_iter(PAGE, D)
    assert pages_per_iter >= 1 and pages_per_iter & (pages_per_iter - 1) == 0, pages_per_iter
    if split_plan is None:
        split_plan = plan_fp16_splits(block_table.shape[1], B, Hkv, q.device)
    pps, S = split_plan
    sm_scale = 1.0 / math.sqrt(D) if sm_scale is None else sm_scale
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(-1) == 1
    if B == 0:
        return out
    direct = S == 1  # one split: stage 1 writes the result, no partials, no merge
    o_part, lse_part = split_outputs(out, S)
    kv_group = Hq // Hkv
    interp = is_interpret()
    _paged_fp16_decode_kernel[(B * Hkv, S)](
        q, o_part, lse_part, k_pages, v_pages, block_table, seq_lens,
        request_order if request_order is not None else seq_lens,
        q.stride(0), q.stride(1), block_table.stride(0), k_pages.stride(0), k_pages.stride(1),
        o_part.stride(0), o_part.stride(1), o_part.stride(2), lse_part.stride(0), lse_part.stride(1),
        pps, sm_scale * LOG2E,
        NUM_KV_HEADS=Hkv, KV_GROUP=kv_group, BLOCK_G=max(16, next_pow2(kv_group)), HEAD_DIM=D, PAGE=PAGE,
        PAGES_PER_ITER=pages_per_iter, EVEN_SPLITS=even_splits, DIRECT=direct,
        ORDERED=request_order is not None, DOT_F32=interp and q.dtype == torch.bfloat16,
        num_warps=num_warps, num_stages=1 if interp else num_stages,
    )
    if not direct:
        merge_splits(o_part, lse_part, out)
    return out


def paged_fp16_pool_decode_reference(q, k_pages, v_pages, block_table, seq_lens,
                                     sm_scale: Optional[float] = None) -> torch.Tensor:
    """Torch reference: each request's pages gathered, fp32 attention; a request with no key gets 0."""
    B, Hq, D = q.shape
    _, Hkv, PAGE, _ = k_pages.shape
    sm_scale = 1.0 / math.sqrt(D) if sm_scale is None else sm_scale
    out = torch.zeros_like(q, dtype=torch.float32)
    for b in range(B):
        n = int(seq_lens[b])
        if n == 0:
            continue
        pages = block_table[b, :-(-n // PAGE)].long()
        k = k_pages[pages].permute(0, 2, 1, 3).reshape(-1, Hkv, D)[:n].float().repeat_interleave(Hq // Hkv, 1)
        v = v_pages[pages].permute(0, 2, 1, 3).reshape(-1, Hkv, D)[:n].float().repeat_interleave(Hq // Hkv, 1)
        s = torch.einsum("hd,nhd->hn", q[b].float(), k) * sm_scale
        out[b] = torch.einsum("hn,nhd->hd", s.softmax(-1), v)
    return out.to(q.dtype)
