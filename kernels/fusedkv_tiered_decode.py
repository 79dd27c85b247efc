"""FusedKV decode for reconstruction layers over the tiered pool (TieredKVPool), one launch a layer.

    fusedkv_tiered_decode(q, stores, k_layers, v_layers, slots, seq_lens, weights=None, ...) -> o
    fusedkv_tiered_decode_reference(q, stores, k_layers, v_layers, slots, seq_lens, weights=None, ...)

The paged fp16 kernel (fusedkv_attention.py) fuses two source layers' K/V per page in registers;
this one does the same over the tiered id space (tiered_gather.py): each step takes TILE key
positions of request b, reads their ids from its req-to-token row `slots` [B, W], loads every
source's K and V from the store each id is in (fp16 row, int8 or int4 page-head block),
dequantizes, fuses and runs one online-softmax step:

    FusedKV  (two layers):  K = a0 * K_s0 + a1 * K_s1,   V = b0 * V_s0 + b1 * V_s1
    Lite     (one each):    K = K_s1,                    V = V_s0

Numerics follow the torch path (TieredKVPool.get_kv + reference.fuse_kv): each dequantized value
rounded to the pool dtype, fp32 products and sum, one rounding to the pool dtype. Id 0 (a
dropped token, or a position past the row) is masked out. `stores` is a TieredStores of the pool's
stacked tensors (every layer in one tensor per store: TieredKVPool.stacked_rows / stacked_store),
so the layer ids are kernel arguments. Grid (B * Hkv, S), split-K over tiles with the LSE merge of
_split_k.py (S == 1 writes o directly); `even_splits` gives a graph-safe fixed plan.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from ._split_k import LOG2E, _softmax_step, _store_split_result, merge_splits, split_outputs
from ._tiles import is_interpret, next_pow2
from .fusedkv_attention import _load_weights, plan_fusedkv_splits
from .paged_fp16_pool_decode import _split_pages
from .paged_layout import TierPages
from .reference import fuse_kv
from .tiered_gather import _tier_values

TILE = 32  # key positions per step: four [TILE, D] source tiles live at once for FusedKV


@dataclass(frozen=True)
class TieredLaunch:
    """Launch shape of the kernel: key positions per loop step, warps, pipeline stages, and
    stage-1 programs per SM for the split plan (None: fusedkv_attention's default).
    benchmarks/kernels/fusedkv_tiered.py sweeps them."""
    tile: int = TILE
    num_warps: int = 4
    num_stages: int = 2
    split_waves: Optional[int] = None

    def __post_init__(self):
        if self.tile < 16 or self.tile & (self.tile - 1):
            raise ValueError(f"tile must be a power of two >= 16, got {self.tile}")
        if self.num_warps not in (1, 2, 4, 8, 16) or self.num_stages < 1:
            raise ValueError(f"num_warps must be 1/2/4/8/16 and num_stages >= 1, got {self.num_warps}, {self.num_stages}")
        if self.split_waves is not None and self.split_waves < 1:
            raise ValueError(f"split_waves must be >= 1, got {self.split_waves}")


DEFAULT_LAUNCH = TieredLaunch()


@dataclass(frozen=True)
class TieredStores:
    """A tiered pool's stacked stores (module docstring). rows_k / rows_v [L, rows, Hkv, D];
    int8 / int4 TierPages of L * pages8 / L * pages4 page-head blocks, None when empty."""
    rows_k: torch.Tensor
    rows_v: torch.Tensor
    int8: Optional[TierPages]
    int4: Optional[TierPages]
    pages8: int
    pages4: int
    base8: int
    base4: int
    group_size: int


# the source layer ids are plain runtime ints (not specialized on 1): one binary for every layer
# pair, and they can be widened to int64 in the kernel
@triton.jit(do_not_specialize=["ka", "kb", "va", "vb"])
def _fusedkv_tiered_decode_kernel(
    q_ptr, o_part_ptr, lse_part_ptr, slots_ptr, len_ptr, w_ptr,
    rk_ptr, rv_ptr, k8_ptr, hk8_ptr, v8_ptr, hv8_ptr, k4_ptr, hk4_ptr, v4_ptr, hv4_ptr,
    ka, kb, va, vb, base8, base4, pages8, pages4, width,
    stride_qb, stride_qh, stride_sb, stride_rl, stride_row, stride_rh, stride_p8, stride_h8, stride_p4, stride_h4,
    stride_wt, stride_ob, stride_oh, stride_os, stride_lb, stride_lh, tps, n_split, qk_scale,
    NUM_KV_HEADS: tl.constexpr, KV_GROUP: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, G: tl.constexpr,
    PAGE8: tl.constexpr, PAGE4: tl.constexpr, HAS8: tl.constexpr, HAS4: tl.constexpr, TILE: tl.constexpr,
    SOURCES: tl.constexpr, EVEN_SPLITS: tl.constexpr, DIRECT: tl.constexpr, DOT_F32: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    b = pid_bh // NUM_KV_HEADS
    h = pid_bh % NUM_KV_HEADS
    offs_g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, D)
    gmask = offs_g < KV_GROUP
    q_heads = h * KV_GROUP + offs_g
    q = tl.load(q_ptr + b * stride_qb + q_heads[:, None] * stride_qh + d[None, :], mask=gmask[:, None], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    a0, a1, b0, b1 = _load_weights(w_ptr, stride_wt, h, d, D, SOURCES)
    pool_t = rk_ptr.dtype.element_ty
    # HAZARD: layer * stride_rl (a layer's offset in the stacked fp16 rows) passes 2^31 elements in
    # large pools; int32 layer ids would wrap it
    ka, kb, va, vb = ka.to(tl.int64), kb.to(tl.int64), va.to(tl.int64), vb.to(tl.int64)

    acc = tl.zeros([BLOCK_G, D], dtype=tl.float32)
    m_i = tl.full([BLOCK_G], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    n_tok = tl.load(len_ptr + b)
    t_lo, t_hi = _split_pages(split, n_tok, tps, n_split, TILE, EVEN_SPLITS)
    offs = tl.arange(0, TILE)
    for t in range(t_lo, t_hi):
        pos = t * TILE + offs
        live = (pos < n_tok) & (pos < width)
        ids = tl.load(slots_ptr + b * stride_sb + pos, mask=live, other=0).to(tl.int64)
        live = live & (ids != 0)
        k = _tier_values(rk_ptr, k8_ptr, hk8_ptr, k4_ptr, hk4_ptr, ka, ids, live, base8, base4, h, d,
                         stride_rl, stride_row, stride_rh, pages8, pages4, stride_p8, stride_h8, stride_p4, stride_h4,
                         D, G, PAGE8, PAGE4, HAS8, HAS4, False).to(pool_t)
        v = _tier_values(rv_ptr, v8_ptr, hv8_ptr, v4_ptr, hv4_ptr, va, ids, live, base8, base4, h, d,
                         stride_rl, stride_row, stride_rh, pages8, pages4, stride_p8, stride_h8, stride_p4, stride_h4,
                         D, G, PAGE8, PAGE4, HAS8, HAS4, True).to(pool_t)
        if SOURCES == 2:
            k1 = _tier_values(rk_ptr, k8_ptr, hk8_ptr, k4_ptr, hk4_ptr, kb, ids, live, base8, base4, h, d,
                              stride_rl, stride_row, stride_rh, pages8, pages4, stride_p8, stride_h8, stride_p4,
                              stride_h4, D, G, PAGE8, PAGE4, HAS8, HAS4, False).to(pool_t)
            v1 = _tier_values(rv_ptr, v8_ptr, hv8_ptr, v4_ptr, hv4_ptr, vb, ids, live, base8, base4, h, d,
                              stride_rl, stride_row, stride_rh, pages8, pages4, stride_p8, stride_h8, stride_p4,
                              stride_h4, D, G, PAGE8, PAGE4, HAS8, HAS4, True).to(pool_t)
            k = (a0[None, :] * k.to(tl.float32) + a1[None, :] * k1.to(tl.float32)).to(pool_t)
            v = (b0[None, :] * v.to(tl.float32) + b1[None, :] * v1.to(tl.float32)).to(pool_t)
        if DOT_F32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        acc, m_i, l_i = _softmax_step(acc, m_i, l_i, q, k, v, live, qk_scale)

    _store_split_result(acc, m_i, l_i, o_part_ptr, lse_part_ptr, b, split, q_heads, d, gmask,
                        stride_ob, stride_oh, stride_os, stride_lb, stride_lh, DIRECT)


def _check(q, stores: TieredStores, k_layers, v_layers, slots, seq_lens, weights):
    assert len(k_layers) == len(v_layers) and len(k_layers) in (1, 2), "1 (Lite) or 2 (FusedKV) source layers"
    L, rows, Hkv, D = stores.rows_k.shape
    assert stores.rows_v.shape == stores.rows_k.shape and stores.rows_v.stride() == stores.rows_k.stride()
    assert stores.rows_k.stride(3) == 1 and rows <= stores.base8 <= stores.base4
    assert all(0 <= l < L for l in (*k_layers, *v_layers)), (k_layers, v_layers, L)
    for store, pages in ((stores.int8, stores.pages8), (stores.int4, stores.pages4)):
        if store is not None:
            assert store.k.is_contiguous() and store.v.is_contiguous() and store.k.stride() == store.v.stride()
            assert store.num_pages == L * pages and store.head_dim == D and store.group_size == stores.group_size
            assert (store.page * store.width) % 2 == 0
    assert q.dtype == stores.rows_k.dtype and q.shape[-1] == D and q.stride(-1) == 1 and q.shape[1] % Hkv == 0
    assert D >= 16 and D & (D - 1) == 0, "head_dim must be a power of two >= 16"
    assert slots.dtype == torch.int64 and slots.dim() == 2 and slots.stride(-1) == 1, "slots: int64 [B, W]"
    assert seq_lens.dtype == torch.int32 and seq_lens.is_contiguous() and seq_lens.shape[0] == slots.shape[0] == q.shape[0]
    if len(k_layers) == 2:
        assert weights is not None and weights.dtype == torch.float32 and weights.shape == (4, Hkv, D) \
            and weights.is_contiguous(), "FusedKV needs float32 [4, Hkv, D] weights (pack_fusion_weights)"
    else:
        assert weights is None, "Lite takes no weights"


def plan_tiered_splits(width: int, batch: int, num_kv_heads: int, device,
                       launch: TieredLaunch = DEFAULT_LAUNCH) -> tuple[int, int]:
    """-> (tiles of launch.tile per split, S) from the slot rows' width alone (no sync)."""
    waves = {} if launch.split_waves is None else {"split_waves": launch.split_waves}
    return plan_fusedkv_splits(triton.cdiv(max(1, width), launch.tile), batch, num_kv_heads, device, **waves)


def fusedkv_tiered_decode(q: torch.Tensor, stores: TieredStores, k_layers: tuple, v_layers: tuple,
                          slots: torch.Tensor, seq_lens: torch.Tensor, weights: Optional[torch.Tensor] = None,
                          sm_scale: Optional[float] = None, split_plan=None, even_splits: bool = False,
                          out: Optional[torch.Tensor] = None, launch: TieredLaunch = DEFAULT_LAUNCH) -> torch.Tensor:
    """q [B, Hq, D] (one query per request, at position seq_lens[b] - 1) -> o [B, Hq, D].
    k_layers / v_layers: (s0, s1) for FusedKV, (s1,) / (s0,) for Lite. No host sync.
    split_plan counts tiles of launch.tile (plan_tiered_splits with the same launch)."""
    _check(q, stores, k_layers, v_layers, slots, seq_lens, weights)
    B, Hq, D = q.shape
    Hkv = stores.rows_k.shape[2]
    sm_scale = 1.0 / math.sqrt(D) if sm_scale is None else sm_scale
    if split_plan is None:
        split_plan = plan_tiered_splits(slots.shape[1], B, Hkv, q.device, launch)
    tps, S = split_plan
    # a plan counted in another tile would leave keys past tps * S * tile unread, silently
    assert even_splits or tps * S * launch.tile >= slots.shape[1], \
        f"split_plan {split_plan} covers {tps * S * launch.tile} keys of {slots.shape[1]} at tile {launch.tile}"
    if out is None:
        out = torch.empty_like(q)
    if B == 0:
        return out
    direct = S == 1
    o_part, lse_part = split_outputs(out, S)
    dummy8 = stores.rows_k.new_empty(0, dtype=torch.uint8)
    dummy16 = stores.rows_k.new_empty(0, dtype=torch.float16)
    i8, i4 = stores.int8, stores.int4
    k8, v8 = (i8.k, i8.v) if i8 is not None else (dummy8, dummy8)
    k4, v4 = (i4.k, i4.v) if i4 is not None else (dummy8, dummy8)
    half = lambda x: x.view(torch.float16) if x.numel() else dummy16  # noqa: E731
    ka, kb = k_layers[0], k_layers[-1]
    va, vb = v_layers[0], v_layers[-1]
    w = weights if weights is not None else seq_lens  # Lite: an unused placeholder pointer
    kv_group = Hq // Hkv
    rk = stores.rows_k
    _fusedkv_tiered_decode_kernel[(B * Hkv, S)](
        q, o_part, lse_part, slots, seq_lens, w,
        rk, stores.rows_v, k8, half(k8), v8, half(v8), k4, half(k4), v4, half(v4),
        ka, kb, va, vb, stores.base8, stores.base4, stores.pages8, stores.pages4, slots.shape[1],
        q.stride(0), q.stride(1), slots.stride(0), rk.stride(0), rk.stride(1), rk.stride(2),
        k8.stride(0) if i8 is not None else 0, k8.stride(1) if i8 is not None else 0,
        k4.stride(0) if i4 is not None else 0, k4.stride(1) if i4 is not None else 0,
        Hkv * D, o_part.stride(0), o_part.stride(1), o_part.stride(2), lse_part.stride(0), lse_part.stride(1),
        tps, S, sm_scale * LOG2E,
        NUM_KV_HEADS=Hkv, KV_GROUP=kv_group, BLOCK_G=max(16, next_pow2(kv_group)), D=D, G=stores.group_size,
        PAGE8=i8.page if i8 is not None else 1, PAGE4=i4.page if i4 is not None else 1,
        HAS8=i8 is not None, HAS4=i4 is not None, TILE=launch.tile, SOURCES=len(k_layers), EVEN_SPLITS=even_splits,
        DIRECT=direct, DOT_F32=is_interpret() and q.dtype == torch.bfloat16, num_warps=launch.num_warps,
        num_stages=launch.num_stages,
    )
    if not direct:
        merge_splits(o_part, lse_part, out)
    return out


def fusedkv_tiered_decode_reference(q, stores: TieredStores, k_layers, v_layers, slots, seq_lens, weights=None,
                                    sm_scale=None):
    """Torch: each request's keys read per store (TierPages.read), fused by reference.fuse_kv,
    attended in fp32; ids 0 masked."""
    B, Hq, D = q.shape
    Hkv = stores.rows_k.shape[2]
    sm_scale = 1.0 / math.sqrt(D) if sm_scale is None else sm_scale
    out = torch.zeros_like(q)

    def read(layer, ids, value):
        rows = (stores.rows_v if value else stores.rows_k)[layer]
        x = torch.empty((ids.numel(), Hkv, D), dtype=q.dtype, device=q.device)
        in16 = ids < stores.base8
        x[in16] = rows[ids[in16]].to(q.dtype)
        for store, lo, hi, pages in ((stores.int8, stores.base8, stores.base4, stores.pages8),
                                     (stores.int4, stores.base4, None, stores.pages4)):
            inside = (ids >= lo) if hi is None else (ids >= lo) & (ids < hi)
            if store is None or not bool(inside.any()):
                continue
            r = ids[inside] - lo
            kk, vv = store.read(layer * pages + r // store.page, r % store.page, q.dtype)
            x[inside] = vv if value else kk
        return x

    for b in range(B):
        ids = slots[b, : int(seq_lens[b])]
        ids = ids[ids != 0]
        if ids.numel() == 0:
            continue
        if len(k_layers) == 2:
            k, v = fuse_kv(read(k_layers[0], ids, False), read(k_layers[1], ids, False),
                           read(v_layers[0], ids, True), read(v_layers[1], ids, True), weights[:2], weights[2:])
        else:
            k, v = read(k_layers[0], ids, False), read(v_layers[0], ids, True)
        kk = k.float().repeat_interleave(Hq // Hkv, dim=1)  # [n, Hq, D]
        vv = v.float().repeat_interleave(Hq // Hkv, dim=1)
        s = torch.einsum("hd,nhd->hn", q[b].float(), kk) * sm_scale
        out[b] = torch.einsum("hn,nhd->hd", torch.softmax(s, -1), vv).to(q.dtype)
    return out
