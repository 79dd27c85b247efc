"""Split-K decode attention over the engine's TieredKVPool: fp16 slot rows + int8 / int4 page-head blocks.

    tiered_pool_decode(q, layer, tables, sm_scale=None, out=None, plan=None, config=None,
                       tiers=(0, 1, 2), check=True) -> o
    plan_tiered_pool_decode(batch_size, num_kv_heads, max_tokens, device, config=None) -> TieredDecodePlan
    served_config(head_dim, kv_group) -> TieredDecodeConfig      (SERVED_CONFIGS: the defaults per head shape)
    tiered_pool_decode_reference(q, layer, tables, sm_scale=None) -> o   (torch, fp32)

q, o   [B, Hq, D] model dtype (fp16 / bf16), one new token per request
layer  TieredKVLayer (paged_layout.py): fp16 tier at any power-of-two page size (the engine's store
       is rows, PAGE 1), int8 / int4 tiers as page-head blocks of PAGE >= 16 tokens
tables TieredBlockTables, FILLED or dense form; no host sync anywhere (CUDA-graph capturable)

One launch per tier in `tiers` (the backend leaves out a store that holds no page), each grid
(B * Hkv, S). Program (b, kv head, s) holds the q heads of that kv head as the M rows of every
tl.dot (GQA: each K/V byte is read once per kv head) and split s of the tier's listed pages:

    virtual slots l = j * PAGE + slot (listed page j), walked TILE a step: a page of PAGE >= TILE
    in TILE-slot chunks (one page id per step, one contiguous run per stream), smaller pages
    TILE / PAGE at a time (their ids loaded as a vector; PAGE 1: the fp16 store's row gather)
    steps = cdiv(num_pages * PAGE, TILE);  split s takes steps [s * steps // S, (s + 1) * steps // S)

so S is a host number (plan_tiered_pool_decode: `split_waves` programs per SM, no split under
`min_split_tokens` of the context bound). Every split writes its normalized partial and its
log2-sum-exp into [B, Hq, S_total, D] (tier t owns splits [t_base, t_base + S)); an empty split
writes only lse = NEG_BIG. The merge weighs them (empty: weight 0): with `fused_merge` the last
program of each (b, kv head) to finish, over all launched tiers, merges in place (a counter per
(b, kv head), reset by that program); otherwise one small merge launch follows. One launched tier
and S == 1: the program writes o itself.

Per step (log2-domain online softmax, fp32 accumulate):
  fp16   TILE rows (PAGE < TILE: page ids gathered per slot; PAGE 1 is a row gather), dots in the
         model dtype
  int8   G = D (FOLD): codes go to tl.dot as exact fp16 integers, scale and zero stay outside the
         inner products:  score = ks * (q . c) + kz * sum(q);  o += (p * vs) @ c + sum(p * vz)
  int4   FOLD on split halves (tier_codec): q . k = q[:D/2] . lo + q[D/2:] . hi, P @ V into a low
         and a high accumulator, stored as the two halves of the partial (never interleaved)
  G < D  codes dequantized per element (scale of its group), plain dots
Int-tier dots run on fp16 operands whatever the model dtype (q is rounded to fp16 once; a bf16
q in fp16's normal range converts exactly). qk_int8: q quantized per head to int8 (one scale per
row) and q . codes on int8 tensor cores (codes - 128 for int8, the nibbles as they are for int4);
fast_cvt: codes -> fp16 with byte-permute / LOP3 instructions (GPU only; bit-identical to the
portable conversion).
Attention over a set is order-free (K is post-RoPE), so tiers, pages and splits combine exactly.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

import torch
import triton
import triton.language as tl

from ._tiles import _cvt_nibbles, _cvt_u8, _gpu_fence, is_interpret, next_pow2, num_sms
from ._split_k import LOG2E, NEG_BIG
from .paged_layout import TieredBlockTables, TieredKVLayer, gather_request_kv
from .tier_codec import TIER_FP16, TIER_INT4, TIER_INT8, TIERS


@dataclass(frozen=True)
class TieredDecodeConfig:
    """Launch knobs, per tier (16 / 8 / 4): tile = tokens per loop step (power of two >= 16; several
    pages a step when PAGE < tile), warps and software-pipeline stages. qk_int8: q . K on int8 tensor
    cores (int tiers, G = D). fast_cvt: PRMT / LOP3 code conversion (GPU). split_waves: stage-1
    programs per SM the planner aims for; min_split_tokens: no split gets fewer context tokens.
    fused_merge: the last split program merges (no merge launch)."""

    tile16: int = 64
    tile8: int = 256
    tile4: int = 256
    warps16: int = 4
    warps8: int = 8
    warps4: int = 4
    stages16: int = 3
    stages8: int = 2
    stages4: int = 3
    qk_int8: bool = False
    fast_cvt: bool = True
    split_waves: float = 2.0
    min_split_tokens: int = 512
    fused_merge: bool = True

    def __post_init__(self):
        for name in ("tile16", "tile8", "tile4"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"TieredDecodeConfig.{name} must be a power of two >= 16, got {v}")
        for name in ("warps16", "warps8", "warps4"):
            if getattr(self, name) not in (1, 2, 4, 8, 16):
                raise ValueError(f"TieredDecodeConfig.{name} must be 1, 2, 4, 8 or 16")
        for name in ("stages16", "stages8", "stages4"):
            if not 1 <= getattr(self, name) <= 6:
                raise ValueError(f"TieredDecodeConfig.{name} must be in [1, 6]")
        if not self.split_waves > 0 or self.min_split_tokens < 1:
            raise ValueError(f"bad split_waves / min_split_tokens: {self.split_waves} / {self.min_split_tokens}")

    def launch(self, tier: int) -> tuple[int, int, int]:
        """(tile, num_warps, num_stages) of a tier."""
        sfx = {TIER_FP16: "16", TIER_INT8: "8", TIER_INT4: "4"}[tier]
        return getattr(self, "tile" + sfx), getattr(self, "warps" + sfx), getattr(self, "stages" + sfx)


DEFAULT_CONFIG = TieredDecodeConfig()
# The interpreter: small tiles keep CPU tests fast.
INTERPRET_CONFIG = TieredDecodeConfig(tile16=16, tile8=16, tile4=16, stages16=1, stages8=1, stages4=1)
# The served defaults per (head_dim, q heads per kv head). Chosen by the same-run sweep of
# benchmarks/kernels/attention.py (its JSON "sweep.best" lists the winner per shape, ready to paste
# here); a shape not listed takes DEFAULT_CONFIG.
SERVED_CONFIGS: dict[tuple[int, int], TieredDecodeConfig] = {}


def served_config(head_dim: int, kv_group: int, override: Optional[str] = None) -> TieredDecodeConfig:
    """The config the engine decodes with: INTERPRET_CONFIG under the interpreter, else
    `override` (a JSON object of fields, the backend passes SGL_KVXFER_TIERED_DECODE_CONFIG),
    else SERVED_CONFIGS for this shape, else DEFAULT_CONFIG."""
    if is_interpret():
        return INTERPRET_CONFIG
    if override:
        import json

        fields = json.loads(override)
        if not isinstance(fields, dict):
            raise ValueError(f"tiered decode config override must be a JSON object, got {override!r}")
        return TieredDecodeConfig(**fields)
    return SERVED_CONFIGS.get((head_dim, kv_group), DEFAULT_CONFIG)


@dataclass(frozen=True)
class TieredDecodePlan:
    """num_splits per tier launch; counters: int32 [B * Hkv] zeros for the fused merge (each
    merging program resets its entry), None without it."""
    num_splits: int
    counters: Optional[torch.Tensor] = None


def plan_tiered_pool_decode(batch_size: int, num_kv_heads: int, max_tokens: int, device,
                            config: Optional[TieredDecodeConfig] = None) -> TieredDecodePlan:
    """Splits per request from host numbers only (CUDA-graph safe): about `split_waves` programs
    per SM, no split below `min_split_tokens` of a max_tokens-long request."""
    config = config or DEFAULT_CONFIG
    dev = torch.device(device)
    want = max(1, math.ceil(config.split_waves * num_sms(dev) / max(1, batch_size * num_kv_heads)))
    cap = max(1, int(max_tokens) // config.min_split_tokens)
    counters = (torch.zeros(max(1, batch_size * num_kv_heads), dtype=torch.int32, device=dev)
                if config.fused_merge else None)
    return TieredDecodePlan(int(min(want, cap)), counters)


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
def _softmax_update(m_i, l_i, s):
    """s [M, N] fp32 masked scores (log2 domain) -> (m_new, l_new, alpha, p)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    return m_new, l_i * alpha + tl.sum(p, 1), alpha, p


@triton.jit
def _page_of_step(bt_row_ptr, fill_row_ptr, n_tok, n_pages, l0, offs,
                  PAGE: tl.constexpr, FILLED: tl.constexpr):
    """PAGE >= TILE: the step's page (int64 scalar), its first slot and the slot mask [TILE]."""
    j = l0 // PAGE
    s0 = l0 % PAGE
    if FILLED:
        fill = tl.load(fill_row_ptr + j, mask=j < n_pages, other=0)
    else:
        fill = n_tok - j * PAGE
    page = tl.load(bt_row_ptr + j, mask=fill > 0, other=0).to(tl.int64)
    return page, s0, (s0 + offs) < fill


@triton.jit
def _merge_group(o_part_ptr, lse_part_ptr, out_ptr, b, kv_head, n_total,
                 stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_outb, stride_outh,
                 KV_GROUP: tl.constexpr, MERGE_H: tl.constexpr, HEAD_DIM: tl.constexpr,
                 MERGE_S: tl.constexpr):
    """out rows (b, q heads of kv_head) = LSE-weighted sum of the n_total partials, MERGE_S at a
    time (one pass, running max); empty partials (lse NEG_BIG) weigh 0 and are not read.
    Partials are read through L2 (.cg): other programs of this launch wrote them."""
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
    for c in range(0, n_total, MERGE_S):
        s = c + offs_s
        lmask = hmask[:, None] & (s < n_total)[None, :]
        lse = tl.load(lrow[:, None] + s[None, :], mask=lmask, other=NEG_BIG, cache_modifier=".cg")
        live = lse > NEG_BIG * 0.5
        m_new = tl.maximum(m, tl.max(lse, 1))
        w = tl.where(live, tl.exp2(lse - m_new[:, None]), 0.0)
        o = tl.load(orow[:, None, None] + s[None, :, None] * stride_os + offs_d[None, None, :],
                    mask=live[:, :, None], other=0.0, cache_modifier=".cg")
        alpha = tl.exp2(m - m_new)
        acc = acc * alpha[:, None] + tl.sum(o * w[:, :, None], 1)
        l = l * alpha + tl.sum(w, 1)
        m = m_new
    res = acc / tl.where(l > 0, l, 1.0)[:, None]
    optr = out_ptr + b * stride_outb + heads[:, None] * stride_outh + offs_d[None, :]
    tl.store(optr, res.to(out_ptr.dtype.element_ty), mask=hmask[:, None])


@triton.jit
def _finish(acc_a, acc_b, m_i, l_i, o_part_ptr, lse_part_ptr, out_ptr, cnt_ptr, b, kv_head, pid_bh,
            split_id, n_total, offs_g, gmask,
            stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_outb, stride_outh,
            KV_GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HALVES: tl.constexpr, DIRECT: tl.constexpr,
            FUSED_MERGE: tl.constexpr, FENCE: tl.constexpr, MERGE_H: tl.constexpr, MERGE_S: tl.constexpr):
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
                             KV_GROUP, MERGE_H, HEAD_DIM, MERGE_S)
                tl.store(cnt_ptr + pid_bh, 0)  # ready for the next launch (stream order)


@triton.jit
def _merge_kernel(o_part_ptr, lse_part_ptr, out_ptr, n_total,
                  stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_outb, stride_outh,
                  NUM_KV_HEADS: tl.constexpr, KV_GROUP: tl.constexpr, MERGE_H: tl.constexpr,
                  HEAD_DIM: tl.constexpr, MERGE_S: tl.constexpr):
    pid = tl.program_id(0)
    _merge_group(o_part_ptr, lse_part_ptr, out_ptr, pid // NUM_KV_HEADS, pid % NUM_KV_HEADS, n_total,
                 stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_outb, stride_outh,
                 KV_GROUP, MERGE_H, HEAD_DIM, MERGE_S)


# ---------------------------------------------------------------------------------------------
# fp16 tier

@triton.jit
def _fp16_tier_kernel(
    q_ptr, o_part_ptr, lse_part_ptr, out_ptr, cnt_ptr, k_ptr, v_ptr,
    bt_ptr, fill_ptr, len_ptr, npg_ptr,
    stride_qb, stride_qh, stride_bt, stride_f, stride_p, stride_h,
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_outb, stride_outh,
    split_base, n_total, qk_scale,
    NUM_KV_HEADS: tl.constexpr, KV_GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr, TILE: tl.constexpr, FILLED: tl.constexpr, DOT_F32: tl.constexpr,
    DIRECT: tl.constexpr, FUSED_MERGE: tl.constexpr, FENCE: tl.constexpr,
    MERGE_H: tl.constexpr, MERGE_S: tl.constexpr,
):
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
    n_tok = tl.load(len_ptr + b)
    if FILLED:
        n_pages = tl.load(npg_ptr + b)
    else:
        n_pages = tl.cdiv(n_tok, PAGE)
    lo, hi = _split_range(n_pages, split, tl.num_programs(1), PAGE, TILE)
    bt_row = bt_ptr + b * stride_bt
    fill_row = fill_ptr + b * stride_f
    head_off = kv_head * stride_h
    m_i = tl.full([BLOCK_G], NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], dtype=tl.float32)
    for l0 in tl.range(lo, hi, TILE):
        if PAGE >= TILE:
            page, s0, tm = _page_of_step(bt_row, fill_row, n_tok, n_pages, l0, offs_t, PAGE, FILLED)
            rows = page * stride_p + head_off + (s0 + offs_t).to(tl.int64) * HEAD_DIM
        else:  # TILE / PAGE pages a step, page id (and fill) per slot; PAGE 1: a row gather
            l = l0 + offs_t
            j = l // PAGE
            s = l % PAGE
            if FILLED:
                fill = tl.load(fill_row + j, mask=j < n_pages, other=0)
                tm = s < fill
            else:
                tm = l < n_tok
            page = tl.load(bt_row + j, mask=tm, other=0).to(tl.int64)
            rows = page * stride_p + head_off + s.to(tl.int64) * HEAD_DIM
        rows = tl.multiple_of(rows, 8)
        k = tl.load(k_ptr + rows[:, None] + offs_d[None, :], mask=tm[:, None], other=0.0)
        v = tl.load(v_ptr + rows[:, None] + offs_d[None, :], mask=tm[:, None], other=0.0)
        if DOT_F32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s_qk = tl.dot(q, tl.trans(k)) * qk_scale
        s_qk = tl.where(tm[None, :], s_qk, float("-inf"))
        m_i, l_i, alpha, p = _softmax_update(m_i, l_i, s_qk)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    _finish(acc, acc, m_i, l_i, o_part_ptr, lse_part_ptr, out_ptr, cnt_ptr, b, kv_head, pid_bh,
            split_base + split, n_total, offs_g, gmask,
            stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_outb, stride_outh,
            KV_GROUP, HEAD_DIM, 1, DIRECT, FUSED_MERGE, FENCE, MERGE_H, MERGE_S)


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
                    FILLED: tl.constexpr):
    """One step's raw codes of an int tier: K [TILE, W], V [TILE, W] (read dim-major), the fp16
    index of each slot's first scale [TILE] and the slot mask [TILE].

        PAGE >= TILE   one page: a scalar page id, every stream one contiguous run
        PAGE <  TILE   TILE / PAGE listed pages, their ids and fills loaded as a vector, each
                       page's runs contiguous ([pages, PAGE, W] loads reshaped to [TILE, W])"""
    SCALE0: tl.constexpr = PAGE * W // 2  # fp16 index of the scales inside a block
    offs_c = tl.arange(0, W)
    if PAGE >= TILE:
        offs_t = tl.arange(0, TILE)
        page, s0, tm = _page_of_step(bt_row, fill_row, n_tok, n_pages, l0, offs_t, PAGE, FILLED)
        blk = tl.multiple_of(page * stride_p + kv_head * stride_h, 16)
        slot = s0 + offs_t
        kq = tl.load(k_ptr + blk + slot[:, None] * W + offs_c[None, :], mask=tm[:, None], other=0)
        vq = tl.load(v_ptr + blk + offs_c[None, :] * PAGE + slot[:, None], mask=tm[:, None], other=0)
        srow = blk // 2 + SCALE0 + slot * NG
    else:
        NP: tl.constexpr = TILE // PAGE
        j = l0 // PAGE + tl.arange(0, NP)
        offs_s = tl.arange(0, PAGE)
        if FILLED:
            fill = tl.load(fill_row + j, mask=j < n_pages, other=0)
        else:
            fill = n_tok - j * PAGE
        page = tl.load(bt_row + j, mask=fill > 0, other=0).to(tl.int64)
        blk = tl.multiple_of(page * stride_p + kv_head * stride_h, 16)
        tm3 = offs_s[None, :] < fill[:, None]  # [NP, PAGE]
        kq = tl.load(k_ptr + blk[:, None, None] + offs_s[None, :, None] * W + offs_c[None, None, :],
                     mask=tm3[:, :, None], other=0)
        vq = tl.load(v_ptr + blk[:, None, None] + offs_c[None, None, :] * PAGE + offs_s[None, :, None],
                     mask=tm3[:, :, None], other=0)
        kq = tl.reshape(kq, (TILE, W))
        vq = tl.reshape(vq, (TILE, W))
        tm = tl.reshape(tm3, (TILE,))
        srow = tl.reshape(blk[:, None] // 2 + SCALE0 + offs_s[None, :] * NG, (TILE,))
    return kq, vq, srow, tm


@triton.jit
def _int_tier_kernel(
    q_ptr, o_part_ptr, lse_part_ptr, out_ptr, cnt_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr,
    bt_ptr, fill_ptr, len_ptr, npg_ptr,
    stride_qb, stride_qh, stride_bt, stride_f, stride_p, stride_h,
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_outb, stride_outh,
    split_base, n_total, qk_scale,
    TIER: tl.constexpr, NUM_KV_HEADS: tl.constexpr, KV_GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr, GROUP_SIZE: tl.constexpr, PAGE: tl.constexpr, TILE: tl.constexpr,
    FILLED: tl.constexpr, QK_INT8: tl.constexpr, FAST_CVT: tl.constexpr,
    DIRECT: tl.constexpr, FUSED_MERGE: tl.constexpr, FENCE: tl.constexpr,
    MERGE_H: tl.constexpr, MERGE_S: tl.constexpr,
):
    """TIER 1 (int8) or 2 (int4). Block of (page, kv head), bytes from k_ptr / v_ptr +
    page * stride_p + kv_head * stride_h (module docstring of paged_layout.py):
        K codes [PAGE, W] | scale [PAGE, NG] | zero [PAGE, NG]     (ks_ptr: the same bytes as fp16)
        V codes [W, PAGE] | scale [PAGE, NG] | zero [PAGE, NG]"""
    HALVES: tl.constexpr = TIER  # int8: one accumulator over D; int4: low and high halves
    W: tl.constexpr = HEAD_DIM // HALVES
    NG: tl.constexpr = HEAD_DIM // GROUP_SIZE
    FOLD: tl.constexpr = NG == 1
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    b = pid_bh // NUM_KV_HEADS
    kv_head = pid_bh % NUM_KV_HEADS
    offs_g = tl.arange(0, BLOCK_G)
    offs_c = tl.arange(0, W)
    gmask = offs_g < KV_GROUP
    q_rows = b * stride_qb + (kv_head * KV_GROUP + offs_g) * stride_qh
    qa = tl.load(q_ptr + q_rows[:, None] + offs_c[None, :], mask=gmask[:, None], other=0.0).to(tl.float32)
    q_sum = tl.sum(qa, 1)  # the zero-point term of every folded score
    qb = qa
    if HALVES == 2:
        qb = tl.load(q_ptr + q_rows[:, None] + W + offs_c[None, :], mask=gmask[:, None], other=0.0).to(tl.float32)
        q_sum += tl.sum(qb, 1)
    qa16 = qa.to(tl.float16)
    qb16 = qb.to(tl.float16)
    if QK_INT8:
        qmax = tl.max(tl.abs(qa), 1)
        if HALVES == 2:
            qmax = tl.maximum(qmax, tl.max(tl.abs(qb), 1))
        q_sc = tl.where(qmax > 0, qmax / 127.0, 1.0)
        qa8 = _round_i8(qa / q_sc[:, None])
        qb8 = _round_i8(qb / q_sc[:, None])
        q8_sum = tl.sum(qa8.to(tl.int32), 1).to(tl.float32)

    n_tok = tl.load(len_ptr + b)
    if FILLED:
        n_pages = tl.load(npg_ptr + b)
    else:
        n_pages = tl.cdiv(n_tok, PAGE)
    lo, hi = _split_range(n_pages, split, tl.num_programs(1), PAGE, TILE)
    bt_row = bt_ptr + b * stride_bt
    fill_row = fill_ptr + b * stride_f
    m_i = tl.full([BLOCK_G], NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc_a = tl.zeros([BLOCK_G, W], dtype=tl.float32)
    acc_b = tl.zeros([BLOCK_G, W], dtype=tl.float32)
    for l0 in tl.range(lo, hi, TILE):
        kq, vq, srow, tm = _int_step_codes(k_ptr, v_ptr, bt_row, fill_row, n_tok, n_pages, l0, kv_head,
                                           stride_p, stride_h, PAGE, TILE, W, NG, FILLED)
        zrow = srow + PAGE * NG
        if FOLD:
            ks = tl.load(ks_ptr + srow, mask=tm, other=0.0).to(tl.float32)
            kz = tl.load(ks_ptr + zrow, mask=tm, other=0.0).to(tl.float32)
            vs = tl.load(vs_ptr + srow, mask=tm, other=0.0).to(tl.float32)
            vz = tl.load(vs_ptr + zrow, mask=tm, other=0.0).to(tl.float32)
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
                if HALVES == 1:
                    qk = tl.dot(qa16, tl.trans(_cvt_u8(kq, FAST_CVT)))
                else:
                    k_lo, k_hi = _cvt_nibbles(kq, FAST_CVT)
                    qk = tl.dot(qa16, tl.trans(k_lo))
                    qk = tl.dot(qb16, tl.trans(k_hi), qk)
            s_qk = (qk * ks[None, :] + q_sum[:, None] * kz[None, :]) * qk_scale
            s_qk = tl.where(tm[None, :], s_qk, float("-inf"))
            m_i, l_i, alpha, p = _softmax_update(m_i, l_i, s_qk)
            pw = (p * vs[None, :]).to(tl.float16)
            zero = tl.sum(p * vz[None, :], 1)[:, None]
            if HALVES == 1:
                acc_a = tl.dot(pw, _cvt_u8(vq, FAST_CVT), acc_a * alpha[:, None]) + zero
            else:
                v_lo, v_hi = _cvt_nibbles(vq, FAST_CVT)
                acc_a = tl.dot(pw, v_lo, acc_a * alpha[:, None]) + zero
                acc_b = tl.dot(pw, v_hi, acc_b * alpha[:, None]) + zero
        else:
            # ---- G < D: per-element dequantization, plain dots
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
    _finish(acc_a, acc_b, m_i, l_i, o_part_ptr, lse_part_ptr, out_ptr, cnt_ptr, b, kv_head, pid_bh,
            split_base + split, n_total, offs_g, gmask,
            stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_outb, stride_outh,
            KV_GROUP, HEAD_DIM, HALVES, DIRECT, FUSED_MERGE, FENCE, MERGE_H, MERGE_S)


# ---------------------------------------------------------------------------------------------
# launcher

_TL_DTYPE = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}
MERGE_S = 8  # partials per merge step


# (tier, constexprs, tile, warps, stages) asked for -> (tile, stages) that fit the GPU's shared memory
LAUNCHED: dict = {}


def _launch(kernel, grid, args, kw, tier, tile, warps, stages) -> None:
    """Launch with (tile, warps, stages); if that config does not fit the GPU (Triton raises
    OutOfResources at its first launch), fewer stages, then half the tile, and remember what ran
    (LAUNCHED: benchmarks report it next to the config they asked for)."""
    from triton.runtime.errors import OutOfResources

    key = (tier, tuple(sorted(kw.items())), tile, warps, stages)
    tile_now, stages_now = LAUNCHED.get(key, (tile, stages))
    while True:
        try:
            kernel[grid](*args, TILE=tile_now, num_warps=warps, num_stages=stages_now, **kw)
            LAUNCHED[key] = (tile_now, stages_now)
            return
        except OutOfResources:
            if stages_now > 1:
                stages_now -= 1
            elif tile_now > 16:
                tile_now, stages_now = tile_now // 2, stages
            else:
                raise


def fallbacks() -> list[dict]:
    """The launches that ran another (tile, stages) than asked for, as LAUNCHED recorded them."""
    return [{"tier": k[0], "asked": {"tile": k[2], "warps": k[3], "stages": k[4]},
             "ran": {"tile": v[0], "stages": v[1]}, "head_dim": dict(k[1]).get("HEAD_DIM")}
            for k, v in LAUNCHED.items() if v != (k[2], k[4])]


def _check(q, layer: TieredKVLayer, tables: TieredBlockTables, tiers) -> None:
    B, Hq, D = q.shape
    layer.check(uniform=False)
    assert q.dtype == layer.dtype and D == layer.head_dim, (q.dtype, layer.dtype, D, layer.head_dim)
    assert q.dtype in (torch.float16, torch.bfloat16), q.dtype
    assert q.stride(-1) == 1, "q: last dim must be contiguous"
    assert Hq % layer.num_kv_heads == 0, (Hq, layer.num_kv_heads)
    assert D >= 16 and D & (D - 1) == 0, "head_dim must be a power of two >= 16"
    assert all(t in TIERS for t in tiers) and len(set(tiers)) == len(tiers), tiers
    for t in tiers:
        p = layer.page_size_of(t)
        assert p >= 1 and p & (p - 1) == 0, f"tier {t}: page size {p} must be a power of two"
        if t != TIER_FP16:
            assert p >= 16 and D >= 32, f"tier {t}: int pages need PAGE >= 16 and head_dim >= 32 ({p}, {D})"
    tables.check(layer.page_size)
    assert tables.batch_size == B, (tables.batch_size, B)


def tiered_pool_decode(
    q: torch.Tensor, layer: TieredKVLayer, tables: TieredBlockTables, sm_scale: Optional[float] = None,
    out: Optional[torch.Tensor] = None, plan: Optional[TieredDecodePlan] = None,
    config: Optional[TieredDecodeConfig] = None, tiers: tuple = TIERS, check: bool = True,
) -> torch.Tensor:
    """Decode attention of q [B, Hq, D] over each request's tiered cache -> [B, Hq, D] (module doc).

    tiers: the tiers to read (a tier left out must hold no token of the batch: the backend passes
    the stores that have pages). plan: plan_tiered_pool_decode (default: from the widest table,
    a host number); config: served_config(D, Hq / Hkv) by default; check=False skips the layout
    checks (callers that run many layers over one batch check once)."""
    B, Hq, D = q.shape
    Hkv = layer.num_kv_heads
    kv_group = Hq // Hkv
    config = config or served_config(D, kv_group)
    tiers = tuple(tiers)
    if check:
        _check(q, layer, tables, tiers)
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(-1) == 1
    if B == 0:
        return out
    if not tiers:
        return out.zero_()
    if plan is None:
        width = max(int(tables.tables[t].shape[1]) * layer.page_size_of(t) for t in tiers)
        plan = plan_tiered_pool_decode(B, Hkv, width, q.device, config)
    S = plan.num_splits
    n_total = S * len(tiers)
    direct = n_total == 1
    fused = plan.counters is not None and not direct
    if fused:
        assert plan.counters.numel() >= B * Hkv and plan.counters.dtype == torch.int32
    if direct:
        o_part = lse_part = out  # unused
        so = (0, 0, 0)
        sl = (0, 0)
    else:
        o_part = torch.empty((B, Hq, n_total, D), dtype=torch.float32, device=q.device)
        lse_part = torch.empty((B, Hq, n_total), dtype=torch.float32, device=q.device)
        so = (o_part.stride(0), o_part.stride(1), o_part.stride(2))
        sl = (lse_part.stride(0), lse_part.stride(1))
    cnt = plan.counters if fused else tables.lens[0]
    sm_scale = 1.0 / math.sqrt(D) if sm_scale is None else sm_scale
    interp = is_interpret()
    common = dict(NUM_KV_HEADS=Hkv, KV_GROUP=kv_group, BLOCK_G=max(16, next_pow2(kv_group)), HEAD_DIM=D,
                  FILLED=tables.filled, DIRECT=direct, FUSED_MERGE=fused, FENCE=not interp,
                  MERGE_H=next_pow2(kv_group), MERGE_S=MERGE_S)
    bt, ln = tables.tables, tables.lens
    fills = tables.fills if tables.filled else bt  # dense: unused (FILLED=False)
    npg = tables.num_pages if tables.filled else ln
    for i, t in enumerate(tiers):
        tp, PAGE = layer[t], layer.page_size_of(t)
        tile, warps, stages = config.launch(t)
        args = (q, o_part, lse_part, out, cnt)
        tail = (bt[t], fills[t], ln[t], npg[t],
                q.stride(0), q.stride(1), bt[t].stride(0), fills[t].stride(0), tp.k.stride(0), tp.k.stride(1),
                *so, *sl, out.stride(0), out.stride(1), i * S, n_total, sm_scale * LOG2E)
        if t == TIER_FP16:
            kernel, args = _fp16_tier_kernel, (*args, tp.k, tp.v, *tail)
            kw = dict(PAGE=PAGE, DOT_F32=interp and q.dtype == torch.bfloat16, **common)
        else:
            halves = 1 if t == TIER_INT8 else 2
            kernel, args = _int_tier_kernel, (*args, tp.k, tp.v, tp.k.view(torch.float16), tp.v.view(torch.float16),
                                              *tail)
            # NOTE: the PRMT / LOP3 conversion packs 4 codes per register: tiles with fewer than 4
            # elements per thread (tiny test shapes) take the portable conversion
            packable = tile * (D // halves) >= 8 * 32 * warps
            kw = dict(TIER=t, GROUP_SIZE=layer.group_size, PAGE=PAGE,
                      QK_INT8=config.qk_int8 and layer.group_size == D and D // halves >= 32,
                      FAST_CVT=config.fast_cvt and not interp and packable, **common)
        _launch(kernel, (B * Hkv, S), args, kw, t, tile, warps, stages)
    if not direct and not fused:
        _merge_kernel[(B * Hkv,)](
            o_part, lse_part, out, n_total, *so, *sl, out.stride(0), out.stride(1),
            NUM_KV_HEADS=Hkv, KV_GROUP=kv_group, MERGE_H=next_pow2(kv_group), HEAD_DIM=D, MERGE_S=MERGE_S,
            num_warps=4)
    return out


def tiered_pool_decode_reference(q, layer: TieredKVLayer, tables: TieredBlockTables,
                                 sm_scale: Optional[float] = None) -> torch.Tensor:
    """Torch reference (any table form, any page sizes): each request's cache dequantized through
    tier_codec (gather_request_kv), fp32 attention; a request with no token gets 0."""
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


def with_config(config: Optional[TieredDecodeConfig] = None, **knobs) -> TieredDecodeConfig:
    """A copy of `config` (DEFAULT_CONFIG) with some knobs changed (benchmark sweeps)."""
    return replace(config or DEFAULT_CONFIG, **knobs)
