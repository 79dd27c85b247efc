"""pool_token_mass (the cold tier's scoring kernel) vs its torch reference and vs the tiered pool's
own read path (get_k_routed + head_max_mass): fp16, int8 and int4 tokens, dropped slots, ragged
rows, G = D and G < D, max-accumulation across calls."""
import pytest
import torch

from sgl_kvxfer.kernels.cold_mass import pool_token_mass, pool_token_mass_layers, pool_token_mass_reference
from sgl_kvxfer.mem_cache.tier_plan import TierStorePlan
from sgl_kvxfer.mem_cache.tiered_allocator import TieredSlotAllocator
from sgl_kvxfer.mem_cache.tiered_pool import TieredKVPool
from sgl_kvxfer.spectrum.decode_mass import head_max_mass
from sgl_kvxfer.spectrum.tiers import TIER_DROP, TIER_FP16, TIER_INT4, TIER_INT8

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _pool_rows(H, D, G, dtype, lens, seed):
    """A tiered pool holding len(lens) rows of mixed tiers (some dropped), rows padded with 0."""
    g = torch.Generator().manual_seed(seed)
    total = sum(lens)
    pool = TieredKVPool(2 * total, 2, H, D, dtype, DEVICE, TierStorePlan(total + 8, total + 8, total + 8),
                        group_size=G, page_size=8)
    alloc = TieredSlotAllocator(pool, DEVICE)
    width = max(lens)
    rows = torch.zeros((len(lens), width), dtype=torch.int64)
    for i, n in enumerate(lens):
        slots = alloc.alloc(n)
        for layer in range(2):
            pool.set_kv(layer, slots, (torch.randn(n, H, D, generator=g) * 2).to(DEVICE),
                        torch.randn(n, H, D, generator=g).to(DEVICE))
        tiers = torch.randint(0, 3, (n,), generator=g).to(torch.int8)  # fp16 / int8 / int4 mixed
        tiers[torch.rand(n, generator=g) < 0.1] = TIER_DROP
        tiers[0] = TIER_FP16
        new, _ = alloc.retier(slots.cpu(), tiers)
        rows[i, :n] = new.cpu()
    return pool, rows


@pytest.mark.parametrize("H,HQ,D,G", [(2, 8, 32, 32), (1, 4, 64, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_reference_and_pool_read(H, HQ, D, G, dtype):
    lens = [70, 9, 130]
    pool, rows = _pool_rows(H, D, G, dtype, lens, seed=H + D + G)
    g = torch.Generator().manual_seed(7)
    q = (torch.randn(len(lens), HQ, D, generator=g) * 0.4).to(dtype).to(DEVICE)
    b8, b4 = pool.base(TIER_INT8), pool.base(TIER_INT4)
    rows_d = rows.to(DEVICE)
    lens_d = torch.tensor(lens, device=DEVICE)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for layer in range(2):
        args = (q, rows_d, lens_d, pool.k16[layer], pool.stores[TIER_INT8][layer], pool.stores[TIER_INT4][layer],
                b8, b4, 0.3)
        got = pool_token_mass(*args, torch.zeros(rows.shape, device=DEVICE), tile=32)
        want = pool_token_mass_reference(*args, torch.zeros(rows.shape, device=DEVICE))
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
        # the pool's own read path (what the cold tier's torch fallback runs)
        keys = pool.get_k_routed(layer, pool.route(rows))
        valid = (rows != 0).to(DEVICE)
        ref = head_max_mass(q, keys, 0.3, valid).masked_fill(~valid, 0.0)
        torch.testing.assert_close(got, ref.float(), atol=tol, rtol=tol)
        assert torch.all(got[1, lens[1]:] == 0) and torch.all(got[rows.to(DEVICE) == 0] == 0)
        assert float(got[0, :lens[0]].sum()) <= HQ + 1e-3  # at most one distribution per head


def test_accumulates_max_over_calls():
    pool, rows = _pool_rows(1, 32, 32, torch.float32, [40], seed=3)
    q = torch.randn(1, 2, 32).to(DEVICE)
    args = (rows.to(DEVICE), torch.tensor([40], device=DEVICE), pool.k16[0], pool.stores[TIER_INT8][0],
            pool.stores[TIER_INT4][0], pool.base(TIER_INT8), pool.base(TIER_INT4), 0.5)
    a = pool_token_mass(q, *args, torch.zeros(rows.shape, device=DEVICE))
    b = pool_token_mass(-q, *args, torch.zeros(rows.shape, device=DEVICE))
    both = pool_token_mass(-q, *args, a.clone())
    torch.testing.assert_close(both, torch.maximum(a, b))


def test_layers_in_one_tail_match_one_call_per_layer():
    """pool_token_mass_layers (one logits launch per layer, one tail) gives what one
    pool_token_mass call per layer max-accumulated gives, on top of what `out` held."""
    lens = [50, 7]
    pool, rows = _pool_rows(2, 32, 32, torch.float32, lens, seed=11)
    g = torch.Generator().manual_seed(5)
    qs = [(torch.randn(len(lens), 8, 32, generator=g) * 0.5).to(DEVICE) for _ in range(2)]
    rows_d, lens_d = rows.to(DEVICE), torch.tensor(lens, device=DEVICE)
    b8, b4 = pool.base(TIER_INT8), pool.base(TIER_INT4)
    start = torch.rand(rows.shape, generator=g).to(DEVICE) * 0.05
    want = start.clone()
    for layer in range(2):
        pool_token_mass(qs[layer], rows_d, lens_d, pool.k16[layer], pool.stores[TIER_INT8][layer],
                        pool.stores[TIER_INT4][layer], b8, b4, 0.4, want)
    got = pool_token_mass_layers(qs, rows_d, lens_d, list(pool.k16[:2]), list(pool.stores[TIER_INT8][:2]),
                                 list(pool.stores[TIER_INT4][:2]), b8, b4, 0.4, start.clone())
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    assert bool((got > start).any())  # the layers' masses reached past what out held


def test_checks():
    pool, rows = _pool_rows(1, 32, 32, torch.float32, [10], seed=4)
    args = (torch.zeros(1, 2, 32, device=DEVICE), rows.to(DEVICE), torch.tensor([10], device=DEVICE), pool.k16[0],
            pool.stores[TIER_INT8][0], pool.stores[TIER_INT4][0], pool.base(TIER_INT8), pool.base(TIER_INT4), 1.0)
    with pytest.raises(AssertionError):  # out must be fp32 [n, W]
        pool_token_mass(*args, torch.zeros(rows.shape, dtype=torch.float16, device=DEVICE))
    with pytest.raises(AssertionError):  # int stores swapped
        pool_token_mass(*args[:4], args[5], args[4], *args[6:], torch.zeros(rows.shape, device=DEVICE))


@pytest.mark.gpu
def test_real_shape_gpu():
    """Llama-3-8B heads (32 / 8, D 128, G 32), bf16, 2 rows of 4096 mixed-tier tokens, page 256."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from sgl_kvxfer.kernels.paged_layout import int_tier_pages

    g = torch.Generator(device="cuda").manual_seed(0)
    H, HQ, D, G, PAGE, W = 8, 32, 128, 32, 256, 4096
    k16 = torch.randn(2 * W + 2, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    i8, i4 = (int_tier_pages(t, 2 * W // PAGE, PAGE, H, D, G, "cuda") for t in (TIER_INT8, TIER_INT4))
    for tp in (i8, i4):
        tp.k_codes.copy_(torch.randint(0, 256, tp.k_codes.shape, device="cuda", generator=g, dtype=torch.uint8))
        tp.k_scale.copy_(torch.rand(tp.k_scale.shape, device="cuda", generator=g) * 0.1)
        tp.k_zero.copy_(torch.randn(tp.k_zero.shape, device="cuda", generator=g) * 0.5)
    b8 = 2 * W + 2
    b4 = b8 + 2 * W
    tier = torch.randint(0, 10, (2, W), device="cuda", generator=g)
    pick = torch.randperm(2 * W, device="cuda", generator=g).view(2, W)
    rows = torch.where(tier < 2, 1 + pick, torch.where(tier < 3, b8 + pick, b4 + pick))
    rows[tier == 9] = 0
    q = torch.randn(2, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g)
    lens = torch.tensor([W, W - 100], device="cuda")
    got = pool_token_mass(q, rows, lens, k16, i8, i4, b8, b4, D ** -0.5, torch.zeros(2, W, device="cuda"))
    want = pool_token_mass_reference(q, rows, lens, k16, i8, i4, b8, b4, D ** -0.5, torch.zeros(2, W, device="cuda"))
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-2)
