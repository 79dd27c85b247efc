"""Extend (chunked prefill / radix-hit) attention over a tiered cached prefix + new tokens.

    extend_attention_tiered(q, k_new, v_new, qo_indptr, layer, prefix_tables,
                            sm_scale=None, max_extend_len=None) -> o

q            [N, Hq, D]  new query tokens of all requests, concatenated (model dtype)
k_new, v_new [N, Hkv, D] the same tokens' K (post-RoPE) / V, attended at full precision
qo_indptr    int32 [B+1] request b owns rows [qo_indptr[b], qo_indptr[b+1])
prefix_tables: TieredBlockTables of the cached PREFIX only (exclude the new tokens even if
             they were already stored into the pool).
o            [N, Hq, D]

New token i of a request sees every prefix token (any tier, order-free) and new tokens
0..i (causal). grid = (B, Hkv, cdiv(max_extend_len, BLOCK_T)); a program takes BLOCK_T new
tokens x the KV_GROUP query heads of one kv-head as the rows of one tile
(row r -> token r // BLOCK_G, head r % BLOCK_G), so each prefix page is read once per
kv-head and query block.

Tiled launch (`tiles=(tile_req, tile_blk)`, CUDA-graph prefill): grid = (len(tile_req), Hkv)
and program t takes block tile_blk[t] of request tile_req[t], at the fixed config
GRAPH_CONFIG (BLOCK_T = graph_block_tokens(kv_group) new tokens per tile; build_tiles lists
them). The grid then depends on the tile buffer's length alone, not on the batch; spare tiles
name a request with no new tokens and return at once.
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import torch
import triton
import triton.language as tl

from ._tiles import is_interpret, next_pow2
from .decode_attention import LOG2E, NEG_BIG, _attend_pages
from .paged_layout import TieredBlockTables, TieredKVLayer, gather_request_kv
from .tuned_launch import TunedLauncher

if is_interpret():
    _EXTEND_CONFIGS = [triton.Config({"BLOCK_ROWS": 16, "BLOCK_N": 16}, num_warps=4, num_stages=1)]
else:
    # NOTE: BLOCK_ROWS < 64 keeps tl.dot on mma.sync. With 64+ rows Triton 3.6 picks wgmma
    # and its TritonGPUOptimizeDotOperands pass crashes on the reshape/join-fed (dequantized)
    # K operand (seen on H200, 2026-11); revisit with a newer Triton or a staged fp16 copy.
    _EXTEND_CONFIGS = [
        triton.Config({"BLOCK_ROWS": r, "BLOCK_N": n}, num_warps=w, num_stages=s)
        for r, n, w, s in ((32, 64, 4, 2), (32, 32, 2, 3), (16, 64, 2, 2), (32, 64, 4, 3))
    ]
# The tiled (graph) launch's config: the host builds tiles for its BLOCK_ROWS, so it is not tuned.
GRAPH_CONFIG = (dict(BLOCK_ROWS=16, BLOCK_N=16, num_warps=4, num_stages=1) if is_interpret()
                else dict(BLOCK_ROWS=32, BLOCK_N=64, num_warps=4, num_stages=2))


def graph_block_tokens(kv_group: int) -> int:
    """New tokens per tile of the tiled launch (GRAPH_CONFIG rows over next_pow2(kv_group) heads)."""
    return max(1, GRAPH_CONFIG["BLOCK_ROWS"] // next_pow2(kv_group))


def max_tiles(num_tokens: int, num_reqs: int, block_tokens: int) -> int:
    """Tiles any batch of <= num_tokens new tokens over <= num_reqs requests needs: each request
    has at most one partial tile."""
    return -(-num_tokens // block_tokens) + num_reqs


def build_tiles(extend_lens, block_tokens: int, num_tiles: int, spare_req: int):
    """(tile_req, tile_blk) int32 numpy arrays of length num_tiles: every block of every request,
    deepest blocks first (a block's causal work grows with its index, so the long ones start
    first), then spare tiles (spare_req, 0), where spare_req must have no new tokens."""
    import numpy as np

    lens = np.asarray(extend_lens, dtype=np.int64)
    per_req = -(-lens // block_tokens)
    total = int(per_req.sum())
    assert total <= num_tiles, (total, num_tiles)
    req = np.repeat(np.arange(len(lens), dtype=np.int32), per_req)
    first = np.repeat(np.cumsum(per_req) - per_req, per_req)
    blk = (np.arange(total) - first).astype(np.int32)
    order = np.argsort(-blk, kind="stable")
    tile_req = np.full(num_tiles, spare_req, dtype=np.int32)
    tile_blk = np.zeros(num_tiles, dtype=np.int32)
    tile_req[:total], tile_blk[:total] = req[order], blk[order]
    return tile_req, tile_blk


@triton.autotune(configs=_EXTEND_CONFIGS, key=["HEAD_DIM", "PAGE", "BLOCK_G", "GROUP_SIZE"])
@triton.jit
def _extend_tiered_kernel(
    q_ptr, kn_ptr, vn_ptr, o_ptr, qo_indptr_ptr, tile_req_ptr, tile_blk_ptr,
    k16_ptr, v16_ptr,
    k8_ptr, v8_ptr, k8s_ptr, k8z_ptr, v8s_ptr, v8z_ptr,
    k4_ptr, v4_ptr, k4s_ptr, k4z_ptr, v4s_ptr, v4z_ptr,
    bt16_ptr, bt8_ptr, bt4_ptr, len16_ptr, len8_ptr, len4_ptr,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_on, stride_oh,
    stride_bt16, stride_bt8, stride_bt4,
    stride_p16, stride_h16, stride_p8, stride_h8, stride_p4, stride_h4,
    stride_sp8, stride_sh8, stride_sp4, stride_sh4,
    qk_scale,
    KV_GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr, GROUP_SIZE: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_ROWS: tl.constexpr, BLOCK_N: tl.constexpr, TILED: tl.constexpr,
):
    if TILED:
        tile = tl.program_id(0)
        b = tl.load(tile_req_ptr + tile)
        blk = tl.load(tile_blk_ptr + tile)
    else:
        b = tl.program_id(0)
        blk = tl.program_id(2)
    kv_head = tl.program_id(1)
    BLOCK_T: tl.constexpr = BLOCK_ROWS // BLOCK_G  # new tokens per program
    q_start = tl.load(qo_indptr_ptr + b)
    n_new = tl.load(qo_indptr_ptr + b + 1) - q_start
    if blk * BLOCK_T >= n_new:
        return

    offs_r = tl.arange(0, BLOCK_ROWS)
    offs_d = tl.arange(0, HEAD_DIM)
    tok = blk * BLOCK_T + offs_r // BLOCK_G  # index among the request's new tokens
    g = offs_r % BLOCK_G
    rmask = (tok < n_new) & (g < KV_GROUP)
    head = kv_head * KV_GROUP + g
    row_q = (q_start + tok).to(tl.int64) * stride_qn + head * stride_qh
    q = tl.load(q_ptr + row_q[:, None] + offs_d[None, :], mask=rmask[:, None], other=0.0)

    acc = tl.zeros([BLOCK_ROWS, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([BLOCK_ROWS], NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_ROWS], dtype=tl.float32)

    # ---- cached prefix: every tier, every page (non-causal: all precede the new tokens)
    n16 = tl.load(len16_ptr + b)
    acc, m_i, l_i = _attend_pages(
        acc, m_i, l_i, q, bt16_ptr + b * stride_bt16, n16, 0, tl.cdiv(n16, PAGE),
        k16_ptr, v16_ptr, k16_ptr, k16_ptr, k16_ptr, k16_ptr,
        stride_p16, stride_h16, 0, 0, kv_head, qk_scale, 0, PAGE, HEAD_DIM, GROUP_SIZE, False, False)
    n8 = tl.load(len8_ptr + b)
    acc, m_i, l_i = _attend_pages(
        acc, m_i, l_i, q, bt8_ptr + b * stride_bt8, n8, 0, tl.cdiv(n8, PAGE),
        k8_ptr, v8_ptr, k8s_ptr, k8z_ptr, v8s_ptr, v8z_ptr,
        stride_p8, stride_h8, stride_sp8, stride_sh8, kv_head, qk_scale, 1, PAGE, HEAD_DIM,
        GROUP_SIZE, True, True)
    n4 = tl.load(len4_ptr + b)
    acc, m_i, l_i = _attend_pages(
        acc, m_i, l_i, q, bt4_ptr + b * stride_bt4, n4, 0, tl.cdiv(n4, PAGE),
        k4_ptr, v4_ptr, k4s_ptr, k4z_ptr, v4s_ptr, v4z_ptr,
        stride_p4, stride_h4, stride_sp4, stride_sh4, kv_head, qk_scale, 2, PAGE, HEAD_DIM,
        GROUP_SIZE, True, True)

    # ---- new tokens, causal: row token i sees new tokens j <= i
    offs_n = tl.arange(0, BLOCK_N)
    n_hi = tl.minimum(n_new, (blk + 1) * BLOCK_T)
    for j0 in range(0, n_hi, BLOCK_N):
        j = j0 + offs_n
        jmask = j < n_new
        row_k = (q_start + j).to(tl.int64) * stride_kn + kv_head * stride_kh
        k = tl.load(kn_ptr + row_k[:, None] + offs_d[None, :], mask=jmask[:, None], other=0.0)
        v = tl.load(vn_ptr + row_k[:, None] + offs_d[None, :], mask=jmask[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        s = tl.where(jmask[None, :] & (j[None, :] <= tok[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        pr = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(pr, 1)
        acc = acc * alpha[:, None] + tl.dot(pr.to(v.dtype), v)
        m_i = m_new

    o = acc / l_i[:, None]
    row_o = (q_start + tok).to(tl.int64) * stride_on + head * stride_oh
    tl.store(o_ptr + row_o[:, None] + offs_d[None, :], o.to(o_ptr.dtype.element_ty),
             mask=rmask[:, None])


def extend_attention_tiered(
    q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, qo_indptr: torch.Tensor,
    layer: TieredKVLayer, prefix_tables: TieredBlockTables, sm_scale: Optional[float] = None,
    max_extend_len: Optional[int] = None, out: Optional[torch.Tensor] = None, check: bool = True,
    tiles: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
) -> torch.Tensor:
    """check=False skips the layout checks of `layer` and `prefix_tables` (callers that
    checked them once, e.g. an attention backend running many layers over one batch).
    tiles: (tile_req, tile_blk) int32 device tensors from build_tiles: the tiled launch (module
    doc), which reads no host value of the batch (max_extend_len is then unused)."""
    if check:
        layer.check()
    N, Hq, D = q.shape
    Hkv, PAGE = layer.num_kv_heads, layer.page_size
    assert q.dtype == k_new.dtype == v_new.dtype == layer.dtype and D == layer.head_dim
    assert k_new.shape == v_new.shape == (N, Hkv, D), (k_new.shape, (N, Hkv, D))
    assert q.stride(-1) == 1 and k_new.stride(-1) == 1 and v_new.stride() == k_new.stride()
    assert Hq % Hkv == 0 and PAGE >= 16 and D & (D - 1) == 0
    assert qo_indptr.dtype == torch.int32 and qo_indptr.is_contiguous()
    B = qo_indptr.shape[0] - 1
    if check:
        prefix_tables.check(PAGE)
    assert prefix_tables.batch_size == B
    if max_extend_len is None and tiles is None:  # host sync; pass it in from the scheduler to avoid one
        max_extend_len = int((qo_indptr[1:] - qo_indptr[:-1]).max()) if B > 0 else 0
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.stride(-1) == 1
    if N == 0 or (tiles is None and max_extend_len == 0):
        return out
    sm_scale = 1.0 / math.sqrt(D) if sm_scale is None else sm_scale
    kv_group = Hq // Hkv
    block_g = next_pow2(kv_group)
    f16, i8, i4 = layer.pages
    bt, ln = prefix_tables.tables, prefix_tables.lens

    def grid(meta):
        block_t = max(1, meta["BLOCK_ROWS"] // block_g)
        return (B, Hkv, triton.cdiv(max_extend_len, block_t))

    if tiles is not None:
        assert block_g <= GRAPH_CONFIG["BLOCK_ROWS"], "the tiled launch needs kv_group <= its BLOCK_ROWS"
        assert tiles[0].dtype == tiles[1].dtype == torch.int32 and tiles[0].shape == tiles[1].shape
        launch, tile_args = functools.partial(_launch_tiled, (tiles[0].shape[0], Hkv)), tiles
    else:
        # the autotuner's key: its key arguments and every tensor argument's dtype
        tune_key = (D, PAGE, block_g, layer.group_size, q.dtype, k_new.dtype, out.dtype, qo_indptr.dtype,
                    f16.k.dtype, i8.k.dtype, i8.k_scale.dtype, i8.k_zero.dtype, i4.k.dtype, i4.k_scale.dtype,
                    i4.k_zero.dtype, bt[0].dtype, bt[1].dtype, bt[2].dtype, ln[0].dtype, ln[1].dtype, ln[2].dtype)
        launch, tile_args = functools.partial(_launch_extend, tune_key, grid), (qo_indptr, qo_indptr)
    launch(
        q, k_new, v_new, out, qo_indptr, *tile_args,
        f16.k, f16.v,
        i8.k, i8.v, i8.k_scale, i8.k_zero, i8.v_scale, i8.v_zero,
        i4.k, i4.v, i4.k_scale, i4.k_zero, i4.v_scale, i4.v_zero,
        bt[0], bt[1], bt[2], ln[0], ln[1], ln[2],
        q.stride(0), q.stride(1), k_new.stride(0), k_new.stride(1),
        out.stride(0), out.stride(1),
        bt[0].stride(0), bt[1].stride(0), bt[2].stride(0),
        f16.k.stride(0), f16.k.stride(1), i8.k.stride(0), i8.k.stride(1),
        i4.k.stride(0), i4.k.stride(1),
        i8.k_scale.stride(0), i8.k_scale.stride(1), i4.k_scale.stride(0), i4.k_scale.stride(1),
        sm_scale * LOG2E,
        KV_GROUP=kv_group, BLOCK_G=block_g, HEAD_DIM=D, GROUP_SIZE=layer.group_size, PAGE=PAGE,
        TILED=tiles is not None,
    )
    return out


_launch_extend = TunedLauncher(_extend_tiered_kernel)


def _launch_tiled(grid, *args, **kwargs) -> None:
    """The tiled launch at GRAPH_CONFIG, past the autotuner (its tiles are built for that config)."""
    _extend_tiered_kernel.fn[grid](*args, **kwargs, **GRAPH_CONFIG)


def extend_attention_tiered_reference(q, k_new, v_new, qo_indptr, layer: TieredKVLayer,
                                      prefix_tables: TieredBlockTables, sm_scale=None):
    """Torch reference: dequantized prefix + fp16 new tokens, causal over the new ones, fp32."""
    N, Hq, D = q.shape
    sm_scale = 1.0 / math.sqrt(D) if sm_scale is None else sm_scale
    group = Hq // layer.num_kv_heads
    out = torch.zeros_like(q, dtype=torch.float32)
    for b in range(qo_indptr.shape[0] - 1):
        lo, hi = int(qo_indptr[b]), int(qo_indptr[b + 1])
        if hi == lo:
            continue
        kp, vp = gather_request_kv(layer, prefix_tables, b)
        k = torch.cat([kp, k_new[lo:hi].float()]).repeat_interleave(group, dim=1)
        v = torch.cat([vp, v_new[lo:hi].float()]).repeat_interleave(group, dim=1)
        n_pre, n = kp.shape[0], hi - lo
        s = torch.einsum("ihd,jhd->hij", q[lo:hi].float(), k) * sm_scale
        mask = torch.ones(n, n_pre + n, dtype=torch.bool, device=q.device)
        mask[:, n_pre:] = torch.tril(mask[:, n_pre:])
        s = s.masked_fill(~mask, float("-inf"))
        out[lo:hi] = torch.einsum("hij,jhd->ihd", s.softmax(-1), v)
    return out.to(q.dtype)
