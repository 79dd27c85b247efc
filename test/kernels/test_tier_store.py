"""store_rows_quantized (fp16 rows -> int page-head blocks) vs tier_codec through TierPages.write:
the same bytes, codes, scales and zeros, for int8 / int4, G = D and G < D, bf16 and fp16 rows."""
import pytest
import torch

from sgl_kvxfer.kernels.paged_layout import int_tier_pages
from sgl_kvxfer.kernels.tier_store import store_rows_quantized, store_rows_quantized_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("tier", [1, 2])
@pytest.mark.parametrize("D,G", [(32, 32), (32, 8), (64, 16)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_store_matches_codec(tier, D, G, dtype):
    g = torch.Generator().manual_seed(tier * 100 + D + G)
    R, H, PAGE, P = 40, 3, 16, 4
    k = (torch.randn(R, H, D, generator=g) * 3).to(dtype).to(DEVICE)
    v = torch.randn(R, H, D, generator=g).to(dtype).to(DEVICE)
    k[5, 1] = 0.25  # a constant row: scale 0, codes 0
    src = torch.tensor([5, 0, 39, 17, 8, 22, 3], device=DEVICE)
    page = torch.tensor([0, 3, 3, 1, 0, 2, 3], device=DEVICE)
    off = torch.tensor([0, 15, 2, 7, 1, 9, 3], device=DEVICE)
    got, want = (int_tier_pages(tier, P, PAGE, H, D, G, DEVICE) for _ in range(2))
    store_rows_quantized(k, v, src, got, page, off)
    store_rows_quantized_reference(k, v, src, want, page, off)
    if DEVICE == "cpu":  # the interpreter: bit for bit
        assert torch.equal(got.k, want.k) and torch.equal(got.v, want.v)
        return
    # compiled: scales and zeros exact; a code may differ by one at a .5 rounding boundary
    _assert_codes_close(got, want, page, off, tier, max_flip_frac=0.01)


def test_store_empty_and_checks():
    tp = int_tier_pages(1, 1, 16, 1, 32, 32, DEVICE)
    k = torch.zeros(2, 1, 32, dtype=torch.float16, device=DEVICE)
    none = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    store_rows_quantized(k, k, none, tp, none, none)
    assert int(tp.k.sum()) == 0
    with pytest.raises(AssertionError):
        store_rows_quantized(k, k, none, int_tier_pages(1, 1, 16, 2, 32, 32, DEVICE), none, none)


def test_pool_move_fused_equals_torch_path():
    """TieredKVPool.move with the quantize-and-store kernel writes what its torch path writes."""
    from sgl_kvxfer.mem_cache.tier_plan import TierStorePlan
    from sgl_kvxfer.mem_cache.tiered_pool import TieredKVPool

    pools = [TieredKVPool(64, 2, 2, 32, torch.float16, DEVICE, TierStorePlan(40, 32, 32), group_size=32,
                          page_size=16) for _ in range(2)]
    g = torch.Generator().manual_seed(1)
    for x in pools[0].k16 + pools[0].v16:  # drawn on the host, copied to the pool's device
        x.copy_((torch.randn(x.shape, generator=g) * (1 + torch.rand(x.shape, generator=g))).to(x.dtype))
    for a, b in zip(pools[1].k16 + pools[1].v16, pools[0].k16 + pools[0].v16):
        a.copy_(b)
    pools[1]._fused_quantize = False
    pools[0]._fused_quantize = True
    src = torch.tensor([3, 4, 5, 9, 11, 12])
    dst = torch.tensor([p for p in (pools[0].base(1), pools[0].base(1) + 1, pools[0].base(2),
                                    pools[0].base(2) + 1, pools[0].base(2) + 16, pools[0].base(1) + 2)])
    for p in pools:
        p.move(src, dst)
    for t in (1, 2):
        ids = dst[(pools[0].tier_of(dst) == t)]
        where = tuple(x.to(DEVICE) for x in pools[0].page_offset(t, ids))
        for a, b in zip(pools[0].stores[t], pools[1].stores[t]):
            if DEVICE == "cpu":
                assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)
                continue
            # compiled: scales and zeros exact, a code within one at a .5 boundary (as above)
            ca, cb = a.codes(*where), b.codes(*where)
            for x, y in zip(ca[2:], cb[2:]):
                assert torch.equal(x, y)
            for x, y in zip(ca[:2], cb[:2]):
                if t == 2:
                    x, y = torch.cat([x & 15, x >> 4], -1), torch.cat([y & 15, y >> 4], -1)
                assert int((x.int() - y.int()).abs().max()) <= 1


@pytest.mark.gpu
@pytest.mark.parametrize("tier", [1, 2])
@pytest.mark.parametrize("D", [128, 64])
def test_store_real_shapes_gpu(tier, D):
    """Llama-3-8B / SmolLM2 heads, bf16 rows, page 256, G = D: codes within one of the codec's."""
    g = torch.Generator(device="cuda").manual_seed(D)
    R, H = 4096, 8 if D == 128 else 3
    k = torch.randn(R, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(R, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    src = torch.randperm(R, device="cuda")[:3000]
    page = torch.arange(3000, device="cuda") // 256
    off = torch.arange(3000, device="cuda") % 256
    got, want = (int_tier_pages(tier, 12, 256, H, D, D, "cuda") for _ in range(2))
    store_rows_quantized(k, v, src, got, page, off)
    store_rows_quantized_reference(k, v, src, want, page, off)
    _assert_codes_close(got, want, page, off, tier, max_flip_frac=1e-3)


def _assert_codes_close(got, want, page, off, tier, max_flip_frac):
    """Scales and zeros exact; a code may differ by one at a .5 rounding boundary, in at most
    `max_flip_frac` of the codes (int4: compared per nibble)."""
    a, b = got.codes(page, off), want.codes(page, off)
    for x, y in zip(a[2:], b[2:]):
        assert torch.equal(x, y)
    for x, y in zip(a[:2], b[:2]):
        if tier == 2:
            x, y = torch.cat([x & 15, x >> 4], -1), torch.cat([y & 15, y >> 4], -1)
        d = (x.int() - y.int()).abs()
        assert int(d.max()) <= 1 and float((d > 0).float().mean()) < max_flip_frac


def test_pool_move_retier_is_one_launch_per_tier(monkeypatch):
    """A pure fp16 -> int move into stacked stores quantizes every layer in one launch per tier;
    the codes are those of a launch per layer (same kernel, same rows)."""
    import sgl_kvxfer.kernels.tier_store as ts
    from sgl_kvxfer.mem_cache.tier_plan import TierStorePlan
    from sgl_kvxfer.mem_cache.tiered_pool import TieredKVPool

    L = 3
    pools = [TieredKVPool(64, L, 2, 32, torch.float16, DEVICE, TierStorePlan(40, 32, 32), group_size=32,
                          page_size=16) for _ in range(2)]
    g = torch.Generator().manual_seed(2)
    for a, b in zip(pools[0].k16 + pools[0].v16, pools[1].k16 + pools[1].v16):
        a.copy_(torch.randn(a.shape, generator=g).to(a.dtype))
        b.copy_(a)
    for p in pools:
        p._fused_quantize = True
    src = torch.tensor([3, 4, 5, 9, 11, 12])
    base1, base2 = pools[0].base(1), pools[0].base(2)
    dst = torch.tensor([base1, base1 + 1, base2, base2 + 1, base2 + 16, base1 + 2])
    launches = []
    real = ts.store_rows_quantized
    monkeypatch.setattr(ts, "store_rows_quantized", lambda *a: (launches.append(a[3]), real(*a)))
    pools[0].move(src, dst)
    assert len(launches) == 2 and all(s.k.shape[0] == L * pools[0].num_pages(s.tier) for s in launches)
    for t in (1, 2):  # the per-layer launches by hand on the twin pool
        m = pools[1].tier_of(dst) == t
        page, off = (x.to(DEVICE) for x in pools[1].page_offset(t, dst[m]))
        for layer in range(L):
            real(pools[1].k16[layer], pools[1].v16[layer], src[m].to(DEVICE), pools[1].stores[t][layer], page, off)
        for a, b in zip(pools[0].stores[t], pools[1].stores[t]):
            assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)
