"""Split-K decode attention over the engine's tiered pool: filled tables, per-tier page sizes.

    decode_attention_filled(q, layer, tables, sm_scale=None, out=None, plan=None, config=None) -> o

q, o   [B, Hq, D] model dtype (fp16 / bf16), one new token per request
layer  TieredKVLayer with any power-of-two page size per tier (the engine's TieredKVPool: the fp16
       store as rows, PAGE 1; int8 / int4 as head-major pages of 16..256 tokens)
tables TieredBlockTables, FILLED or dense form (paged_layout.py); the kernels need no host sync.

Grid (B * Hkv, S). Program (b, kv-head, split s) owns the q heads of one kv-head (GQA: they are the
M rows of every tl.dot, so each K/V byte is read once per kv-head) and slice s of EVERY tier:

    tier t of request b:  virtual slots l = j * PAGE_t + slot  (listed page j), walked TILE_t a step
                          steps_t = cdiv(num_pages_t * PAGE_t, TILE_t)
    split s takes steps   [s * steps_t // S, (s + 1) * steps_t // S)   of each tier

so every split of a request moves about the same bytes whatever its tier mix, and S is a host
number (plan_filled_decode: from B, Hkv and a bound on the context, never from the tables). A
split with no step stores an empty partial (lse = NEG_BIG). Stage 2 is decode_attention's LSE
merge; with S == 1 stage 1 writes o itself.

Per step, per tier (log2-domain online softmax, fp32 accumulate):
  fp16    TILE16 rows gathered (PAGE 1: one 2D-byte row per token-head) -> plain dot / softmax / dot
  int8    FOLD (one scale / zero per token-head, G = D): codes go to tl.dot as exact integers,
          score = ks * (q . c) + kz * sum(q);  o += (p * vs) @ c + sum(p * vz)
  int4    FOLD, and the nibbles are never interleaved: byte i holds channel 2i (low) and 2i+1
          (high), so q is loaded once as its even and odd channels and
          q . k = q_even . lo + q_odd . hi, P @ V goes to an even and an odd accumulator that are
          joined (interleaved) once, after the int4 loop. The int4 tier runs first for that reason.
  G < D   tiles dequantized in registers (_tiles._dequant_tile), one accumulator.

Attention over a set is order-free (K is post-RoPE), so tiers, pages and splits combine exactly.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

import torch
import triton
import triton.language as tl

from ._tiles import _dequant_tile, _load_rows_raw, _u8_to_f16, is_interpret, next_pow2, num_sms
from .decode_attention import (LOG2E, NEG_BIG, merge_splits, _softmax_step, _store_split_result,
                               decode_attention_tiered_reference)
from .extend_attention import _prefix_slots
from .paged_layout import TieredBlockTables, TieredKVLayer


@dataclass(frozen=True)
class FilledDecodeConfig:
    """Launch knobs. tile*: virtual slots per loop step of each tier (powers of two; a page
    larger than the tile is walked in tile-sized chunks, smaller pages are gathered
    tile / PAGE at a time). prefetch: int tiers load step i+1's raw bytes into registers
    before step i is computed. split_waves: stage-1 programs per SM the planner aims for;
    min_split_tokens: no split gets fewer context tokens than this (the merge costs more)."""

    tile16: int = 64
    tile8: int = 128
    tile4: int = 128
    num_warps: int = 4
    num_stages: int = 2
    prefetch: bool = True
    split_waves: int = 4
    min_split_tokens: int = 1024

    def __post_init__(self):
        for name in ("tile16", "tile8", "tile4"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"FilledDecodeConfig.{name} must be a power of two >= 16, got {v}")
        if self.num_warps not in (1, 2, 4, 8, 16) or self.num_stages < 1:
            raise ValueError(f"bad num_warps / num_stages: {self.num_warps} / {self.num_stages}")


DEFAULT_CONFIG = FilledDecodeConfig()
_TL_DTYPE = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}
# The interpreter: small tiles keep CPU tests fast.
INTERPRET_CONFIG = FilledDecodeConfig(tile16=16, tile8=16, tile4=16, num_stages=1)


def default_config() -> FilledDecodeConfig:
    return INTERPRET_CONFIG if is_interpret() else DEFAULT_CONFIG


@dataclass(frozen=True)
class FilledDecodePlan:
    num_splits: int


def plan_filled_decode(batch_size: int, num_kv_heads: int, max_tokens: int, device,
                       config: Optional[FilledDecodeConfig] = None) -> FilledDecodePlan:
    """Splits per request from host numbers only (CUDA-graph safe): enough programs for
    `split_waves` per SM, but no split below `min_split_tokens` of a max_tokens-long request."""
    config = config or default_config()
    dev = torch.device(device)
    target = config.split_waves * num_sms(dev)
    want = max(1, -(-target // max(1, batch_size * num_kv_heads)))
    cap = max(1, int(max_tokens) // config.min_split_tokens)
    return FilledDecodePlan(num_splits=int(min(want, cap)))


@triton.jit
def _codes(c, OUT_DTYPE: tl.constexpr):
    """uint8 codes (or nibbles) -> exact integers in OUT_DTYPE (0..255 are exact in fp16/bf16)."""
    return _u8_to_f16(c).to(OUT_DTYPE)


@triton.jit
def _softmax_update(m_i, l_i, s):
    """s [M, N] fp32 masked scores (log2 domain) -> (m_new, l_new, alpha, p)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    return m_new, l_i * alpha + tl.sum(p, 1), alpha, p


@triton.jit
def _tier_rows(bt_row_ptr, fill_row_ptr, n_tok, n_pages, l0, offs, stride_p, stride_h, stride_sp,
               stride_sh, kv_head, PAGE: tl.constexpr, TILE: tl.constexpr, W: tl.constexpr,
               NG: tl.constexpr, FILLED: tl.constexpr, ALIGN: tl.constexpr):
    ro, so, tm = _prefix_slots(bt_row_ptr, fill_row_ptr, n_tok, n_pages, l0, offs,
                               stride_p, stride_h, stride_sp, stride_sh, kv_head, PAGE, TILE, W, NG, FILLED)
    # every row starts at a multiple of its width (contiguous pages / rows): lets loads vectorize
    ro = tl.multiple_of(ro, ALIGN)
    return ro, so, tm


@triton.jit
def _steps_of_split(n_pages, split, n_split, PAGE: tl.constexpr, TILE: tl.constexpr):
    """[lo, hi) virtual-slot range of this split in one tier: steps [s*n//S, (s+1)*n//S)."""
    steps = tl.cdiv(n_pages * PAGE, TILE)
    lo = (split * steps) // n_split
    hi = ((split + 1) * steps) // n_split
    return lo * TILE, hi * TILE


@triton.jit
def _attend_fp16(acc, m_i, l_i, q, bt_ptr, fill_ptr, n_tok, n_pages, l_lo, l_hi, k_ptr, v_ptr,
                 stride_p, stride_h, kv_head, qk_scale,
                 PAGE: tl.constexpr, TILE: tl.constexpr, HEAD_DIM: tl.constexpr,
                 FILLED: tl.constexpr, DOT_F32: tl.constexpr, STAGES: tl.constexpr):
    offs = tl.arange(0, TILE)
    offs_d = tl.arange(0, HEAD_DIM)
    for l0 in tl.range(l_lo, l_hi, TILE, num_stages=STAGES):
        ro, so, tm = _tier_rows(bt_ptr, fill_ptr, n_tok, n_pages, l0, offs, stride_p, stride_h, 0, 0,
                                kv_head, PAGE, TILE, HEAD_DIM, 1, FILLED, HEAD_DIM)
        k = tl.load(k_ptr + ro[:, None] + offs_d[None, :], mask=tm[:, None], other=0.0)
        v = tl.load(v_ptr + ro[:, None] + offs_d[None, :], mask=tm[:, None], other=0.0)
        if DOT_F32:
            acc, m_i, l_i = _softmax_step(acc, m_i, l_i, q.to(tl.float32), k.to(tl.float32),
                                          v.to(tl.float32), tm, qk_scale)
        else:
            acc, m_i, l_i = _softmax_step(acc, m_i, l_i, q, k, v, tm, qk_scale)
    return acc, m_i, l_i


@triton.jit
def _int8_step(acc, m_i, l_i, q, q_sum, kq, ks, kz, vq, vs, vz, tm, qk_scale,
               TILE: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """FOLD step of the int8 tier: raw codes [TILE, 1, D], scales [TILE, 1]."""
    kc = _codes(tl.reshape(kq, (TILE, HEAD_DIM)), DOT_DTYPE)
    vc = _codes(tl.reshape(vq, (TILE, HEAD_DIM)), DOT_DTYPE)
    ks1 = tl.reshape(ks, (TILE,)).to(tl.float32)
    kz1 = tl.reshape(kz, (TILE,)).to(tl.float32)
    vs1 = tl.reshape(vs, (TILE,)).to(tl.float32)
    vz1 = tl.reshape(vz, (TILE,)).to(tl.float32)
    qk = tl.dot(q.to(DOT_DTYPE), tl.trans(kc))
    s = (qk * ks1[None, :] + q_sum[:, None] * kz1[None, :]) * qk_scale
    s = tl.where(tm[None, :], s, float("-inf"))
    m_i, l_i, alpha, p = _softmax_update(m_i, l_i, s)
    pv = tl.dot((p * vs1[None, :]).to(DOT_DTYPE), vc) + tl.sum(p * vz1[None, :], 1)[:, None]
    return acc * alpha[:, None] + pv, m_i, l_i


@triton.jit
def _int4_step(acc_e, acc_o, m_i, l_i, q_e, q_o, q_sum, kq, ks, kz, vq, vs, vz, tm, qk_scale,
               TILE: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """FOLD step of the int4 tier on split nibbles: raw bytes [TILE, 1, D/2], scales [TILE, 1]."""
    HALF: tl.constexpr = HEAD_DIM // 2
    kb = tl.reshape(kq, (TILE, HALF))
    vb = tl.reshape(vq, (TILE, HALF))
    ks1 = tl.reshape(ks, (TILE,)).to(tl.float32)
    kz1 = tl.reshape(kz, (TILE,)).to(tl.float32)
    vs1 = tl.reshape(vs, (TILE,)).to(tl.float32)
    vz1 = tl.reshape(vz, (TILE,)).to(tl.float32)
    qk = tl.dot(q_e, tl.trans(_codes(kb & 15, DOT_DTYPE)))
    qk = tl.dot(q_o, tl.trans(_codes(kb >> 4, DOT_DTYPE)), qk)
    s = (qk * ks1[None, :] + q_sum[:, None] * kz1[None, :]) * qk_scale
    s = tl.where(tm[None, :], s, float("-inf"))
    m_i, l_i, alpha, p = _softmax_update(m_i, l_i, s)
    pw = (p * vs1[None, :]).to(DOT_DTYPE)
    zero = tl.sum(p * vz1[None, :], 1)[:, None]
    acc_e = tl.dot(pw, _codes(vb & 15, DOT_DTYPE), acc_e * alpha[:, None]) + zero
    acc_o = tl.dot(pw, _codes(vb >> 4, DOT_DTYPE), acc_o * alpha[:, None]) + zero
    return acc_e, acc_o, m_i, l_i


@triton.jit
def _attend_int8(acc, m_i, l_i, q, q_sum, bt_ptr, fill_ptr, n_tok, n_pages, l_lo, l_hi,
                 k_ptr, v_ptr, ks_ptr, kz_ptr, vs_ptr, vz_ptr,
                 stride_p, stride_h, stride_sp, stride_sh, kv_head, qk_scale,
                 PAGE: tl.constexpr, TILE: tl.constexpr, HEAD_DIM: tl.constexpr, GROUP_SIZE: tl.constexpr,
                 FILLED: tl.constexpr, FOLD: tl.constexpr, DOT_DTYPE: tl.constexpr,
                 PREFETCH: tl.constexpr, STAGES: tl.constexpr, ALIGN: tl.constexpr):
    NG: tl.constexpr = HEAD_DIM // GROUP_SIZE
    offs = tl.arange(0, TILE)
    if PREFETCH:
        ro, so, tm = _tier_rows(bt_ptr, fill_ptr, n_tok, n_pages, l_lo, offs, stride_p, stride_h,
                                stride_sp, stride_sh, kv_head, PAGE, TILE, HEAD_DIM, NG, FILLED, ALIGN)
        tm = tm & (offs * 0 + l_lo < l_hi)
        kq, ks, kz = _load_rows_raw(k_ptr, ks_ptr, kz_ptr, ro, so, tm, 1, HEAD_DIM, GROUP_SIZE)
        vq, vs, vz = _load_rows_raw(v_ptr, vs_ptr, vz_ptr, ro, so, tm, 1, HEAD_DIM, GROUP_SIZE)
        for l0 in range(l_lo, l_hi, TILE):
            ro_n, so_n, tm_n = _tier_rows(bt_ptr, fill_ptr, n_tok, n_pages, l0 + TILE, offs, stride_p,
                                          stride_h, stride_sp, stride_sh, kv_head, PAGE, TILE, HEAD_DIM,
                                          NG, FILLED, ALIGN)
            tm_n = tm_n & (offs * 0 + l0 + TILE < l_hi)
            kq_n, ks_n, kz_n = _load_rows_raw(k_ptr, ks_ptr, kz_ptr, ro_n, so_n, tm_n, 1, HEAD_DIM, GROUP_SIZE)
            vq_n, vs_n, vz_n = _load_rows_raw(v_ptr, vs_ptr, vz_ptr, ro_n, so_n, tm_n, 1, HEAD_DIM, GROUP_SIZE)
            if FOLD:
                acc, m_i, l_i = _int8_step(acc, m_i, l_i, q, q_sum, kq, ks, kz, vq, vs, vz, tm, qk_scale,
                                           TILE, HEAD_DIM, DOT_DTYPE)
            else:
                k = _dequant_tile(kq, ks, kz, DOT_DTYPE, 1, TILE, HEAD_DIM, True)
                v = _dequant_tile(vq, vs, vz, DOT_DTYPE, 1, TILE, HEAD_DIM, True)
                acc, m_i, l_i = _softmax_step(acc, m_i, l_i, q.to(DOT_DTYPE), k, v, tm, qk_scale)
            kq, ks, kz, vq, vs, vz, tm = kq_n, ks_n, kz_n, vq_n, vs_n, vz_n, tm_n
    else:
        for l0 in tl.range(l_lo, l_hi, TILE, num_stages=STAGES):
            ro, so, tm = _tier_rows(bt_ptr, fill_ptr, n_tok, n_pages, l0, offs, stride_p, stride_h,
                                    stride_sp, stride_sh, kv_head, PAGE, TILE, HEAD_DIM, NG, FILLED, ALIGN)
            kq, ks, kz = _load_rows_raw(k_ptr, ks_ptr, kz_ptr, ro, so, tm, 1, HEAD_DIM, GROUP_SIZE)
            vq, vs, vz = _load_rows_raw(v_ptr, vs_ptr, vz_ptr, ro, so, tm, 1, HEAD_DIM, GROUP_SIZE)
            if FOLD:
                acc, m_i, l_i = _int8_step(acc, m_i, l_i, q, q_sum, kq, ks, kz, vq, vs, vz, tm, qk_scale,
                                           TILE, HEAD_DIM, DOT_DTYPE)
            else:
                k = _dequant_tile(kq, ks, kz, DOT_DTYPE, 1, TILE, HEAD_DIM, True)
                v = _dequant_tile(vq, vs, vz, DOT_DTYPE, 1, TILE, HEAD_DIM, True)
                acc, m_i, l_i = _softmax_step(acc, m_i, l_i, q.to(DOT_DTYPE), k, v, tm, qk_scale)
    return acc, m_i, l_i


@triton.jit
def _attend_int4_fold(acc_e, acc_o, m_i, l_i, q_e, q_o, q_sum, bt_ptr, fill_ptr, n_tok, n_pages,
                      l_lo, l_hi, k_ptr, v_ptr, ks_ptr, kz_ptr, vs_ptr, vz_ptr,
                      stride_p, stride_h, stride_sp, stride_sh, kv_head, qk_scale,
                      PAGE: tl.constexpr, TILE: tl.constexpr, HEAD_DIM: tl.constexpr,
                      FILLED: tl.constexpr, DOT_DTYPE: tl.constexpr, PREFETCH: tl.constexpr,
                      STAGES: tl.constexpr, ALIGN: tl.constexpr):
    W: tl.constexpr = HEAD_DIM // 2
    offs = tl.arange(0, TILE)
    if PREFETCH:
        ro, so, tm = _tier_rows(bt_ptr, fill_ptr, n_tok, n_pages, l_lo, offs, stride_p, stride_h,
                                stride_sp, stride_sh, kv_head, PAGE, TILE, W, 1, FILLED, ALIGN)
        tm = tm & (offs * 0 + l_lo < l_hi)
        kq, ks, kz = _load_rows_raw(k_ptr, ks_ptr, kz_ptr, ro, so, tm, 2, HEAD_DIM, HEAD_DIM)
        vq, vs, vz = _load_rows_raw(v_ptr, vs_ptr, vz_ptr, ro, so, tm, 2, HEAD_DIM, HEAD_DIM)
        for l0 in range(l_lo, l_hi, TILE):
            ro_n, so_n, tm_n = _tier_rows(bt_ptr, fill_ptr, n_tok, n_pages, l0 + TILE, offs, stride_p,
                                          stride_h, stride_sp, stride_sh, kv_head, PAGE, TILE, W, 1,
                                          FILLED, ALIGN)
            tm_n = tm_n & (offs * 0 + l0 + TILE < l_hi)
            kq_n, ks_n, kz_n = _load_rows_raw(k_ptr, ks_ptr, kz_ptr, ro_n, so_n, tm_n, 2, HEAD_DIM, HEAD_DIM)
            vq_n, vs_n, vz_n = _load_rows_raw(v_ptr, vs_ptr, vz_ptr, ro_n, so_n, tm_n, 2, HEAD_DIM, HEAD_DIM)
            acc_e, acc_o, m_i, l_i = _int4_step(acc_e, acc_o, m_i, l_i, q_e, q_o, q_sum, kq, ks, kz,
                                                vq, vs, vz, tm, qk_scale, TILE, HEAD_DIM, DOT_DTYPE)
            kq, ks, kz, vq, vs, vz, tm = kq_n, ks_n, kz_n, vq_n, vs_n, vz_n, tm_n
    else:
        for l0 in tl.range(l_lo, l_hi, TILE, num_stages=STAGES):
            ro, so, tm = _tier_rows(bt_ptr, fill_ptr, n_tok, n_pages, l0, offs, stride_p, stride_h,
                                    stride_sp, stride_sh, kv_head, PAGE, TILE, W, 1, FILLED, ALIGN)
            kq, ks, kz = _load_rows_raw(k_ptr, ks_ptr, kz_ptr, ro, so, tm, 2, HEAD_DIM, HEAD_DIM)
            vq, vs, vz = _load_rows_raw(v_ptr, vs_ptr, vz_ptr, ro, so, tm, 2, HEAD_DIM, HEAD_DIM)
            acc_e, acc_o, m_i, l_i = _int4_step(acc_e, acc_o, m_i, l_i, q_e, q_o, q_sum, kq, ks, kz,
                                                vq, vs, vz, tm, qk_scale, TILE, HEAD_DIM, DOT_DTYPE)
    return acc_e, acc_o, m_i, l_i


@triton.jit
def _attend_int4_dequant(acc, m_i, l_i, q, bt_ptr, fill_ptr, n_tok, n_pages, l_lo, l_hi,
                         k_ptr, v_ptr, ks_ptr, kz_ptr, vs_ptr, vz_ptr,
                         stride_p, stride_h, stride_sp, stride_sh, kv_head, qk_scale,
                         PAGE: tl.constexpr, TILE: tl.constexpr, HEAD_DIM: tl.constexpr,
                         GROUP_SIZE: tl.constexpr, FILLED: tl.constexpr, DOT_DTYPE: tl.constexpr,
                         STAGES: tl.constexpr):
    """G < D: per-group scales, tiles dequantized in registers (interleaved nibbles)."""
    NG: tl.constexpr = HEAD_DIM // GROUP_SIZE
    offs = tl.arange(0, TILE)
    for l0 in tl.range(l_lo, l_hi, TILE, num_stages=STAGES):
        ro, so, tm = _tier_rows(bt_ptr, fill_ptr, n_tok, n_pages, l0, offs, stride_p, stride_h,
                                stride_sp, stride_sh, kv_head, PAGE, TILE, HEAD_DIM // 2, NG, FILLED, 1)
        kq, ks, kz = _load_rows_raw(k_ptr, ks_ptr, kz_ptr, ro, so, tm, 2, HEAD_DIM, GROUP_SIZE)
        vq, vs, vz = _load_rows_raw(v_ptr, vs_ptr, vz_ptr, ro, so, tm, 2, HEAD_DIM, GROUP_SIZE)
        k = _dequant_tile(kq, ks, kz, DOT_DTYPE, 2, TILE, HEAD_DIM, True)
        v = _dequant_tile(vq, vs, vz, DOT_DTYPE, 2, TILE, HEAD_DIM, True)
        acc, m_i, l_i = _softmax_step(acc, m_i, l_i, q.to(DOT_DTYPE), k, v, tm, qk_scale)
    return acc, m_i, l_i


@triton.jit
def _decode_filled_kernel(
    q_ptr, o_part_ptr, lse_part_ptr,
    k16_ptr, v16_ptr,
    k8_ptr, v8_ptr, k8s_ptr, k8z_ptr, v8s_ptr, v8z_ptr,
    k4_ptr, v4_ptr, k4s_ptr, k4z_ptr, v4s_ptr, v4z_ptr,
    bt16_ptr, bt8_ptr, bt4_ptr, len16_ptr, len8_ptr, len4_ptr,
    fill16_ptr, fill8_ptr, fill4_ptr, npg16_ptr, npg8_ptr, npg4_ptr,
    stride_qb, stride_qh, stride_bt16, stride_bt8, stride_bt4, stride_f16, stride_f8, stride_f4,
    stride_p16, stride_h16, stride_p8, stride_h8, stride_p4, stride_h4,
    stride_sp8, stride_sh8, stride_sp4, stride_sh4,
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
    qk_scale,
    NUM_KV_HEADS: tl.constexpr, KV_GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr, GROUP_SIZE: tl.constexpr,
    PAGE16: tl.constexpr, PAGE8: tl.constexpr, PAGE4: tl.constexpr,
    TILE16: tl.constexpr, TILE8: tl.constexpr, TILE4: tl.constexpr,
    FILLED: tl.constexpr, DOT_F32: tl.constexpr, DOT_DTYPE: tl.constexpr, ALIGN8: tl.constexpr,
    ALIGN4: tl.constexpr, PREFETCH: tl.constexpr, STAGES: tl.constexpr, DIRECT: tl.constexpr,
):
    """DIRECT (one split): o_part_ptr is o [B, Hq, D] and gets the normalized result."""
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    n_split = tl.num_programs(1)
    b = pid_bh // NUM_KV_HEADS
    kv_head = pid_bh % NUM_KV_HEADS
    FOLD: tl.constexpr = GROUP_SIZE == HEAD_DIM
    HALF: tl.constexpr = HEAD_DIM // 2

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_h = tl.arange(0, HALF)
    gmask = offs_g < KV_GROUP
    q_rows = b * stride_qb + (kv_head * KV_GROUP + offs_g) * stride_qh
    q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=gmask[:, None], other=0.0)
    q_sum = tl.sum(q.to(tl.float32), 1)  # the zero-point term of every folded int score
    m_i = tl.full([BLOCK_G], NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)

    if FILLED:
        npg16 = tl.load(npg16_ptr + b)
        npg8 = tl.load(npg8_ptr + b)
        npg4 = tl.load(npg4_ptr + b)
    else:  # dense: the pages that hold n_t tokens
        npg16 = tl.cdiv(tl.load(len16_ptr + b), PAGE16)
        npg8 = tl.cdiv(tl.load(len8_ptr + b), PAGE8)
        npg4 = tl.cdiv(tl.load(len4_ptr + b), PAGE4)

    # ---- int4 first: with FOLD its even / odd accumulators are joined once, below
    lo4, hi4 = _steps_of_split(npg4, split, n_split, PAGE4, TILE4)
    if FOLD:
        q_e = tl.load(q_ptr + q_rows[:, None] + 2 * offs_h[None, :], mask=gmask[:, None], other=0.0)
        q_o = tl.load(q_ptr + q_rows[:, None] + 2 * offs_h[None, :] + 1, mask=gmask[:, None], other=0.0)
        acc_e = tl.zeros([BLOCK_G, HALF], dtype=tl.float32)
        acc_o = tl.zeros([BLOCK_G, HALF], dtype=tl.float32)
        acc_e, acc_o, m_i, l_i = _attend_int4_fold(
            acc_e, acc_o, m_i, l_i, q_e.to(DOT_DTYPE), q_o.to(DOT_DTYPE), q_sum,
            bt4_ptr + b * stride_bt4, fill4_ptr + b * stride_f4, tl.load(len4_ptr + b), npg4, lo4, hi4,
            k4_ptr, v4_ptr, k4s_ptr, k4z_ptr, v4s_ptr, v4z_ptr,
            stride_p4, stride_h4, stride_sp4, stride_sh4, kv_head, qk_scale,
            PAGE4, TILE4, HEAD_DIM, FILLED, DOT_DTYPE, PREFETCH, STAGES, ALIGN4)
        acc = tl.reshape(tl.join(acc_e, acc_o), (BLOCK_G, HEAD_DIM))  # channel 2i <- even[i], 2i+1 <- odd[i]
    else:
        acc = tl.zeros([BLOCK_G, HEAD_DIM], dtype=tl.float32)
        acc, m_i, l_i = _attend_int4_dequant(
            acc, m_i, l_i, q, bt4_ptr + b * stride_bt4, fill4_ptr + b * stride_f4, tl.load(len4_ptr + b),
            npg4, lo4, hi4, k4_ptr, v4_ptr, k4s_ptr, k4z_ptr, v4s_ptr, v4z_ptr,
            stride_p4, stride_h4, stride_sp4, stride_sh4, kv_head, qk_scale,
            PAGE4, TILE4, HEAD_DIM, GROUP_SIZE, FILLED, DOT_DTYPE, STAGES)

    lo8, hi8 = _steps_of_split(npg8, split, n_split, PAGE8, TILE8)
    acc, m_i, l_i = _attend_int8(
        acc, m_i, l_i, q, q_sum, bt8_ptr + b * stride_bt8, fill8_ptr + b * stride_f8, tl.load(len8_ptr + b),
        npg8, lo8, hi8, k8_ptr, v8_ptr, k8s_ptr, k8z_ptr, v8s_ptr, v8z_ptr,
        stride_p8, stride_h8, stride_sp8, stride_sh8, kv_head, qk_scale,
        PAGE8, TILE8, HEAD_DIM, GROUP_SIZE, FILLED, FOLD, DOT_DTYPE, PREFETCH, STAGES, ALIGN8)

    lo16, hi16 = _steps_of_split(npg16, split, n_split, PAGE16, TILE16)
    acc, m_i, l_i = _attend_fp16(
        acc, m_i, l_i, q, bt16_ptr + b * stride_bt16, fill16_ptr + b * stride_f16, tl.load(len16_ptr + b),
        npg16, lo16, hi16, k16_ptr, v16_ptr, stride_p16, stride_h16, kv_head, qk_scale,
        PAGE16, TILE16, HEAD_DIM, FILLED, DOT_F32, STAGES)

    q_heads = kv_head * KV_GROUP + offs_g
    _store_split_result(acc, m_i, l_i, o_part_ptr, lse_part_ptr, b, split, q_heads, offs_d, gmask,
                        stride_ob, stride_oh, stride_os, stride_lb, stride_lh, DIRECT)


def decode_attention_filled(
    q: torch.Tensor, layer: TieredKVLayer, tables: TieredBlockTables, sm_scale: Optional[float] = None,
    out: Optional[torch.Tensor] = None, plan: Optional[FilledDecodePlan] = None,
    config: Optional[FilledDecodeConfig] = None, check: bool = True,
) -> torch.Tensor:
    """Decode attention of q [B, Hq, D] over each request's tiered cache -> [B, Hq, D] (module doc).

    plan: splits per request (plan_filled_decode; default from the widest table row, which is
    a host number); config: launch knobs (default_config()); check=False skips the layout checks
    (callers that run many layers over one batch check once). No host sync: CUDA-graph safe."""
    config = config or default_config()
    B, Hq, D = q.shape
    Hkv, G = layer.num_kv_heads, layer.group_size
    if check:
        layer.check(uniform=False)
        assert q.dtype == layer.dtype and D == layer.head_dim, (q.dtype, layer.dtype, D, layer.head_dim)
        assert q.dtype in (torch.float16, torch.bfloat16), q.dtype
        assert q.stride(-1) == 1, "q: last dim must be contiguous"
        assert Hq % Hkv == 0, (Hq, Hkv)
        assert D >= 16 and D & (D - 1) == 0, "head_dim must be a power of two >= 16"
        assert G & (G - 1) == 0 and G >= 2, "group size must be a power of two"
        for t in range(3):
            p = layer.page_size_of(t)
            assert p >= 1 and p & (p - 1) == 0, f"tier {t}: page size {p} must be a power of two"
        tables.check(layer.page_size)
        assert tables.batch_size == B, (tables.batch_size, B)
    if plan is None:
        width = max(int(tables.tables[t].shape[1]) * layer.page_size_of(t) for t in range(3))
        plan = plan_filled_decode(B, Hkv, width, q.device, config)
    S = plan.num_splits
    sm_scale = 1.0 / math.sqrt(D) if sm_scale is None else sm_scale
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(-1) == 1
    direct = S == 1
    if direct:
        o_part, lse_part = out.unsqueeze(2), out.new_empty((1, 1, 1), dtype=torch.float32)
    else:
        o_part = torch.empty((B, Hq, S, D), dtype=torch.float32, device=q.device)
        lse_part = torch.empty((B, Hq, S), dtype=torch.float32, device=q.device)
    f16, i8, i4 = layer.pages
    bt, ln = tables.tables, tables.lens
    fills = tables.fills if tables.filled else bt  # dense: unused (FILLED=False)
    npg = tables.num_pages if tables.filled else ln
    kv_group = Hq // Hkv
    # NOTE: the interpreter's bf16 tl.dot is wrong (kernels/README.md section 4): fp32 operands there
    dot_f32 = is_interpret() and q.dtype == torch.bfloat16
    _decode_filled_kernel[(B * Hkv, S)](
        q, o_part, lse_part,
        f16.k, f16.v,
        i8.k, i8.v, i8.k_scale, i8.k_zero, i8.v_scale, i8.v_zero,
        i4.k, i4.v, i4.k_scale, i4.k_zero, i4.v_scale, i4.v_zero,
        bt[0], bt[1], bt[2], ln[0], ln[1], ln[2],
        fills[0], fills[1], fills[2], npg[0], npg[1], npg[2],
        q.stride(0), q.stride(1), bt[0].stride(0), bt[1].stride(0), bt[2].stride(0),
        fills[0].stride(0), fills[1].stride(0), fills[2].stride(0),
        f16.k.stride(0), f16.k.stride(1), i8.k.stride(0), i8.k.stride(1), i4.k.stride(0), i4.k.stride(1),
        i8.k_scale.stride(0), i8.k_scale.stride(1), i4.k_scale.stride(0), i4.k_scale.stride(1),
        o_part.stride(0), o_part.stride(1), o_part.stride(2), lse_part.stride(0), lse_part.stride(1),
        sm_scale * LOG2E,
        NUM_KV_HEADS=Hkv, KV_GROUP=kv_group, BLOCK_G=max(16, next_pow2(kv_group)),
        HEAD_DIM=D, GROUP_SIZE=G,
        PAGE16=layer.page_size_of(0), PAGE8=layer.page_size_of(1), PAGE4=layer.page_size_of(2),
        TILE16=config.tile16, TILE8=config.tile8, TILE4=config.tile4,
        FILLED=tables.filled, DOT_F32=dot_f32, DOT_DTYPE=tl.float32 if dot_f32 else _TL_DTYPE[q.dtype],
        ALIGN8=min(16, D), ALIGN4=min(16, D // 2),
        PREFETCH=config.prefetch, STAGES=config.num_stages, DIRECT=direct,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if direct:
        return out
    merge_splits(o_part, lse_part, out)
    return out


def decode_attention_filled_reference(q, layer: TieredKVLayer, tables: TieredBlockTables,
                                      sm_scale: Optional[float] = None) -> torch.Tensor:
    """Torch reference (any table form, any page sizes): dequantize through tier_codec, fp32 attention."""
    return decode_attention_tiered_reference(q, layer, tables, sm_scale)


def with_config(config: Optional[FilledDecodeConfig] = None, **knobs) -> FilledDecodeConfig:
    """A copy of `config` (default_config()) with some knobs changed (benchmark sweeps)."""
    return replace(config or default_config(), **knobs)
