"""Fused RoPE + paged KV store (kernels/rope_store.py) vs its torch reference.

Interpreter (CPU): fp16, bitwise (q, the pool's K and V, the returned k/v). bf16 only on GPU
(the interpreter truncates fp32 -> bf16). GPU: q and K within rope_rounding_bound, V bitwise.
Every case also checks that pool rows outside the written slots are untouched.
"""
import pytest
import torch

from sgl_kvxfer.kernels import rope_store as mod
from sgl_kvxfer.kernels.testing import assert_rope_close

DTYPES = [torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)]


def _case(T, Hq, Hkv, D, page, dtype, device, seed=0):
    from sgl_kvxfer.layers.rope import RotaryEmbedding

    g = torch.Generator().manual_seed(seed * 1000 + T * 10 + Hq)
    # a wider buffer, so qkv rows are strided like a sliced projection output
    qkv = (torch.randn(T, (Hq + 2 * Hkv) * D + 8, generator=g) * 2).to(dtype).to(device)[:, : (Hq + 2 * Hkv) * D]
    pos = torch.randint(0, 5000, (T,), generator=g).to(device)
    cos, sin = RotaryEmbedding(D, 10000.0, None, 8192).cos_sin(pos, dtype, 5000)
    num_pages = max(4, 2 * T // page + 2)
    # distinct slots on pages >= 1, in scrambled order (page 0 is the pool's padding)
    slots = (torch.randperm((num_pages - 1) * page, generator=g)[:T] + page).to(device)
    pages = (torch.randn(num_pages, Hkv, page, D, generator=g)).to(dtype).to(device)
    return qkv, cos, sin, slots, pages


def _check(T, Hq, Hkv, D, page, dtype, device, return_kv):
    qkv, cos, sin, slots, pages = _case(T, Hq, Hkv, D, page, dtype, device)
    kp, vp = pages.clone(), (pages * 0.5).clone()
    rkp, rvp = kp.clone(), vp.clone()
    q, k, v = mod.rope_store_kv(qkv, cos, sin, slots, kp, vp, Hq, Hkv, return_kv=return_kv)
    rq, rk, rv = mod.rope_store_kv_reference(qkv, cos, sin, slots, rkp, rvp, Hq, Hkv, return_kv=True)
    assert q.shape == (T, Hq, D) and q.is_contiguous()
    assert (k is None and v is None) != return_kv
    page_of, off = slots // page, slots % page
    written = torch.zeros(kp.shape[0], page, dtype=torch.bool, device=kp.device)
    written[page_of, off] = True
    untouched = ~written
    assert torch.equal(kp.permute(0, 2, 1, 3)[untouched], rkp.permute(0, 2, 1, 3)[untouched])
    assert torch.equal(vp, rvp), "V is a plain copy: bitwise everywhere"
    got_k = kp[page_of, :, off]
    assert_rope_close(q, rq, qkv[:, : Hq * D].view(T, Hq, D), cos, sin)
    assert_rope_close(got_k, rk, qkv[:, Hq * D : (Hq + Hkv) * D].view(T, Hkv, D), cos, sin)
    if return_kv:
        assert torch.equal(k, got_k) and torch.equal(v, rv)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("return_kv", [False, True])
@pytest.mark.parametrize("T,Hq,Hkv,D,page", [(1, 4, 2, 16, 16), (7, 4, 2, 16, 16), (21, 9, 3, 64, 16),
                                             (5, 4, 4, 24, 32), (9, 4, 2, 32, 1)])  # page 1: the tiered pool's fp16 rows
def test_rope_store_small(T, Hq, Hkv, D, page, dtype, return_kv, device):
    _check(T, Hq, Hkv, D, page, dtype, device, return_kv)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("T,Hq,Hkv,D", [(256, 9, 3, 64), (3000, 9, 3, 64), (128, 32, 8, 128), (2500, 32, 8, 128)])
def test_rope_store_real_shapes(T, Hq, Hkv, D, dtype, device):
    _check(T, Hq, Hkv, D, 16, dtype, device, return_kv=T > 1000)


def test_rope_store_rejects_wrong_pool_dtype(device):
    qkv, cos, sin, slots, pages = _case(3, 4, 2, 16, 16, torch.float16, device)
    with pytest.raises(AssertionError):
        mod.rope_store_kv(qkv, cos, sin, slots, pages.float(), pages.float(), 4, 2)
