"""Split-K flash-decoding over slot-granular tier stores (token gather, no pages, GQA).

    decode_attention_gather(q, layer, tables, sm_scale=None, max_tokens=None) -> o

The token-gather twin of decode_attention.py for SpectrumKV's TieredKVPool, whose stores hold
one token per row (PAGE = 1), so a request's tokens are scattered rows, not runs of pages.

q  [B, Hq, D] model dtype, one new token per request; o [B, Hq, D] like q.
layer: TieredKVLayer with page_size 1: per tier t a store [R_t, Hkv, 1, W_t] (+ k/v scale and
       zero [R_t, Hkv, 1, D/G] fp16 for int8 / int4), i.e. a pool's [R_t, Hkv, W_t] stores
       viewed as `x[:, :, None, :]` (paged_layout.py with PAGE = 1; format = tier_codec.py).
tables: TieredBlockTables whose entries are store ROWS: tables[t] int32 [B, W_t], request b's
       tier-t keys are rows tables[t][b, :lens[t][b]] (any order; entries past lens unread).

Stage 1, grid (B * Hkv, S). Each request's work is laid on one cost line, tier after tier,
in tiles of BLOCK_N rows; tier t costs w_t per token (tier_weights), so a tile costs
c_t = BLOCK_N * w_t:

    cost:  0 ......... T16*c16 | ......... + T8*c8 | ......... + T4*c4      T_t = cdiv(n_t, BLOCK_N)
           fp16 tiles            int8 tiles           int4 tiles
    split s owns the tiles whose START lies in [s * split_cost, (s+1) * split_cost)

so every tile belongs to exactly one split, a split may span a tier boundary, and splits
past a request's end are empty (o = 0, lse = NEG_BIG; the merge gives them weight 0). S
comes from the host bound max_tokens (no sync); see plan_gather_splits. A program (b,
kv-head, split) gathers each tile's rows (`tables[t][b, j]`), dequantizes in registers
(_tiles._dequant_tile, the paged kernel's math) and runs a log2-domain online softmax for
all Hq/Hkv query heads of its kv-head with tl.dot (rows padded to BLOCK_G >= 16). Stage 2,
grid (B * Hq): decode_attention's log-sum-exp merge of the S partials. K is post-RoPE, so
attention is a set function of the keys: tier order and row order do not matter.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from ._tiles import _dequant_tile, _load_rows_raw, is_interpret, next_pow2, num_sms
from .decode_attention import (
    LOG2E, NEG_BIG, SPLIT_WAVES, merge_splits, _softmax_step, _store_split_result, decode_attention_tiered_reference,
)
from .paged_layout import TieredBlockTables, TieredKVLayer

# Per-token cost of each tier on the split cost line (fp16, int8, int4). Equal by default:
# a gathered row costs whole sectors whatever its payload (int4 K: 64 B + two 8 B scale rows
# vs 256 B fp16 -> 4 vs 8 sectors, not 80 vs 256 B), and dequantization is issue-bound
# (README section 5), so bytes would overweight fp16. Tune with measurements.
DEFAULT_TIER_WEIGHTS = (1, 1, 1)

if is_interpret():
    _GATHER_CONFIGS = [triton.Config({}, num_warps=4, num_stages=1)]
else:
    _GATHER_CONFIGS = [
        triton.Config({}, num_warps=w, num_stages=s) for w, s in ((4, 2), (4, 3), (8, 2), (8, 3))
    ]


@triton.jit
def _dequant_step(acc, m_i, l_i, q, kq, ks, kz, vq, vs, vz, tmask, qk_scale,
                  TIER: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                  FAST: tl.constexpr, DOT_F32: tl.constexpr):
    """Dequantize one gathered K/V tile to q's dtype and take one online-softmax step."""
    k = _dequant_tile(kq, ks, kz, q.dtype, TIER, BLOCK_N, HEAD_DIM, FAST)
    v = _dequant_tile(vq, vs, vz, q.dtype, TIER, BLOCK_N, HEAD_DIM, FAST)
    if DOT_F32:
        return _softmax_step(acc, m_i, l_i, q.to(tl.float32), k.to(tl.float32), v.to(tl.float32),
                             tmask, qk_scale)
    else:
        return _softmax_step(acc, m_i, l_i, q, k, v, tmask, qk_scale)


@triton.jit
def _attend_rows(
    acc, m_i, l_i, q, rows_ptr, j_lo, j_hi,
    data_k_ptr, data_v_ptr, ks_ptr, kz_ptr, vs_ptr, vz_ptr,
    stride_r, stride_h, stride_sr, stride_sh, kv_head, qk_scale,
    TIER: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    GROUP_SIZE: tl.constexpr, PREFETCH: tl.constexpr, FAST: tl.constexpr, DOT_F32: tl.constexpr,
):
    """Online-softmax accumulate the keys at table entries [j_lo, j_hi) of one tier, BLOCK_N
    gathered rows at a time. q [M, D] model dtype; acc [M, D] fp32; m_i, l_i [M] fp32.

    PREFETCH (quantized tiers): tile i+1's table entries and raw bytes are loaded before tile
    i is dequantized, hiding the dependent (table -> row) load chain behind this tile's ALU
    work. DOT_F32: dequantized tiles go to tl.dot as fp32 (interpreter + bf16 only, below)."""
    offs_n = tl.arange(0, BLOCK_N)
    if PREFETCH and TIER != 0:
        tm = j_lo + offs_n < j_hi
        r = tl.load(rows_ptr + j_lo + offs_n, mask=tm, other=0).to(tl.int64)
        roff = r * stride_r + kv_head * stride_h
        soff = r * stride_sr + kv_head * stride_sh
        kq, ks, kz = _load_rows_raw(data_k_ptr, ks_ptr, kz_ptr, roff, soff, tm, TIER, HEAD_DIM, GROUP_SIZE)
        vq, vs, vz = _load_rows_raw(data_v_ptr, vs_ptr, vz_ptr, roff, soff, tm, TIER, HEAD_DIM, GROUP_SIZE)
        for j0 in range(j_lo, j_hi, BLOCK_N):
            jn = j0 + BLOCK_N + offs_n
            tm_n = jn < j_hi
            rn = tl.load(rows_ptr + jn, mask=tm_n, other=0).to(tl.int64)
            roff_n = rn * stride_r + kv_head * stride_h
            soff_n = rn * stride_sr + kv_head * stride_sh
            kq_n, ks_n, kz_n = _load_rows_raw(data_k_ptr, ks_ptr, kz_ptr, roff_n, soff_n, tm_n,
                                              TIER, HEAD_DIM, GROUP_SIZE)
            vq_n, vs_n, vz_n = _load_rows_raw(data_v_ptr, vs_ptr, vz_ptr, roff_n, soff_n, tm_n,
                                              TIER, HEAD_DIM, GROUP_SIZE)
            tmask = j0 + offs_n < j_hi
            acc, m_i, l_i = _dequant_step(acc, m_i, l_i, q, kq, ks, kz, vq, vs, vz, tmask, qk_scale,
                                          TIER, BLOCK_N, HEAD_DIM, FAST, DOT_F32)
            kq, ks, kz, vq, vs, vz = kq_n, ks_n, kz_n, vq_n, vs_n, vz_n
    else:
        for j0 in range(j_lo, j_hi, BLOCK_N):
            tmask = j0 + offs_n < j_hi
            r = tl.load(rows_ptr + j0 + offs_n, mask=tmask, other=0).to(tl.int64)
            roff = r * stride_r + kv_head * stride_h
            soff = r * stride_sr + kv_head * stride_sh
            kq, ks, kz = _load_rows_raw(data_k_ptr, ks_ptr, kz_ptr, roff, soff, tmask,
                                        TIER, HEAD_DIM, GROUP_SIZE)
            vq, vs, vz = _load_rows_raw(data_v_ptr, vs_ptr, vz_ptr, roff, soff, tmask,
                                        TIER, HEAD_DIM, GROUP_SIZE)
            acc, m_i, l_i = _dequant_step(acc, m_i, l_i, q, kq, ks, kz, vq, vs, vz, tmask, qk_scale,
                                          TIER, BLOCK_N, HEAD_DIM, FAST, DOT_F32)
    return acc, m_i, l_i


@triton.jit
def _tile_range(lo, hi, start, tile_cost, n_tok, BLOCK_N: tl.constexpr):
    """Table entries [j_lo, j_hi) of the tiles of one tier whose start cost lies in [lo, hi).
    Tile i starts at start + i * tile_cost; operands of cdiv are kept >= 0."""
    i_lo = tl.cdiv(tl.maximum(lo - start, 0), tile_cost)
    i_hi = tl.cdiv(tl.maximum(hi - start, 0), tile_cost)
    return i_lo * BLOCK_N, tl.minimum(i_hi * BLOCK_N, n_tok)


@triton.autotune(configs=_GATHER_CONFIGS,
                 key=["HEAD_DIM", "BLOCK_N", "BLOCK_G", "GROUP_SIZE", "PREFETCH", "FAST_DEQUANT", "DOT_F32"])
@triton.jit
def _decode_gather_kernel(
    q_ptr, o_part_ptr, lse_part_ptr,
    k16_ptr, v16_ptr,
    k8_ptr, v8_ptr, k8s_ptr, k8z_ptr, v8s_ptr, v8z_ptr,
    k4_ptr, v4_ptr, k4s_ptr, k4z_ptr, v4s_ptr, v4z_ptr,
    rows16_ptr, rows8_ptr, rows4_ptr, len16_ptr, len8_ptr, len4_ptr,
    stride_qb, stride_qh, stride_t16, stride_t8, stride_t4,
    stride_r16, stride_h16, stride_r8, stride_h8, stride_r4, stride_h4,
    stride_sr8, stride_sh8, stride_sr4, stride_sh4,
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
    split_cost, w16, w8, w4, qk_scale,
    NUM_KV_HEADS: tl.constexpr, KV_GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr, GROUP_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    PREFETCH: tl.constexpr, FAST_DEQUANT: tl.constexpr, DOT_F32: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    b = pid_bh // NUM_KV_HEADS
    kv_head = pid_bh % NUM_KV_HEADS

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_DIM)
    gmask = offs_g < KV_GROUP
    q_heads = kv_head * KV_GROUP + offs_g
    q = tl.load(q_ptr + b * stride_qb + q_heads[:, None] * stride_qh + offs_d[None, :],
                mask=gmask[:, None], other=0.0)

    # ---- this split's slice of the request's cost line (module docstring)
    n16 = tl.load(len16_ptr + b)
    n8 = tl.load(len8_ptr + b)
    n4 = tl.load(len4_ptr + b)
    c16 = BLOCK_N * w16
    c8 = BLOCK_N * w8
    c4 = BLOCK_N * w4
    start8 = tl.cdiv(n16, BLOCK_N) * c16
    start4 = start8 + tl.cdiv(n8, BLOCK_N) * c8
    lo = split * split_cost
    hi = lo + split_cost
    j16_lo, j16_hi = _tile_range(lo, hi, 0, c16, n16, BLOCK_N)
    j8_lo, j8_hi = _tile_range(lo, hi, start8, c8, n8, BLOCK_N)
    j4_lo, j4_hi = _tile_range(lo, hi, start4, c4, n4, BLOCK_N)

    acc = tl.zeros([BLOCK_G, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([BLOCK_G], NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc, m_i, l_i = _attend_rows(
        acc, m_i, l_i, q, rows16_ptr + b * stride_t16, j16_lo, j16_hi,
        k16_ptr, v16_ptr, k16_ptr, k16_ptr, k16_ptr, k16_ptr,
        stride_r16, stride_h16, 0, 0, kv_head, qk_scale,
        0, BLOCK_N, HEAD_DIM, GROUP_SIZE, False, False, DOT_F32)
    acc, m_i, l_i = _attend_rows(
        acc, m_i, l_i, q, rows8_ptr + b * stride_t8, j8_lo, j8_hi,
        k8_ptr, v8_ptr, k8s_ptr, k8z_ptr, v8s_ptr, v8z_ptr,
        stride_r8, stride_h8, stride_sr8, stride_sh8, kv_head, qk_scale,
        1, BLOCK_N, HEAD_DIM, GROUP_SIZE, PREFETCH, FAST_DEQUANT, DOT_F32)
    acc, m_i, l_i = _attend_rows(
        acc, m_i, l_i, q, rows4_ptr + b * stride_t4, j4_lo, j4_hi,
        k4_ptr, v4_ptr, k4s_ptr, k4z_ptr, v4s_ptr, v4z_ptr,
        stride_r4, stride_h4, stride_sr4, stride_sh4, kv_head, qk_scale,
        2, BLOCK_N, HEAD_DIM, GROUP_SIZE, PREFETCH, FAST_DEQUANT, DOT_F32)

    _store_split_result(acc, m_i, l_i, o_part_ptr, lse_part_ptr, b, split, q_heads, offs_d, gmask,
                        stride_ob, stride_oh, stride_os, stride_lb, stride_lh, False)


def default_block_n() -> int:
    return 16 if is_interpret() else 64


def plan_gather_splits(max_tokens: int, batch_size: int, num_kv_heads: int, device: torch.device,
                       block_n: int, tier_weights=DEFAULT_TIER_WEIGHTS, tokens_per_split=None,
                       split_waves: int = SPLIT_WAVES):
    """-> (split_cost, num_splits) from host ints only (no sync).

    max_tokens bounds every request's n16 + n8 + n4. Tile rounding adds < 1 tile per tier, so
    a request's cost line is at most (cdiv(max_tokens, BLOCK_N) + 2) tiles of the dearest tier.
    Default: ~split_waves stage-1 programs per SM; tokens_per_split (tests) fixes it instead."""
    wmax = max(tier_weights)
    max_cost = (triton.cdiv(max_tokens, block_n) + 2) * block_n * wmax
    assert max_cost < 2 ** 31, "cost line overflows int32; lower tier_weights"
    if tokens_per_split is None:
        target = max(1, math.ceil(split_waves * num_sms(device) / max(1, batch_size * num_kv_heads)))
        split_cost = max(triton.cdiv(max_cost, target), block_n * wmax)
    else:
        split_cost = max(1, int(tokens_per_split) * wmax)
    return split_cost, triton.cdiv(max_cost, split_cost)


def decode_attention_gather(
    q: torch.Tensor, layer: TieredKVLayer, tables: TieredBlockTables,
    sm_scale: Optional[float] = None, max_tokens: Optional[int] = None,
    tokens_per_split: Optional[int] = None, tier_weights=DEFAULT_TIER_WEIGHTS,
    block_n: Optional[int] = None, out: Optional[torch.Tensor] = None, prefetch: bool = True,
    fast_dequant: bool = True, split_waves: int = SPLIT_WAVES,
) -> torch.Tensor:
    """Decode attention of q [B, Hq, D] over each request's gathered tier rows -> [B, Hq, D].

    max_tokens: host bound on any request's total keys (default: the sum of the table widths,
    which is loose; the engine passes max(seq_lens)). tokens_per_split / tier_weights /
    split_waves: split planning (plan_gather_splits); block_n: rows per tile (power of two >=
    16); prefetch / fast_dequant: as decode_attention_tiered."""
    layer.check()
    B, Hq, D = q.shape
    Hkv, G = layer.num_kv_heads, layer.group_size
    assert layer.page_size == 1, "the gather kernel reads slot-granular stores (PAGE == 1)"
    assert q.dtype == layer.dtype and D == layer.head_dim, (q.dtype, layer.dtype, D)
    assert q.stride(-1) == 1, "q: last dim must be contiguous"
    assert Hq % Hkv == 0, (Hq, Hkv)
    assert D & (D - 1) == 0 and D >= 16, "head_dim must be a power of two >= 16"
    assert G & (G - 1) == 0, "group_size must be a power of two (tl.arange over groups)"
    tables.check(1)
    assert tables.batch_size == B
    block_n = block_n or default_block_n()
    assert block_n >= 16 and block_n & (block_n - 1) == 0, block_n
    weights = tuple(int(w) for w in tier_weights)
    assert len(weights) == 3 and min(weights) >= 1, weights
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(-1) == 1
    if B == 0:
        return out
    if max_tokens is None:
        max_tokens = sum(int(t.shape[1]) for t in tables.tables)
    sm_scale = 1.0 / math.sqrt(D) if sm_scale is None else sm_scale
    split_cost, S = plan_gather_splits(max_tokens, B, Hkv, q.device, block_n, weights,
                                       tokens_per_split, split_waves)
    kv_group = Hq // Hkv
    o_part = torch.empty((B, Hq, S, D), dtype=torch.float32, device=q.device)
    lse_part = torch.empty((B, Hq, S), dtype=torch.float32, device=q.device)
    f16, i8, i4 = layer.pages
    rt, ln = tables.tables, tables.lens
    # NOTE: Triton 3.9's CPU interpreter computes tl.dot on bf16 operands wrongly (README
    # section 4); there, dequantized bf16 tiles are widened to fp32 before the dot.
    dot_f32 = is_interpret() and q.dtype == torch.bfloat16
    _decode_gather_kernel[(B * Hkv, S)](
        q, o_part, lse_part,
        f16.k, f16.v,
        i8.k, i8.v, i8.k_scale, i8.k_zero, i8.v_scale, i8.v_zero,
        i4.k, i4.v, i4.k_scale, i4.k_zero, i4.v_scale, i4.v_zero,
        rt[0], rt[1], rt[2], ln[0], ln[1], ln[2],
        q.stride(0), q.stride(1), rt[0].stride(0), rt[1].stride(0), rt[2].stride(0),
        f16.k.stride(0), f16.k.stride(1), i8.k.stride(0), i8.k.stride(1),
        i4.k.stride(0), i4.k.stride(1),
        i8.k_scale.stride(0), i8.k_scale.stride(1), i4.k_scale.stride(0), i4.k_scale.stride(1),
        o_part.stride(0), o_part.stride(1), o_part.stride(2),
        lse_part.stride(0), lse_part.stride(1),
        split_cost, weights[0], weights[1], weights[2], sm_scale * LOG2E,
        NUM_KV_HEADS=Hkv, KV_GROUP=kv_group, BLOCK_G=max(16, next_pow2(kv_group)),
        HEAD_DIM=D, GROUP_SIZE=G, BLOCK_N=block_n, PREFETCH=prefetch,
        FAST_DEQUANT=fast_dequant, DOT_F32=dot_f32,
    )
    merge_splits(o_part, lse_part, out)
    return out


def decode_attention_gather_reference(q, layer: TieredKVLayer, tables: TieredBlockTables,
                                      sm_scale: Optional[float] = None) -> torch.Tensor:
    """Torch reference: dequantize each request's rows through tier_codec and attend in fp32
    (paged_layout.gather_request_kv at PAGE = 1, where a block table entry is a store row)."""
    assert layer.page_size == 1
    return decode_attention_tiered_reference(q, layer, tables, sm_scale)
