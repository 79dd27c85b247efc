"""FusedKV attention for reconstruction layers, over the paged fp16 pool (PagedFp16KVPool).

A reconstruction layer stores no KV. Its K and V are rebuilt per page, in registers, from the
caches of the two source layers (sgl_kvxfer/models/fusedkv_math.py), read through the SAME
block tables (all layers of a request share its slots):

    FusedKV  (SOURCES = 2):  K = a0 * K_s0 + a1 * K_s1,   V = b0 * V_s0 + b1 * V_s1
    Lite     (SOURCES = 1):  K = K_s1,                    V = V_s0     (plain paged attention)

    fusedkv_decode_attention(q, k_pages, v_pages, block_table, seq_lens, weights=None, ...) -> o
    fusedkv_extend_attention(q, qo_indptr, k_pages, v_pages, block_table, kv_lens, weights=None, ...) -> o

k_pages / v_pages: tuples of pool buffers [num_pages + 2, Hkv, PAGE, D] (head-major pages),
(K_s0, K_s1) / (V_s0, V_s1) for FusedKV, (K_s1,) / (V_s0,) for Lite. weights: float32
[4, Hkv, D] contiguous = (a0, a1, b0, b1) per channel (`pack_fusion_weights`; the key weights
already expanded from their rotary-pair form, so a0[c] == a0[c'] for each pair). Numerics
follow `reference.fuse_kv`: fp32 products and sum, one rounding to the model dtype, then the
usual dot. block_table int32 [B, W]: page ids of request b's slots 0..PAGE-1, PAGE..2*PAGE-1, ...

Decode, grid (B * Hkv, S): as kernels/paged_fp16_pool_decode.py (split-K, all KV_GROUP query heads of
a kv-head per program, LSE merge by its `merge_splits`; S == 1 writes o directly).
Also the prefill-skip path: when a reconstruction layer runs only the LAST token of each
prompt, that is one query per request over seq_lens keys already in the pool, i.e. decode.

Extend, grid (B, Hkv, cdiv(max_q_len, BLOCK_T)): request b's queries are the LAST n_b =
qo_indptr[b+1] - qo_indptr[b] tokens of its kv_lens[b] keys (every key, the queries' own
included, is already in the source layers' pages: the source layers ran first), so query i
(0-based among n_b) sits at position p_i = kv_len - n_b + i and sees keys [0, p_i]:

    keys   0 ........................ kv_len - n_b ...... kv_len - 1
           |------ cached prefix -----|---- the queries' own tokens ---|
    query i:  visible keys [0, kv_len - n_b + i]  (causal over the suffix)

This covers chunked prefill (n_b = the chunk) and prefill-skip with a logprob suffix.
Key tiles of BLOCK_N slots lie in one page (BLOCK_N divides PAGE): one scalar page id a step.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from ._tiles import is_interpret, next_pow2, num_sms
from ._split_k import LOG2E, NEG_BIG, merge_splits, split_outputs, _softmax_step, _store_split_result
from .paged_fp16_pool_decode import SPLIT_WAVES, _split_pages

# Elements of one K (or V) source tile per loop step: FusedKV holds four tiles (two sources of K
# and V) where plain attention holds two, so half of paged_fp16_pool_decode.FP16_STEP_ELEMS.
FUSED_STEP_ELEMS = 4096
LITE_STEP_ELEMS = 8192

if is_interpret():
    _EXTEND_CONFIGS = [triton.Config({"BLOCK_ROWS": 16, "BLOCK_N": 16}, num_warps=4, num_stages=1)]
else:
    # BLOCK_ROWS <= 32 keeps tl.dot on mma.sync as extend_attention.py does (Triton 3.6's wgmma
    # path crashed there on register-built operands; the fused K is one too).
    _EXTEND_CONFIGS = [
        triton.Config({"BLOCK_ROWS": r, "BLOCK_N": n}, num_warps=w, num_stages=s)
        for r, n, w, s in ((32, 64, 4, 2), (32, 32, 4, 2), (16, 64, 2, 2), (32, 64, 4, 3))
    ]


def _prune_extend(configs, named_args, **kwargs):
    """A key tile must lie inside one page: BLOCK_N <= PAGE (both powers of two)."""
    page = kwargs["PAGE"]
    kept = [c for c in configs if c.kwargs["BLOCK_N"] <= page]
    return kept or [triton.Config({**configs[0].kwargs, "BLOCK_N": page}, num_warps=configs[0].num_warps,
                                  num_stages=configs[0].num_stages)]


def pack_fusion_weights(key_weight: torch.Tensor, value_weight: torch.Tensor) -> torch.Tensor:
    """(key [2, Hkv, D] per channel, value [2, Hkv, D]) -> float32 [4, Hkv, D] contiguous, the
    kernels' layout (a0, a1, b0, b1). Build once per layer at load, not per call."""
    assert key_weight.shape == value_weight.shape and key_weight.shape[0] == 2, (key_weight.shape, value_weight.shape)
    return torch.cat([key_weight, value_weight]).float().contiguous()


@triton.jit
def _load_fused_tile(k0_ptr, k1_ptr, v0_ptr, v1_ptr, rows, offs_d, tmask, a0, a1, b0, b1,
                     OUT_DTYPE: tl.constexpr, SOURCES: tl.constexpr):
    """K, V tiles [N, D] at element offsets rows[:, None] + offs_d of the source buffers.
    SOURCES == 2: fused in fp32 (a*, b* [D] fp32), rounded once to OUT_DTYPE; 1: loaded as is."""
    ptrs = rows[:, None] + offs_d[None, :]
    if SOURCES == 2:
        k0 = tl.load(k0_ptr + ptrs, mask=tmask[:, None], other=0.0).to(tl.float32)
        k1 = tl.load(k1_ptr + ptrs, mask=tmask[:, None], other=0.0).to(tl.float32)
        v0 = tl.load(v0_ptr + ptrs, mask=tmask[:, None], other=0.0).to(tl.float32)
        v1 = tl.load(v1_ptr + ptrs, mask=tmask[:, None], other=0.0).to(tl.float32)
        # one rounding to the pool's dtype (fuse_kv's contract), then OUT_DTYPE (the dot's:
        # fp32 for bf16 under the interpreter, whose bf16 dot is wrong; else the same)
        k = (a0[None, :] * k0 + a1[None, :] * k1).to(k0_ptr.dtype.element_ty).to(OUT_DTYPE)
        v = (b0[None, :] * v0 + b1[None, :] * v1).to(k0_ptr.dtype.element_ty).to(OUT_DTYPE)
    else:
        k = tl.load(k0_ptr + ptrs, mask=tmask[:, None], other=0.0).to(OUT_DTYPE)
        v = tl.load(v0_ptr + ptrs, mask=tmask[:, None], other=0.0).to(OUT_DTYPE)
    return k, v


@triton.jit
def _load_weights(w_ptr, stride_wt, kv_head, offs_d, HEAD_DIM: tl.constexpr, SOURCES: tl.constexpr):
    if SOURCES == 2:
        base = w_ptr + kv_head * HEAD_DIM + offs_d
        return (tl.load(base), tl.load(base + stride_wt), tl.load(base + 2 * stride_wt),
                tl.load(base + 3 * stride_wt))
    else:
        one = tl.full([HEAD_DIM], 1.0, tl.float32)
        return one, one, one, one


@triton.jit
def _fusedkv_decode_kernel(
    q_ptr, o_part_ptr, lse_part_ptr, k0_ptr, k1_ptr, v0_ptr, v1_ptr, w_ptr, bt_ptr, len_ptr,
    stride_qb, stride_qh, stride_bt, stride_p, stride_h, stride_wt,
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
    pps, n_split, qk_scale,
    NUM_KV_HEADS: tl.constexpr, KV_GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, PAGES_PER_ITER: tl.constexpr,
    SOURCES: tl.constexpr, EVEN_SPLITS: tl.constexpr, DIRECT: tl.constexpr, DOT_F32: tl.constexpr,
):
    """Program (b, kv-head, split): pages [p_lo, p_hi) of request b, PAGES_PER_ITER a step
    (one [PPI * PAGE, D] tile gathered from PPI pages). DIRECT: o_part_ptr is o [B, Hq, D]."""
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
    if DOT_F32:
        q = q.to(tl.float32)
    a0, a1, b0, b1 = _load_weights(w_ptr, stride_wt, kv_head, offs_d, HEAD_DIM, SOURCES)

    acc = tl.zeros([BLOCK_G, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([BLOCK_G], NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    n_tok = tl.load(len_ptr + b)
    p_lo, p_hi = _split_pages(split, n_tok, pps, n_split, PAGE, EVEN_SPLITS)
    offs_n = tl.arange(0, PAGES_PER_ITER * PAGE)
    page_of = offs_n // PAGE
    in_page = (offs_n % PAGE).to(tl.int64) * HEAD_DIM
    bt_row = bt_ptr + b * stride_bt
    for p in range(p_lo, p_hi, PAGES_PER_ITER):
        live = p + page_of < p_hi
        page = tl.load(bt_row + p + page_of, mask=live, other=0).to(tl.int64)
        tmask = live & (offs_n < n_tok - p * PAGE)
        rows = page * stride_p + kv_head * stride_h + in_page
        k, v = _load_fused_tile(k0_ptr, k1_ptr, v0_ptr, v1_ptr, rows, offs_d, tmask, a0, a1, b0, b1,
                                q.dtype, SOURCES)
        acc, m_i, l_i = _softmax_step(acc, m_i, l_i, q, k, v, tmask, qk_scale)

    _store_split_result(acc, m_i, l_i, o_part_ptr, lse_part_ptr, b, split, q_heads, offs_d, gmask,
                        stride_ob, stride_oh, stride_os, stride_lb, stride_lh, DIRECT)


@triton.autotune(configs=_EXTEND_CONFIGS, key=["HEAD_DIM", "PAGE", "BLOCK_G", "SOURCES", "DOT_F32"],
                 prune_configs_by={"early_config_prune": _prune_extend})
@triton.jit
def _fusedkv_extend_kernel(
    q_ptr, o_ptr, qo_indptr_ptr, k0_ptr, k1_ptr, v0_ptr, v1_ptr, w_ptr, bt_ptr, len_ptr,
    stride_qn, stride_qh, stride_on, stride_oh, stride_bt, stride_p, stride_h, stride_wt, qk_scale,
    KV_GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    SOURCES: tl.constexpr, DOT_F32: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    blk = tl.program_id(2)
    BLOCK_T: tl.constexpr = BLOCK_ROWS // BLOCK_G  # query tokens per program
    q_start = tl.load(qo_indptr_ptr + b)
    n_q = tl.load(qo_indptr_ptr + b + 1) - q_start
    if blk * BLOCK_T >= n_q:
        return
    kv_len = tl.load(len_ptr + b)
    first = kv_len - n_q  # position of the request's first query

    offs_r = tl.arange(0, BLOCK_ROWS)
    offs_d = tl.arange(0, HEAD_DIM)
    tok = blk * BLOCK_T + offs_r // BLOCK_G  # row -> query index among the request's queries
    g = offs_r % BLOCK_G
    rmask = (tok < n_q) & (g < KV_GROUP)
    pos = first + tok
    head = kv_head * KV_GROUP + g
    row_q = (q_start + tok).to(tl.int64) * stride_qn + head * stride_qh
    q = tl.load(q_ptr + row_q[:, None] + offs_d[None, :], mask=rmask[:, None], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    a0, a1, b0, b1 = _load_weights(w_ptr, stride_wt, kv_head, offs_d, HEAD_DIM, SOURCES)

    acc = tl.zeros([BLOCK_ROWS, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([BLOCK_ROWS], NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    kv_hi = tl.minimum(kv_len, first + (blk + 1) * BLOCK_T)  # past the tile's last query: unseen
    bt_row = bt_ptr + b * stride_bt
    for l0 in range(0, kv_hi, BLOCK_N):
        j = l0 + offs_n
        jmask = j < kv_hi
        page = tl.load(bt_row + l0 // PAGE).to(tl.int64)  # BLOCK_N divides PAGE: one page a tile
        rows = page * stride_p + kv_head * stride_h + (l0 % PAGE + offs_n).to(tl.int64) * HEAD_DIM
        k, v = _load_fused_tile(k0_ptr, k1_ptr, v0_ptr, v1_ptr, rows, offs_d, jmask, a0, a1, b0, b1,
                                q.dtype, SOURCES)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        s = tl.where(jmask[None, :] & (j[None, :] <= pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        pr = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(pr, 1)
        acc = acc * alpha[:, None] + tl.dot(pr.to(v.dtype), v)
        m_i = m_new

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    row_o = (q_start + tok).to(tl.int64) * stride_on + head * stride_oh
    tl.store(o_ptr + row_o[:, None] + offs_d[None, :], o.to(o_ptr.dtype.element_ty), mask=rmask[:, None])


# ---- launchers ----------------------------------------------------------------------------
def _check_sources(q, k_pages, v_pages, weights, block_table, lens):
    """-> (k0, k1, v0, v1, w, SOURCES) with placeholders for Lite; asserts the layout."""
    assert len(k_pages) == len(v_pages) and len(k_pages) in (1, 2), "1 (Lite) or 2 (FusedKV) sources"
    sources = len(k_pages)
    bufs = tuple(k_pages) + tuple(v_pages)
    ref = bufs[0]
    assert ref.dim() == 4, "pages: [num_pages + 2, Hkv, PAGE, D]"
    _, Hkv, PAGE, D = ref.shape
    for t in bufs:
        assert t.shape == ref.shape and t.stride() == ref.stride() and t.dtype == ref.dtype, "sources differ"
        assert t.stride(3) == 1 and t.stride(2) == D, "a (page, head) tile must be one contiguous PAGE x D block"
    assert q.dtype == ref.dtype and q.shape[-1] == D and q.stride(-1) == 1, (q.dtype, ref.dtype, q.shape)
    assert q.shape[1] % Hkv == 0, (q.shape, Hkv)
    assert PAGE >= 16 and PAGE & (PAGE - 1) == 0, "PAGE must be a power of two >= 16"
    assert D >= 16 and D & (D - 1) == 0, "head_dim must be a power of two >= 16"
    assert block_table.dtype == torch.int32 and block_table.stride(-1) == 1, "block_table: int32 [B, W]"
    assert lens.dtype == torch.int32 and lens.is_contiguous(), "lens: int32 [B]"
    if sources == 2:
        assert weights is not None, "FusedKV needs weights (pack_fusion_weights)"
        assert weights.dtype == torch.float32 and weights.shape == (4, Hkv, D) and weights.is_contiguous(), \
            f"weights: float32 [4, {Hkv}, {D}] contiguous, got {weights.dtype} {tuple(weights.shape)}"
        k0, k1, v0, v1 = k_pages[0], k_pages[1], v_pages[0], v_pages[1]
    else:
        assert weights is None, "Lite takes no weights"
        k0, k1, v0, v1 = k_pages[0], k_pages[0], v_pages[0], v_pages[0]
        weights = lens  # unused placeholder pointer
    return k0, k1, v0, v1, weights, sources


def plan_fusedkv_splits(table_width: int, batch: int, num_kv_heads: int, device: torch.device,
                        pages_per_split: Optional[int] = None, split_waves: int = SPLIT_WAVES) -> tuple[int, int]:
    """-> (pages per split, S) from the block table's width alone (no sync): ~split_waves
    stage-1 programs per SM."""
    width = max(1, int(table_width))
    if pages_per_split is None:
        target = max(1, math.ceil(split_waves * num_sms(device) / max(1, batch * num_kv_heads)))
        pages_per_split = max(1, math.ceil(width / target))
    return int(pages_per_split), triton.cdiv(width, int(pages_per_split))


def default_fused_pages_per_iter(page_size: int, head_dim: int, sources: int) -> int:
    elems = FUSED_STEP_ELEMS if sources == 2 else LITE_STEP_ELEMS
    return max(1, min(4, elems // (page_size * head_dim)))


def fusedkv_decode_attention(
    q: torch.Tensor, k_pages: tuple, v_pages: tuple, block_table: torch.Tensor, seq_lens: torch.Tensor,
    weights: Optional[torch.Tensor] = None, sm_scale: Optional[float] = None, split_plan=None,
    even_splits: bool = False, pages_per_iter: Optional[int] = None, out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """q [B, Hq, D] (one query per request, at position seq_lens[b] - 1) -> o [B, Hq, D].

    seq_lens int32 [B]: keys per request (the query's own included, stored by the source layers).
    split_plan: plan_fusedkv_splits(...) reused across layers; even_splits: each request spreads
    its own pages over the S splits (a fixed plan for CUDA graphs, as paged_fp16_pool_decode).
    No host sync: the plan comes from block_table.shape[1]."""
    k0, k1, v0, v1, w, sources = _check_sources(q, k_pages, v_pages, weights, block_table, seq_lens)
    B, Hq, D = q.shape
    _, Hkv, PAGE, _ = k0.shape
    assert block_table.shape[0] == seq_lens.shape[0] == B
    sm_scale = 1.0 / math.sqrt(D) if sm_scale is None else sm_scale
    if split_plan is None:
        split_plan = plan_fusedkv_splits(block_table.shape[1], B, Hkv, q.device)
    pps, S = split_plan
    ppi = pages_per_iter or default_fused_pages_per_iter(PAGE, D, sources)
    assert ppi & (ppi - 1) == 0, ppi
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(-1) == 1
    if B == 0:
        return out
    direct = S == 1
    o_part, lse_part = split_outputs(out, S)
    kv_group = Hq // Hkv
    _fusedkv_decode_kernel[(B * Hkv, S)](
        q, o_part, lse_part, k0, k1, v0, v1, w, block_table, seq_lens,
        q.stride(0), q.stride(1), block_table.stride(0), k0.stride(0), k0.stride(1), Hkv * D,
        o_part.stride(0), o_part.stride(1), o_part.stride(2), lse_part.stride(0), lse_part.stride(1),
        pps, S, sm_scale * LOG2E,
        NUM_KV_HEADS=Hkv, KV_GROUP=kv_group, BLOCK_G=max(16, next_pow2(kv_group)), HEAD_DIM=D, PAGE=PAGE,
        PAGES_PER_ITER=ppi, SOURCES=sources, EVEN_SPLITS=even_splits, DIRECT=direct,
        DOT_F32=is_interpret() and q.dtype == torch.bfloat16, num_warps=4, num_stages=2,
    )
    if not direct:
        merge_splits(o_part, lse_part, out)
    return out


def fusedkv_extend_attention(
    q: torch.Tensor, qo_indptr: torch.Tensor, k_pages: tuple, v_pages: tuple, block_table: torch.Tensor,
    kv_lens: torch.Tensor, weights: Optional[torch.Tensor] = None, sm_scale: Optional[float] = None,
    max_q_len: Optional[int] = None, out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """q [N, Hq, D]: request b's rows qo_indptr[b]:qo_indptr[b+1] are the LAST tokens of its
    kv_lens[b] keys (module doc), all already in the source pages -> o [N, Hq, D].
    Pass max_q_len (host int) to avoid a host sync."""
    k0, k1, v0, v1, w, sources = _check_sources(q, k_pages, v_pages, weights, block_table, kv_lens)
    N, Hq, D = q.shape
    _, Hkv, PAGE, _ = k0.shape
    assert qo_indptr.dtype == torch.int32 and qo_indptr.is_contiguous()
    B = qo_indptr.shape[0] - 1
    assert block_table.shape[0] == kv_lens.shape[0] == B
    if max_q_len is None:  # host sync
        max_q_len = int((qo_indptr[1:] - qo_indptr[:-1]).max()) if B > 0 else 0
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.stride(-1) == 1
    if N == 0 or max_q_len == 0:
        return out
    sm_scale = 1.0 / math.sqrt(D) if sm_scale is None else sm_scale
    kv_group = Hq // Hkv
    block_g = next_pow2(kv_group)

    def grid(meta):
        return (B, Hkv, triton.cdiv(max_q_len, max(1, meta["BLOCK_ROWS"] // block_g)))

    assert block_g <= 16, "kv groups above 16 need BLOCK_ROWS > 32 (not configured)"
    _fusedkv_extend_kernel[grid](
        q, out, qo_indptr, k0, k1, v0, v1, w, block_table, kv_lens,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_table.stride(0),
        k0.stride(0), k0.stride(1), Hkv * D, sm_scale * LOG2E,
        KV_GROUP=kv_group, BLOCK_G=block_g, HEAD_DIM=D, PAGE=PAGE, SOURCES=sources,
        DOT_F32=is_interpret() and q.dtype == torch.bfloat16,
    )
    return out


# ---- torch reference ----------------------------------------------------------------------
def gather_pages(buf: torch.Tensor, pages: torch.Tensor, n: int) -> torch.Tensor:
    """[num_pages + 2, Hkv, PAGE, D] + page ids -> one request's first n tokens [n, Hkv, D]."""
    PAGE = buf.shape[2]
    sel = buf[pages[: -(-n // PAGE)].long()]  # [np, Hkv, PAGE, D]
    return sel.permute(0, 2, 1, 3).reshape(-1, buf.shape[1], buf.shape[3])[:n]


def fusedkv_attention_reference(q, qo_indptr, k_pages, v_pages, block_table, kv_lens, weights=None,
                                sm_scale=None) -> torch.Tensor:
    """Torch reference of both launchers (decode: qo_indptr = arange(B + 1)): gather the
    sources, fuse with reference.fuse_kv (or select, Lite), causal over the query suffix,
    softmax and PV in fp32."""
    from .reference import fuse_kv

    N, Hq, D = q.shape
    sm_scale = 1.0 / math.sqrt(D) if sm_scale is None else sm_scale
    group = Hq // k_pages[0].shape[1]
    out = torch.zeros_like(q, dtype=torch.float32)
    for b in range(qo_indptr.shape[0] - 1):
        lo, hi, n = int(qo_indptr[b]), int(qo_indptr[b + 1]), int(kv_lens[b])
        if hi == lo or n == 0:
            continue
        ks = [gather_pages(t, block_table[b], n) for t in k_pages]
        vs = [gather_pages(t, block_table[b], n) for t in v_pages]
        if len(ks) == 2:
            k, v = fuse_kv(ks[0], ks[1], vs[0], vs[1], weights[:2], weights[2:])
        else:
            k, v = ks[0], vs[0]
        k = k.float().repeat_interleave(group, dim=1)
        v = v.float().repeat_interleave(group, dim=1)
        s = torch.einsum("ihd,jhd->hij", q[lo:hi].float(), k) * sm_scale
        pos = torch.arange(n - (hi - lo), n, device=q.device)
        s = s.masked_fill(torch.arange(n, device=q.device)[None, None, :] > pos[None, :, None], float("-inf"))
        out[lo:hi] = torch.einsum("hij,jhd->ihd", s.softmax(-1), v)
    return out.to(q.dtype)
