"""Fused RoPE + paged KV store: the fused qkv projection's output straight into attention's
inputs, one launch per layer.

    q_rot, k_rot, v = rope_store_kv(qkv, cos, sin, slots, k_pages, v_pages,
                                     num_q_heads, num_kv_heads, return_kv=...)

qkv      [T, (Hq + 2 Hkv) D]  model dtype, rows = [q heads | k heads | v heads], stride(1) == 1
cos, sin [T, 1, D/2]          model dtype (RotaryEmbedding.cos_sin)
slots    int64 [T]            KV slot of each token (out_cache_loc): page slot // PAGE, row slot % PAGE
k_pages, v_pages [num_pages, Hkv, PAGE, D]  one layer of PagedFp16KVPool (contiguous)
-> q_rot [T, Hq, D] new contiguous; with return_kv also k_rot and v [T, Hkv, D] (extend attention
   reads the new tokens from them), else None, None (decode reads them back from the pool).

It replaces, per layer: the RoPE kernel (or ~12 torch ops), v's .contiguous() copy, the page /
offset arithmetic and two index_put kernels. grid = (cdiv(T, BLOCK_T), Hq + Hkv): program
(i, h) takes BLOCK_T tokens of q head h (h < Hq), or of k head h - Hq together with v head h - Hq.

Rounding: `apply_rope`'s torch order (each product rounded to the model dtype, then the add/sub
rounded), as `fused_rope.py` (its docstring). Under the interpreter the result is bitwise torch's;
compiled for a GPU, the compiler may contract the ops (it was ~1 ulp off on an H200), within
the product-rounding bound the tests check. V is copied bit for bit.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_store_kernel(
    qkv_ptr, cos_ptr, sin_ptr, slot_ptr, kp_ptr, vp_ptr, qo_ptr, ko_ptr, vo_ptr,
    T, stride_t, stride_ct, stride_st,
    HQ: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_T: tl.constexpr, RETURN_KV: tl.constexpr,
):
    D: tl.constexpr = 2 * HALF
    h = tl.program_id(1)
    offs_t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    tmask = offs_t < T
    mask = tmask[:, None] & (offs_d[None, :] < HALF)
    c = tl.load(cos_ptr + offs_t[:, None] * stride_ct + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + offs_t[:, None] * stride_st + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    src = qkv_ptr + offs_t[:, None] * stride_t + h * D + offs_d[None, :]  # head h of [q | k] columns
    x1 = tl.load(src, mask=mask, other=0.0)
    x2 = tl.load(src + HALF, mask=mask, other=0.0)
    dt = x1.dtype
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    # each product rounded to the model dtype, then the add/sub rounded (torch's op order)
    lo = ((x1 * c).to(dt).to(tl.float32) - (x2 * s).to(dt).to(tl.float32)).to(dt)
    hi = ((x2 * c).to(dt).to(tl.float32) + (x1 * s).to(dt).to(tl.float32)).to(dt)
    if h < HQ:
        dst = qo_ptr + (offs_t[:, None] * HQ + h) * D + offs_d[None, :]
        tl.store(dst, lo, mask=mask)
        tl.store(dst + HALF, hi, mask=mask)
    else:
        kh = h - HQ
        slot = tl.load(slot_ptr + offs_t, mask=tmask, other=0)
        row = ((slot // PAGE) * HKV + kh) * PAGE + slot % PAGE  # [page, head, offset] row of D
        dst = kp_ptr + row[:, None] * D + offs_d[None, :]
        tl.store(dst, lo, mask=mask)
        tl.store(dst + HALF, hi, mask=mask)
        vsrc = src + HKV * D  # v head kh sits HKV heads after k head kh
        v1 = tl.load(vsrc, mask=mask, other=0.0)
        v2 = tl.load(vsrc + HALF, mask=mask, other=0.0)
        vdst = vp_ptr + row[:, None] * D + offs_d[None, :]
        tl.store(vdst, v1, mask=mask)
        tl.store(vdst + HALF, v2, mask=mask)
        if RETURN_KV:
            out = (offs_t[:, None] * HKV + kh) * D + offs_d[None, :]
            tl.store(ko_ptr + out, lo, mask=mask)
            tl.store(ko_ptr + out + HALF, hi, mask=mask)
            tl.store(vo_ptr + out, v1, mask=mask)
            tl.store(vo_ptr + out + HALF, v2, mask=mask)


def rope_store_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
                  k_pages: torch.Tensor, v_pages: torch.Tensor, num_q_heads: int, num_kv_heads: int,
                  return_kv: bool = False):
    """See the module doc. No host sync; shapes come from the inputs: CUDA-graph capturable."""
    T = qkv.shape[0]
    HQ, HKV = num_q_heads, num_kv_heads
    npages, hkv_pool, PAGE, D = k_pages.shape
    assert qkv.dim() == 2 and qkv.shape[1] == (HQ + 2 * HKV) * D and qkv.stride(1) == 1, (qkv.shape, D)
    assert qkv.dtype in (torch.float16, torch.bfloat16) and D % 2 == 0
    assert hkv_pool == HKV and v_pages.shape == k_pages.shape
    assert k_pages.dtype == v_pages.dtype == qkv.dtype, (k_pages.dtype, qkv.dtype)
    assert k_pages.is_contiguous() and v_pages.is_contiguous()
    assert slots.shape == (T,) and slots.dtype == torch.int64
    half = D // 2
    for c in (cos, sin):
        assert c.shape == (T, 1, half) and c.dtype == qkv.dtype and c.stride(2) == 1, (c.shape, c.dtype)
    q_out = torch.empty((T, HQ, D), dtype=qkv.dtype, device=qkv.device)
    k_out = v_out = None
    if return_kv:
        k_out = torch.empty((T, HKV, D), dtype=qkv.dtype, device=qkv.device)
        v_out = torch.empty_like(k_out)
    if T > 0:
        block_d = triton.next_power_of_2(half)
        # decode-sized T: small token blocks, so the grid still spreads over the SMs
        block_t = max(1, min(64 if T > 1024 else 16, 4096 // block_d, triton.next_power_of_2(T)))
        _rope_store_kernel[(triton.cdiv(T, block_t), HQ + HKV)](
            qkv, cos, sin, slots, k_pages, v_pages, q_out,
            k_out if return_kv else q_out, v_out if return_kv else q_out,  # unused when not RETURN_KV
            T, qkv.stride(0), cos.stride(0), sin.stride(0),
            HQ=HQ, HKV=HKV, HALF=half, BLOCK_D=block_d, PAGE=PAGE, BLOCK_T=block_t,
            RETURN_KV=return_kv, num_warps=4 if block_t * block_d >= 1024 else 1,
        )
    return q_out, k_out, v_out


def rope_store_kv_reference(qkv, cos, sin, slots, k_pages, v_pages, num_q_heads, num_kv_heads,
                            return_kv=False):
    """Torch reference: split, `apply_rope` on q and k, then the paged pool's indexed stores."""
    from .reference import apply_rope

    T, D = qkv.shape[0], k_pages.shape[-1]
    PAGE = k_pages.shape[2]
    q, k, v = qkv.split([num_q_heads * D, num_kv_heads * D, num_kv_heads * D], dim=-1)
    q = apply_rope(q.view(T, num_q_heads, D), cos, sin)
    k = apply_rope(k.view(T, num_kv_heads, D), cos, sin)
    v = v.reshape(T, num_kv_heads, D).contiguous()
    page, off = slots // PAGE, slots % PAGE
    k_pages[page, :, off] = k
    v_pages[page, :, off] = v
    return (q, k, v) if return_kv else (q, None, None)
