"""gather_tiered_kv (one launch over the fp16 rows and the int8 / int4 page-head blocks) vs its
torch reference and TieredKVPool.get_kv: ids of every store, dropped (0), several pages, G = D
and G < D, int stores absent."""
import pytest
import torch

from sgl_kvxfer.kernels.paged_layout import int_tier_pages
from sgl_kvxfer.kernels.tier_codec import TIER_INT4, TIER_INT8
from sgl_kvxfer.kernels.tiered_gather import gather_tiered_kv, gather_tiered_kv_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _stores(D, G, H, PAGE, rows, pages, with_int, gen):
    rows_k = torch.randn(rows, H, D, generator=gen).half().to(DEVICE)
    rows_v = torch.randn(rows, H, D, generator=gen).half().to(DEVICE)
    rows_k[0] = rows_v[0] = 0  # the padding row
    stores = []
    for tier in (TIER_INT8, TIER_INT4):
        if not with_int:
            stores.append(None)
            continue
        tp = int_tier_pages(tier, pages, PAGE, H, D, G, DEVICE)
        n = pages * PAGE
        idx = torch.arange(n, device=DEVICE)
        tp.write(idx // PAGE, idx % PAGE, torch.randn(n, H, D, generator=gen).to(DEVICE) * 2,
                 torch.randn(n, H, D, generator=gen).to(DEVICE))
        stores.append(tp)
    return rows_k, rows_v, stores


@pytest.mark.parametrize("D,G", [(64, 64), (64, 16), (32, 32)])
@pytest.mark.parametrize("out_dtype", [torch.float16, torch.float32])
def test_gather_matches_reference(D, G, out_dtype):
    gen = torch.Generator().manual_seed(D + G)
    H, PAGE, rows, pages = 3, 8, 20, 4
    rows_k, rows_v, (s8, s4) = _stores(D, G, H, PAGE, rows, pages, True, gen)
    base8 = rows + 2
    base4 = base8 + pages * PAGE
    ids = torch.tensor([0, 5, base8, base8 + 9, base4 + 31, 19, base4, base8 + 31, 0, base4 + 12, 1, 7,
                        base8 + 17, base4 + 8, 3, 2, 11], device=DEVICE)  # > BLOCK_N 16: two programs
    got = gather_tiered_kv(rows_k, rows_v, s8, s4, ids, base8, base4, out_dtype, block_n=16)
    want = gather_tiered_kv_reference(rows_k, rows_v, s8, s4, ids, base8, base4, out_dtype)
    for g, w in zip(got, want):
        assert g.shape == (ids.numel(), H, D) and g.dtype == out_dtype
        # fp32 multiply-add may fuse on the GPU (one rounding instead of two)
        torch.testing.assert_close(g, w, rtol=1e-3, atol=1e-3)
    assert torch.equal(got[0][0], torch.zeros_like(got[0][0]))  # dropped: the zero padding row
    assert got[0][1].abs().sum() > 0 and got[0][4].abs().sum() > 0


def test_fp16_rows_only_and_empty():
    gen = torch.Generator().manual_seed(0)
    rows_k, rows_v, _ = _stores(32, 32, 2, 8, 10, 0, False, gen)
    ids = torch.tensor([1, 9, 0, 4], device=DEVICE)
    k, v = gather_tiered_kv(rows_k, rows_v, None, None, ids, 12, 12, torch.float16)
    assert torch.equal(k, rows_k[ids]) and torch.equal(v, rows_v[ids])
    k, v = gather_tiered_kv(rows_k, rows_v, None, None, ids[:0], 12, 12, torch.float16)
    assert k.shape == (0, 2, 32)
