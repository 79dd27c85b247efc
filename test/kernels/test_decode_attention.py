"""decode_attention_tiered vs the dequantize-then-attend torch reference (+ per-tier
accuracy against attention on the original, unquantized K/V)."""

import pytest
import torch

from sgl_kvxfer.kernels.decode_attention import (
    decode_attention_tiered,
    decode_attention_tiered_reference,
)
from sgl_kvxfer.kernels.testing import TIER_ATOL, build_random_cache, exact_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# max |kernel - reference| where both read the same dequantized values (fp16 P in the PV dot)
KERNEL_ATOL = 4e-3


def _check(lens, Hq, Hkv, D, G, PAGE, pps, mix, dtype=torch.float16, device=DEVICE):
    layer, tables, (k, v) = build_random_cache(lens, Hkv, D, G, PAGE, dtype, device, seed=len(lens))
    q = torch.randn(len(lens), Hq, D, generator=torch.Generator().manual_seed(3)).to(dtype).to(device)
    o = decode_attention_tiered(q, layer, tables, pages_per_split=pps)
    r = decode_attention_tiered_reference(q, layer, tables)
    assert o.shape == q.shape and o.dtype == q.dtype
    torch.testing.assert_close(o.float(), r.float(), atol=KERNEL_ATOL, rtol=0)
    nonempty = [b for b, l in enumerate(lens) if sum(l) > 0]
    if nonempty:
        ex = exact_attention(q, k, v, lens, Hq // Hkv)
        err = (o.float() - ex).abs()[nonempty].max().item()
        assert err < TIER_ATOL[mix], (mix, err)


@pytest.mark.parametrize(
    "mix,lens",
    [
        ("fp16", [(37, 0, 0), (5, 0, 0)]),
        ("int8", [(0, 40, 0), (0, 3, 0)]),
        ("int4", [(0, 0, 33), (0, 0, 16)]),
        ("mixed", [(17, 5, 40), (0, 0, 0), (1, 33, 2)]),
    ],
)
def test_decode_tiers_small(mix, lens):
    _check(lens, Hq=4, Hkv=2, D=32, G=16, PAGE=16, pps=(1, 1, 2), mix=mix)


@pytest.mark.parametrize("Hq,Hkv,D", [(3, 1, 64), (2, 2, 16)])
def test_decode_gqa_shapes_and_auto_split(Hq, Hkv, D):
    _check([(9, 20, 18)], Hq=Hq, Hkv=Hkv, D=D, G=16, PAGE=16, pps=None, mix="mixed")


@pytest.mark.gpu  # the Triton 3.9 CPU interpreter's tl.dot gives garbage for bf16 inputs
def test_decode_bf16_gpu():
    _check([(3, 17, 5)], Hq=2, Hkv=1, D=32, G=32, PAGE=16, pps=(1, 1, 1), mix="mixed",
           dtype=torch.bfloat16, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("Hq,Hkv,D", [(32, 8, 128), (9, 3, 64)])
@pytest.mark.parametrize("mix", ["fp16", "int8", "int4", "mixed"])
def test_decode_real_shapes_gpu(Hq, Hkv, D, mix):
    base = [3000, 9000, 50, 4100]
    lens = {
        "fp16": [(n, 0, 0) for n in base],
        "int8": [(0, n, 0) for n in base],
        "int4": [(0, 0, n) for n in base],
        "mixed": [(n // 5, 2 * n // 5, n - n // 5 - 2 * n // 5) for n in base],
    }[mix]
    _check(lens, Hq, Hkv, D, 32, 64, None, mix, device="cuda")


@pytest.mark.parametrize("prefetch,fast,even", [(False, True, False), (True, False, False), (False, False, False),
                                               (True, True, True)])
def test_decode_knobs_match_default(prefetch, fast, even):
    if not prefetch and DEVICE == "cuda":
        # Seen on an H200 (Triton 3.6): the unprefetched quantized loop, an ablation knob the
        # engine never uses, is wrong at this test's small tiles (D 32, G 16, PAGE 16), also with
        # its loop unpipelined; the default path matches the reference. kernels/README.md sec. 5.
        pytest.xfail("prefetch=False gives wrong int8/int4 results on the H200 at small tiles")
    layer, tables, _ = build_random_cache([(2, 40, 35)], 1, 32, 16, 16, device=DEVICE, seed=9)
    q = torch.randn(1, 2, 32, generator=torch.Generator().manual_seed(2)).half().to(DEVICE)
    a = decode_attention_tiered(q, layer, tables, pages_per_split=(1, 2, 2))
    b = decode_attention_tiered(q, layer, tables, pages_per_split=(1, 2, 2), prefetch=prefetch,
                                fast_dequant=fast, even_splits=even)
    r = decode_attention_tiered_reference(q, layer, tables)
    # Each against the reference first, so a failure says which variant is off.
    torch.testing.assert_close(a.float(), r.float(), atol=KERNEL_ATOL, rtol=0)
    torch.testing.assert_close(b.float(), r.float(), atol=KERNEL_ATOL, rtol=0)
    torch.testing.assert_close(a.float(), b.float(), atol=2e-3, rtol=0)


@pytest.mark.parametrize("even", [False, True])
def test_decode_fixed_wide_plan_and_empty_rows(even):
    """The CUDA-graph decode plan: fp16 tables padded to a fixed width (page id 0 past each
    request), a split plan made once for that width and reused (split_plan, check=False). Splits
    past a request's pages are no-ops (even=True: each request spreads its pages over the 6
    splits instead), and a request with no tokens (a padding row) gives exactly 0."""
    from sgl_kvxfer.kernels.decode_attention import plan_splits
    from sgl_kvxfer.kernels.paged_layout import TieredBlockTables

    lens = [(37, 0, 0), (0, 0, 0), (5, 0, 0)]
    layer, tables, _ = build_random_cache(lens, 2, 32, 16, 16, device=DEVICE, seed=5)
    q = torch.randn(3, 4, 32, generator=torch.Generator().manual_seed(6)).half().to(DEVICE)
    narrow = tables.tables[0]
    wide = torch.zeros(3, 12, dtype=torch.int32, device=DEVICE)
    wide[:, : narrow.shape[1]] = narrow
    wide_tables = TieredBlockTables((wide,) + tables.tables[1:], tables.lens)
    plan = plan_splits(wide_tables, 2, 32, 16, 2, q.device, pages_per_split=(2, 1, 1))
    assert plan[1][0] == 6  # 6 fp16 splits; the 37-token request fills 2, the 5-token one 1
    o = decode_attention_tiered(q, layer, wide_tables, split_plan=plan, check=False, even_splits=even)
    r = decode_attention_tiered_reference(q, layer, tables)
    torch.testing.assert_close(o.float(), r.float(), atol=KERNEL_ATOL, rtol=0)
    assert bool((o[1] == 0).all()), "a request without tokens must give exactly 0"


@pytest.mark.parametrize("fp16_splits", [1, 3])
@pytest.mark.parametrize("pages_per_iter", [1, 4])
def test_decode_fp16_only_plan_direct_and_merged(fp16_splits, pages_per_iter):
    """The pure-fp16 backend's plan: no split programs for the empty int8 / int4 tiers. With one
    split per request the kernel writes the output itself (no partials, no merge), otherwise
    it merges; both equal the reference, and a request without tokens gives exactly 0."""
    from sgl_kvxfer.kernels.paged_layout import TieredBlockTables

    lens = [(150, 0, 0), (0, 0, 0), (20, 0, 0), (64, 0, 0)]
    layer, tables, _ = build_random_cache(lens, 2, 32, 16, 16, device=DEVICE, seed=9)
    q = torch.randn(4, 4, 32, generator=torch.Generator().manual_seed(2)).half().to(DEVICE)
    wide = torch.zeros(4, 16, dtype=torch.int32, device=DEVICE)
    wide[:, : tables.tables[0].shape[1]] = tables.tables[0]
    wide_tables = TieredBlockTables((wide,) + tables.tables[1:], tables.lens)
    plan = ((-(-16 // fp16_splits), 1, 1), (fp16_splits, 0, 0))
    out = torch.full_like(q, float("nan"))  # every row must be written, padding rows too
    o = decode_attention_tiered(q, layer, wide_tables, split_plan=plan, check=False, even_splits=True, out=out,
                                pages_per_iter=pages_per_iter)
    assert o.data_ptr() == out.data_ptr()
    r = decode_attention_tiered_reference(q, layer, tables)
    torch.testing.assert_close(o.float(), r.float(), atol=KERNEL_ATOL, rtol=0)
    assert bool((o[1] == 0).all()), "a request without tokens must give exactly 0"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mix", ["fp16", "int8", "int4"])
def test_decode_single_tier_dtype_gpu(dtype, mix):
    lens = {"fp16": [(70, 0, 0)], "int8": [(0, 70, 0)], "int4": [(0, 0, 70)]}[mix]
    _check(lens, Hq=8, Hkv=2, D=64, G=32, PAGE=16, pps=(1, 1, 1), mix=mix, dtype=dtype,
           device="cuda")


@pytest.mark.parametrize("pages_per_iter", [2, 4])
def test_decode_fp16_pages_per_iter_at_split_edges(pages_per_iter):
    """Several fp16 pages per loop step, with split ranges (3 pages) that are not a multiple of
    the step and sequences ending mid-page, next to int8 / int4 pages: equals the reference."""
    lens = [(150, 40, 20), (33, 0, 17), (16, 16, 0)]
    layer, tables, _ = build_random_cache(lens, 1, 32, 16, 16, device=DEVICE, seed=4)
    q = torch.randn(3, 2, 32, generator=torch.Generator().manual_seed(3)).half().to(DEVICE)
    o = decode_attention_tiered(q, layer, tables, pages_per_split=(3, 2, 2), pages_per_iter=pages_per_iter)
    r = decode_attention_tiered_reference(q, layer, tables)
    torch.testing.assert_close(o.float(), r.float(), atol=KERNEL_ATOL, rtol=0)


def test_default_pages_per_iter_keeps_a_step_near_8k_elements():
    from sgl_kvxfer.kernels.decode_attention import default_pages_per_iter

    assert default_pages_per_iter(64, 64) == 2  # SmolLM2 heads on the triton backend's pages
    assert default_pages_per_iter(64, 128) == 1  # Llama-3-8B heads
    assert default_pages_per_iter(16, 32) == 4  # capped
    assert default_pages_per_iter(128, 128) == 1


@pytest.mark.parametrize("direct", [True, False])
def test_decode_longest_first_order_gives_the_same_outputs(direct):
    """request_order only changes which program serves which request: every row still gets its
    own request's attention (direct: the pure-fp16 one-split plan, the kernel writes the output;
    else tiered pages in several splits whose partials merge)."""
    from sgl_kvxfer.kernels.decode_attention import longest_first_order

    lens = [(20, 0, 0), (150, 0, 0), (0, 0, 0), (64, 40, 3), (5, 0, 0)]
    if direct:
        lens = [(n, 0, 0) for n, _, _ in lens]
    layer, tables, _ = build_random_cache(lens, 2, 32, 16, 16, device=DEVICE, seed=11)
    q = torch.randn(5, 4, 32, generator=torch.Generator().manual_seed(8)).half().to(DEVICE)
    order = longest_first_order(tables)
    assert order.dtype == torch.int32 and order.tolist()[:2] == [1, 3] and sorted(order.tolist()) == list(range(5))
    if direct:
        plan = ((tables.tables[0].shape[1], 1, 1), (1, 0, 0))
        o = decode_attention_tiered(q, layer, tables, split_plan=plan, request_order=order,
                                    out=torch.full_like(q, float("nan")))
    else:
        o = decode_attention_tiered(q, layer, tables, pages_per_split=(2, 1, 1), request_order=order)
    r = decode_attention_tiered_reference(q, layer, tables)
    torch.testing.assert_close(o.float(), r.float(), atol=KERNEL_ATOL, rtol=0)
    assert bool((o[2] == 0).all()), "a request without tokens must give exactly 0"
