"""fusedkv_tiered_decode (FusedKV / Lite decode over the tiered id space, sources fused in
registers) vs its torch reference: keys in every store, dropped ids, several layers in stacked
stores, split-K (planned, even, one split), GQA, Lite, no int stores."""
import pytest
import torch

from sgl_kvxfer.kernels.fusedkv_attention import pack_fusion_weights
from sgl_kvxfer.kernels.fusedkv_tiered_decode import (TieredLaunch, TieredStores, fusedkv_tiered_decode,
                                                      fusedkv_tiered_decode_reference, plan_tiered_splits)
from sgl_kvxfer.kernels.paged_layout import int_tier_pages
from sgl_kvxfer.kernels.tier_codec import TIER_INT4, TIER_INT8

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _stores(L, H, D, G, PAGE, rows, pages, with_int, gen, dtype=torch.float16):
    rows_k = torch.randn(L, rows, H, D, generator=gen).to(dtype).to(DEVICE)
    rows_v = torch.randn(L, rows, H, D, generator=gen).to(dtype).to(DEVICE)
    rows_k[:, 0] = rows_v[:, 0] = 0
    ints = []
    for tier in (TIER_INT8, TIER_INT4):
        if not with_int:
            ints.append(None)
            continue
        tp = int_tier_pages(tier, L * pages, PAGE, H, D, G, DEVICE)
        n = L * pages * PAGE
        idx = torch.arange(n, device=DEVICE)
        tp.write(idx // PAGE, idx % PAGE, torch.randn(n, H, D, generator=gen).to(DEVICE) * 2,
                 torch.randn(n, H, D, generator=gen).to(DEVICE))
        ints.append(tp)
    base8 = rows + 3
    return TieredStores(rows_k, rows_v, ints[0], ints[1], pages if with_int else 0, pages if with_int else 0,
                        base8, base8 + pages * PAGE, G)


def _slots(stores, B, W, gen):
    """Each request's row: a mix of fp16 rows, int8 and int4 ids, some 0 (dropped)."""
    rows = stores.rows_k.shape[1]
    choices = [torch.randint(1, rows, (B, W), generator=gen)]
    if stores.int8 is not None:
        span = stores.base4 - stores.base8
        choices += [stores.base8 + torch.randint(0, span, (B, W), generator=gen),
                    stores.base4 + torch.randint(0, stores.pages4 * stores.int4.page, (B, W), generator=gen)]
    pick = torch.randint(0, len(choices), (B, W), generator=gen)
    slots = torch.stack(choices).gather(0, pick[None])[0]
    slots[torch.rand(B, W, generator=gen) < 0.1] = 0
    return slots.to(DEVICE)


@pytest.mark.parametrize("variant", ["fusedkv", "lite"])
@pytest.mark.parametrize("D,G,Hq,H", [(32, 32, 6, 2), (64, 16, 3, 3)])
@pytest.mark.parametrize("plan", ["auto", "even", "one"])
def test_decode_matches_reference(variant, D, G, Hq, H, plan):
    gen = torch.Generator().manual_seed(D + Hq)
    stores = _stores(L=3, H=H, D=D, G=G, PAGE=8, rows=40, pages=4, with_int=True, gen=gen)
    B, W = 3, 90
    slots = _slots(stores, B, W, gen)
    lens = torch.tensor([90, 1, 57], dtype=torch.int32, device=DEVICE)
    q = torch.randn(B, Hq, D, generator=gen).half().to(DEVICE)
    if variant == "fusedkv":
        kl, vl = (0, 2), (0, 2)
        w = pack_fusion_weights(torch.rand(2, H, D, generator=gen) + 0.2, torch.rand(2, H, D, generator=gen)).to(DEVICE)
    else:
        kl, vl, w = (2,), (0,), None
    split = {"auto": None, "even": (2, 3), "one": (3, 1)}[plan]
    got = fusedkv_tiered_decode(q, stores, kl, vl, slots, lens, w, split_plan=split, even_splits=plan == "even")
    want = fusedkv_tiered_decode_reference(q, stores, kl, vl, slots, lens, w)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


def test_fp16_rows_only_and_graph_width():
    """No int pages (b = 1.0 stores, or before any re-tier) and a row wider than every request."""
    gen = torch.Generator().manual_seed(1)
    stores = _stores(L=2, H=2, D=32, G=32, PAGE=8, rows=50, pages=0, with_int=False, gen=gen)
    slots = _slots(stores, 2, 64, gen)
    lens = torch.tensor([20, 33], dtype=torch.int32, device=DEVICE)
    q = torch.randn(2, 4, 32, generator=gen).half().to(DEVICE)
    w = pack_fusion_weights(torch.rand(2, 2, 32, generator=gen), torch.rand(2, 2, 32, generator=gen)).to(DEVICE)
    got = fusedkv_tiered_decode(q, stores, (0, 1), (0, 1), slots, lens, w, even_splits=True)
    want = fusedkv_tiered_decode_reference(q, stores, (0, 1), (0, 1), slots, lens, w)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("launch", [TieredLaunch(64, 4, 2), TieredLaunch(128, 8, 3), TieredLaunch(16, 2, 1, 4)],
                         ids=["64-4-2", "128-8-3", "16-2-1-w4"])
def test_launch_shapes_match_reference(launch):
    """Other launch shapes (benchmarks/kernels/fusedkv_tiered.py's sweep): a tile wider than a
    request and than an int page, planned splits counted in the launch's tiles."""
    gen = torch.Generator().manual_seed(launch.tile)
    stores = _stores(L=2, H=3, D=64, G=16, PAGE=8, rows=60, pages=6, with_int=True, gen=gen)
    slots = _slots(stores, 3, 150, gen)
    lens = torch.tensor([150, 7, 96], dtype=torch.int32, device=DEVICE)
    q = torch.randn(3, 9, 64, generator=gen).half().to(DEVICE)
    w = pack_fusion_weights(torch.rand(2, 3, 64, generator=gen) + 0.2, torch.rand(2, 3, 64, generator=gen)).to(DEVICE)
    plan = plan_tiered_splits(slots.shape[1], 3, 3, q.device, launch)
    assert plan[0] * plan[1] * launch.tile >= slots.shape[1]  # the splits cover the row in this tile
    got = fusedkv_tiered_decode(q, stores, (0, 1), (0, 1), slots, lens, w, split_plan=plan, launch=launch)
    want = fusedkv_tiered_decode_reference(q, stores, (0, 1), (0, 1), slots, lens, w)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


def test_launch_is_checked():
    gen = torch.Generator().manual_seed(3)
    stores = _stores(L=2, H=2, D=32, G=32, PAGE=8, rows=20, pages=2, with_int=True, gen=gen)
    q = torch.randn(1, 2, 32).half().to(DEVICE)
    slots, lens = torch.zeros(1, 100, dtype=torch.int64, device=DEVICE), torch.ones(1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(AssertionError, match="covers 64 keys of 100"):  # a plan counted in 32-key tiles
        fusedkv_tiered_decode(q, stores, (0,), (1,), slots, lens, split_plan=(2, 2), launch=TieredLaunch(16, 4, 2))
    for bad in (dict(tile=48), dict(tile=8), dict(num_warps=3), dict(num_stages=0), dict(split_waves=0)):
        with pytest.raises(ValueError):
            TieredLaunch(**bad)


def test_inputs_are_checked():
    gen = torch.Generator().manual_seed(2)
    stores = _stores(L=2, H=2, D=32, G=32, PAGE=8, rows=20, pages=2, with_int=True, gen=gen)
    q = torch.randn(1, 2, 32).half().to(DEVICE)
    slots = torch.zeros(1, 8, dtype=torch.int64, device=DEVICE)
    lens = torch.ones(1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(AssertionError, match="weights"):
        fusedkv_tiered_decode(q, stores, (0, 1), (0, 1), slots, lens)
    with pytest.raises(AssertionError):
        fusedkv_tiered_decode(q, stores, (0, 5), (0, 1), slots, lens)
