"""Attention mass per key of a prompt's window queries: SpectrumKV's importance capture, one layer.

    window_mass(q, k, pos0, scale, mass, softcap=None, sliding_window=None) -> mass  (accumulated)
    window_mass_reference(...)                                                      (torch: same sums)

q      [W, Hq, D] the window's queries (post-RoPE), at the consecutive positions [pos0, pos0 + W)
k      [T, Hkv, D] the keys at positions [0, T) (post-RoPE, the layer's pool rows gathered);
       pos0 + W <= T
mass   float32 [>= T], contiguous: mass[t] += sum over queries w and query heads h of

    p[w, h, t] = softmax_t(q[w, h] . k[t, h // G] * scale)   over the keys t <= pos0 + w
                 (and t > pos0 + w - sliding_window), with tanh soft-capping when given

Grid (Hkv, cdiv(W * G, BLOCK_M), S): a program takes BLOCK_M (query, head-in-group) rows of one kv
head and one of S key ranges. Pass 1 finds the rows' running max and sum (log2 domain) over the
keys, pass 2 each key block's probabilities, summed over the rows and atomically added to mass.
With S = 1 one launch does both over every key; with S > 1 (a long prompt: 8 kv heads x 8 row
blocks of a 32-query window are 64 programs, too few to keep an H100 reading) a first launch
stores each split's (max, sum) per row and the second combines them before its pass 2. One or
two launches per layer in place of the torch path's dozen (casts, masks, einsum, softmax, sum): on
a prefill, whose host launches every layer's kernels, that host time is what the capture costs. The products run in
the inputs' dtype with float32 accumulation (bf16 / fp16 products are exact in float32), so the
sums match the float32 torch path up to summation order; atomics make the last bits run-dependent.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._split_k import NEG_BIG
from ._tiles import is_interpret

LOG2E = 1.4426950408889634
LOG2E_C: tl.constexpr = tl.constexpr(LOG2E)  # (inside the kernels)


@triton.jit
def _logits(q, k_ptr, t0, n_keys, qpos, row_ok, kv_head, qk_scale, softcap, window, stride_kt, stride_kh,
            HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr, SLIDING: tl.constexpr,
            DOT_F32: tl.constexpr):
    """Masked logits [BLOCK_M, BLOCK_N] (log2 domain, NEG_BIG where masked) of the rows' queries q
    against keys [t0, t0 + BLOCK_N) of one kv head, and the key positions [BLOCK_N]."""
    t = t0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    k = tl.load(k_ptr + t[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :], mask=(t < n_keys)[:, None],
                other=0.0)
    if DOT_F32:  # the interpreter's dot takes no bf16
        k = k.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision="ieee")  # float32 accumulation; float32 inputs not as TF32
    if SOFTCAP:  # softcap * tanh(s * scale / softcap), tanh(x) = 2 / (1 + e^(-2x)) - 1
        x = s * (qk_scale / LOG2E_C) / softcap
        s = softcap * (2.0 / (1.0 + tl.exp(-2.0 * x)) - 1.0) * LOG2E_C
    else:
        s = s * qk_scale
    vis = (t[None, :] <= qpos[:, None]) & (t[None, :] < n_keys) & row_ok[:, None]
    if SLIDING:
        vis = vis & (t[None, :] > qpos[:, None] - window)
    return tl.where(vis, s, NEG_BIG), vis, t


@triton.jit
def _rows(q_ptr, n_rows, pos0, stride_qw, stride_qh, KV_GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
          BLOCK_M: tl.constexpr, DOT_F32: tl.constexpr):
    """The program's BLOCK_M (query, head-in-group) rows of kv head program_id(0), block
    program_id(1): (q [BLOCK_M, D], their positions, row_ok)."""
    kv_head = tl.program_id(0)
    r = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)  # row r: query w = r // G, head kv_head * G + r % G
    row_ok = r < n_rows * KV_GROUP
    w = r // KV_GROUP
    head = kv_head * KV_GROUP + r % KV_GROUP
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + w[:, None] * stride_qw + head[:, None] * stride_qh + offs_d[None, :], mask=row_ok[:, None],
                other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    return q, pos0 + w, row_ok


@triton.jit
def _row_stats(q, k_ptr, t_lo, t_hi, qpos, row_ok, kv_head, qk_scale, softcap, window, stride_kt, stride_kh,
               HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr,
               SLIDING: tl.constexpr, DOT_F32: tl.constexpr):
    """Each row's running max and sum of exp2 (log2 domain) over the keys [t_lo, t_hi)."""
    m_i = tl.full([BLOCK_M], NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    for t0 in range(t_lo, t_hi, BLOCK_N):
        s, vis, _ = _logits(q, k_ptr, t0, t_hi, qpos, row_ok, kv_head, qk_scale, softcap, window, stride_kt,
                            stride_kh, HEAD_DIM, BLOCK_N, SOFTCAP, SLIDING, DOT_F32)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        l_i = l_i * tl.exp2(m_i - m_new) + tl.sum(tl.where(vis, tl.exp2(s - m_new[:, None]), 0.0), 1)
        m_i = m_new
    return m_i, l_i


@triton.jit
def _window_stats_kernel(q_ptr, k_ptr, stats_ptr, n_rows, end, pos0, split_len, qk_scale, softcap, window,
                         stride_qw, stride_qh, stride_kt, stride_kh,
                         KV_GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         SOFTCAP: tl.constexpr, SLIDING: tl.constexpr, DOT_F32: tl.constexpr):
    """Pass 1 of a key split: the rows' (max, sum) over the split's keys into stats
    [2, Hkv, row blocks, splits, BLOCK_M] (an empty split: NEG_BIG, 0)."""
    q, qpos, row_ok = _rows(q_ptr, n_rows, pos0, stride_qw, stride_qh, KV_GROUP, HEAD_DIM, BLOCK_M, DOT_F32)
    kv_head, rb, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    t_lo = split * split_len
    m_i, l_i = _row_stats(q, k_ptr, t_lo, tl.minimum(end, t_lo + split_len), qpos, row_ok, kv_head, qk_scale,
                          softcap, window, stride_kt, stride_kh, HEAD_DIM, BLOCK_M, BLOCK_N, SOFTCAP, SLIDING,
                          DOT_F32)
    n_splits = tl.num_programs(2)
    at = ((kv_head * tl.num_programs(1) + rb) * n_splits + split) * BLOCK_M + tl.arange(0, BLOCK_M)
    half = tl.num_programs(0) * tl.num_programs(1) * n_splits * BLOCK_M
    tl.store(stats_ptr + at, m_i)
    tl.store(stats_ptr + half + at, l_i)


@triton.jit
def _window_mass_kernel(q_ptr, k_ptr, mass_ptr, stats_ptr, n_rows, end, pos0, split_len, qk_scale, softcap,
                        window, stride_qw, stride_qh, stride_kt, stride_kh,
                        KV_GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        SOFTCAP: tl.constexpr, SLIDING: tl.constexpr, DOT_F32: tl.constexpr,
                        SPLITS_POW2: tl.constexpr):
    """Pass 2 over the keys of split program_id(2): each key's probabilities, summed over the
    rows, atomically added to mass. One split (SPLITS_POW2 == 1): pass 1 runs here first over every
    key; otherwise the rows' (max, sum) combine the splits' stats from _window_stats_kernel."""
    q, qpos, row_ok = _rows(q_ptr, n_rows, pos0, stride_qw, stride_qh, KV_GROUP, HEAD_DIM, BLOCK_M, DOT_F32)
    kv_head, rb, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    t_lo = split * split_len
    t_hi = tl.minimum(end, t_lo + split_len)
    if SPLITS_POW2 == 1:
        m_i, l_i = _row_stats(q, k_ptr, 0, end, qpos, row_ok, kv_head, qk_scale, softcap, window, stride_kt,
                              stride_kh, HEAD_DIM, BLOCK_M, BLOCK_N, SOFTCAP, SLIDING, DOT_F32)
    else:
        n_splits = tl.num_programs(2)
        sp = tl.arange(0, SPLITS_POW2)
        at = ((kv_head * tl.num_programs(1) + rb) * n_splits + sp[:, None]) * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
        half = tl.num_programs(0) * tl.num_programs(1) * n_splits * BLOCK_M
        live = (sp < n_splits)[:, None]
        m_s = tl.load(stats_ptr + at, mask=live, other=NEG_BIG)  # [SPLITS_POW2, BLOCK_M]
        l_s = tl.load(stats_ptr + half + at, mask=live, other=0.0)
        m_i = tl.max(m_s, 0)
        l_i = tl.sum(l_s * tl.exp2(m_s - m_i[None, :]), 0)
    inv_l = tl.where(row_ok & (l_i > 0), 1.0 / tl.where(l_i > 0, l_i, 1.0), 0.0)
    for t0 in range(t_lo, t_hi, BLOCK_N):  # pass 2: probabilities, summed over the rows per key
        s, vis, t = _logits(q, k_ptr, t0, t_hi, qpos, row_ok, kv_head, qk_scale, softcap, window, stride_kt,
                            stride_kh, HEAD_DIM, BLOCK_N, SOFTCAP, SLIDING, DOT_F32)
        p = tl.where(vis, tl.exp2(s - m_i[:, None]) * inv_l[:, None], 0.0)
        tl.atomic_add(mass_ptr + t, tl.sum(p, 0), mask=t < t_hi)


# Programs a launch aims for when it splits the keys (a few per SM of an H100's 132), and the
# fewest key blocks a split takes (below that, the stats pass and the combine cost more than the
# parallelism returns).
TARGET_PROGRAMS = 512
MIN_SPLIT_BLOCKS = 8


def key_splits(end: int, programs: int, block_n: int) -> int:
    """How many key ranges to split `end` keys into, for `programs` (kv head, row block) pairs."""
    return max(1, min(triton.cdiv(end, block_n * MIN_SPLIT_BLOCKS), TARGET_PROGRAMS // max(1, programs)))


def window_mass(q: torch.Tensor, k: torch.Tensor, pos0: int, scale: float, mass: torch.Tensor,
                softcap: float | None = None, sliding_window: int | None = None, block_m: int = 16,
                block_n: int = 64, splits: int | None = None) -> torch.Tensor:
    """mass[t] += the window queries' attention probabilities on key t (module docstring). No
    host sync; one launch, or two when the keys are split (`splits`, default key_splits: the
    stats pass, then the mass pass)."""
    w, hq, d = q.shape
    t, hkv, dk = k.shape
    assert dk == d and hq % hkv == 0 and d & (d - 1) == 0 and d >= 16, (q.shape, k.shape)
    assert pos0 >= 0 and pos0 + w <= t, f"queries at [{pos0}, {pos0 + w}) need keys up to there; got {t}"
    assert mass.dtype == torch.float32 and mass.is_contiguous() and mass.numel() >= t and mass.device == q.device
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and q.dtype == k.dtype
    if w == 0 or t == 0:
        return mass
    group = hq // hkv
    row_blocks = triton.cdiv(w * group, block_m)
    end = min(t, pos0 + w)  # keys past the last query's position are masked for every row
    n_splits = key_splits(end, hkv * row_blocks, block_n) if splits is None else splits
    assert n_splits >= 1
    split_len = triton.cdiv(triton.cdiv(end, n_splits), block_n) * block_n
    n_splits = triton.cdiv(end, split_len)  # none empty
    grid = (hkv, row_blocks, n_splits)
    args = (w, end, pos0, split_len, float(scale) * LOG2E, float(softcap or 1.0), int(sliding_window or 0),
            q.stride(0), q.stride(1), k.stride(0), k.stride(1))
    meta = dict(KV_GROUP=group, HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n, SOFTCAP=softcap is not None,
                SLIDING=sliding_window is not None, DOT_F32=is_interpret() or q.dtype == torch.float32,
                num_warps=4)
    stats = mass  # a placeholder pointer with one split
    if n_splits > 1:
        stats = torch.empty((2, hkv, row_blocks, n_splits, block_m), dtype=torch.float32, device=q.device)
        _window_stats_kernel[grid](q, k, stats, *args, **meta)
    _window_mass_kernel[grid](q, k, mass, stats, *args, **meta, SPLITS_POW2=triton.next_power_of_2(n_splits))
    return mass


def window_mass_reference(q: torch.Tensor, k: torch.Tensor, pos0: int, scale: float, mass: torch.Tensor,
                          softcap: float | None = None, sliding_window: int | None = None) -> torch.Tensor:
    """Torch reference of window_mass: float32 logits of every (query, head), masked softmax over
    the keys, summed over queries and heads into mass[:T]."""
    w, hq, d = q.shape
    t, hkv, _ = k.shape
    group = hq // hkv
    logits = torch.einsum("whgd,thd->whgt", q.float().view(w, hkv, group, d), k.float()) * scale
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    pos = torch.arange(pos0, pos0 + w, device=q.device)[:, None]
    key = torch.arange(t, device=q.device)[None, :]
    visible = key <= pos
    if sliding_window is not None:
        visible &= key > pos - sliding_window
    logits = logits.masked_fill(~visible[:, None, None, :], -math.inf)
    mass[:t] += torch.softmax(logits, dim=-1).sum(dim=(0, 1, 2))
    return mass
