"""TieredBlockTables' filled form: the reference gather reads each listed page's prefix; the
int tiers' page-head blocks (codes, dim-major V, scales behind the codes) through their views."""
import pytest
import torch

from sgl_kvxfer.kernels import tier_codec as tc
from sgl_kvxfer.kernels.paged_layout import (TieredBlockTables, allocate_tiered_layer, block_bytes, gather_request_kv,
                                             int_tier_pages)
from sgl_kvxfer.kernels.testing import fill_random_pools


def _layer(page=4):
    layer = allocate_tiered_layer((6, 6, 6), page, 2, 16, group_size=16, fill=0.0)
    fill_random_pools(layer, seed=0)
    return layer


def _i32(x):
    return torch.tensor(x, dtype=torch.int32)


def test_filled_tables_with_full_fills_match_dense_tables():
    layer = _layer()
    pages = (_i32([[3, 1, 0]]), _i32([[2, 5, 0]]), _i32([[4, 0, 0]]))
    lens = (_i32([7]), _i32([8]), _i32([2]))
    dense = TieredBlockTables(pages, lens)
    fills = (_i32([[4, 3, 0]]), _i32([[4, 4, 0]]), _i32([[2, 0, 0]]))
    filled = TieredBlockTables(pages, lens, fills, (_i32([2]), _i32([2]), _i32([1])))
    for a, b in zip(gather_request_kv(layer, dense, 0), gather_request_kv(layer, filled, 0)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_filled_tables_skip_each_page_tail():
    layer = _layer()
    pages = (_i32([[3, 1]]), _i32([[0, 0]]), _i32([[0, 0]]))
    fills = (_i32([[2, 3]]), _i32([[0, 0]]), _i32([[0, 0]]))
    tables = TieredBlockTables(pages, (_i32([5]), _i32([0]), _i32([0])), fills, (_i32([2]), _i32([0]), _i32([0])))
    k, v = gather_request_kv(layer, tables, 0)
    want = torch.cat([layer[0].k[3, :, :2], layer[0].k[1, :, :3]], dim=1).permute(1, 0, 2).float()
    torch.testing.assert_close(k, want, rtol=0, atol=0)
    assert v.shape == k.shape == (5, 2, 16)


@pytest.mark.parametrize("tier,G", [(1, 32), (2, 32), (1, 8), (2, 8)])
def test_int_block_layout_bytes(tier, G):
    """Where each token's codes, scales and zeros sit inside a page-head block."""
    P, H, PAGE, D = 3, 2, 16, 32
    W, NG = (D if tier == 1 else D // 2), D // G
    tp = int_tier_pages(tier, P, PAGE, H, D, G)
    assert tp.k.shape == (P, H, PAGE * W + 4 * PAGE * NG) == (P, H, block_bytes(tier, PAGE, D, G))
    k, v = torch.randn(2, H, D).half(), torch.randn(2, H, D).half()
    page, off = torch.tensor([2, 0]), torch.tensor([5, 15])
    tp.write(page, off, k, v)
    bits = tc.TIER_BITS[tier]
    kq, ks, kz = tc.quantize(k, bits, G)
    vq, vs, vz = tc.quantize(v, bits, G)
    blk_k, blk_v = tp.k[2, 1], tp.v[2, 1]  # token 0 (page 2, slot 5), kv head 1
    assert torch.equal(blk_k[5 * W:6 * W], kq[0, 1])  # K codes token-major
    assert torch.equal(blk_v[:PAGE * W].view(W, PAGE)[:, 5], vq[0, 1])  # V codes dim-major
    half_k, half_v = blk_k[PAGE * W:].view(torch.float16), blk_v[PAGE * W:].view(torch.float16)
    assert torch.equal(half_k[5 * NG:6 * NG], ks[0, 1]) and torch.equal(half_k[PAGE * NG + 5 * NG:][:NG], kz[0, 1])
    assert torch.equal(half_v[5 * NG:6 * NG], vs[0, 1]) and torch.equal(half_v[PAGE * NG + 5 * NG:][:NG], vz[0, 1])
    got = tp.codes(page, off)
    for a, b in zip(got, (kq, vq, ks, kz, vs, vz)):
        assert torch.equal(a, b)
    rk, rv = tp.read(page, off, torch.float32)
    torch.testing.assert_close(rk, tc.dequantize(kq, ks, kz, bits, G, torch.float32))
    torch.testing.assert_close(rv, tc.dequantize(vq, vs, vz, bits, G, torch.float32))
