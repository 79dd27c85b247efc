"""relocate_codes (int tokens moved inside a page-head block store) vs TierPages.codes/put_codes:
the same bytes, int8 and int4, G = D and G < D, tokens of several pages to several pages."""
import pytest
import torch

from sgl_kvxfer.kernels.paged_layout import int_tier_pages
from sgl_kvxfer.kernels.tier_relocate import relocate_codes, relocate_codes_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("tier", [1, 2])
@pytest.mark.parametrize("D,G", [(32, 32), (64, 16)])
def test_relocate_matches_put_codes(tier, D, G):
    g = torch.Generator().manual_seed(tier + D + G)
    P, H, PAGE = 6, 3, 8
    got = int_tier_pages(tier, P, PAGE, H, D, G, DEVICE)
    got.k.copy_(torch.randint(0, 256, got.k.shape, generator=g, dtype=torch.uint8))
    got.v.copy_(torch.randint(0, 256, got.v.shape, generator=g, dtype=torch.uint8))
    want = int_tier_pages(tier, P, PAGE, H, D, G, DEVICE)
    want.k.copy_(got.k)
    want.v.copy_(got.v)
    src = torch.tensor([3, 17, 18, 9, 40, 2], device=DEVICE)  # flat token ids: page * PAGE + off
    dst = torch.tensor([24, 25, 26, 27, 33, 47], device=DEVICE)
    args = (src // PAGE, src % PAGE, dst // PAGE, dst % PAGE)
    relocate_codes(got, *args)
    relocate_codes_reference(want, *args)
    assert torch.equal(got.k, want.k) and torch.equal(got.v, want.v)
    assert not torch.equal(got.k, int_tier_pages(tier, P, PAGE, H, D, G, DEVICE).k)


def test_relocate_empty_and_checks():
    tp = int_tier_pages(1, 1, 8, 1, 32, 32, DEVICE)
    none = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    relocate_codes(tp, none, none, none, none)
    with pytest.raises(AssertionError):
        relocate_codes(tp, none, none, none, torch.zeros(1, dtype=torch.int64, device=DEVICE))


@pytest.mark.parametrize("overlap", [False, True])
def test_pool_move_relocation_kernel_matches_torch_path(overlap):
    """TieredKVPool.move's int -> same-int moves through relocate_codes write what its torch
    path writes; a move whose destinations are also its sources takes the torch path."""
    from sgl_kvxfer.mem_cache.tier_plan import TierStorePlan
    from sgl_kvxfer.mem_cache.tiered_pool import TieredKVPool

    pools = [TieredKVPool(64, 2, 2, 32, torch.float16, DEVICE, TierStorePlan(40, 32, 48), group_size=16,
                          page_size=8) for _ in range(2)]
    g = torch.Generator().manual_seed(2)
    for t in (1, 2):
        for a, b in zip(pools[0].stores[t], pools[1].stores[t]):
            for x, y in ((a.k, b.k), (a.v, b.v)):
                x.copy_(torch.randint(0, 256, x.shape, generator=g, dtype=torch.uint8))
                y.copy_(x)
    pools[0]._fused_relocate, pools[1]._fused_relocate = True, False
    b8, b4 = pools[0].base(1), pools[0].base(2)
    src = torch.tensor([b8 + 1, b8 + 2, b4 + 3, b4 + 9, b4 + 10])
    dst = torch.tensor([b8 + 16, b8 + 17, b4 + 24, b4 + 25, b4 + (3 if overlap else 26)])
    for p in pools:
        p.move(src, dst)
    for t in (1, 2):
        for a, b in zip(pools[0].stores[t], pools[1].stores[t]):
            assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)
