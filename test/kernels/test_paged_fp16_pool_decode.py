"""paged_fp16_pool_decode (the paged fp16 pool's decode) vs its torch reference and exact
attention: splits, fixed wide plans, pages per step, request order, padding rows, GQA, bf16.
CPU: Triton interpreter at tiny shapes; GPU (-m gpu): Llama-3-8B and SmolLM2 heads."""
import pytest
import torch

from sgl_kvxfer.kernels.paged_fp16_pool_decode import (
    default_pages_per_iter, longest_first_order, paged_fp16_pool_decode, paged_fp16_pool_decode_reference,
    plan_fp16_splits,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ATOL = 4e-3  # fp16 P in the P @ V dot


def _cache(lens, Hkv, D, PAGE, width=None, dtype=torch.float16, device=DEVICE, seed=0):
    """Random pages, each request on distinct random pages; table columns past a request's pages
    hold page 0 (any valid id)."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // PAGE) for n in lens]
    P = sum(need) + 1
    k = torch.randn(P, Hkv, PAGE, D, generator=g).to(dtype).to(device)
    v = torch.randn(P, Hkv, PAGE, D, generator=g).to(dtype).to(device)
    perm = torch.randperm(P, generator=g)
    table = torch.zeros(len(lens), max(width or 1, max(need + [1])), dtype=torch.int32)
    pos = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[pos:pos + n].to(torch.int32)
        pos += n
    return k, v, table.to(device), torch.tensor(lens, dtype=torch.int32, device=device)


def _check(lens, Hq, Hkv, D, PAGE, dtype=torch.float16, device=DEVICE, **kw):
    k, v, table, seq = _cache(lens, Hkv, D, PAGE, kw.pop("width", None), dtype, device, seed=len(lens))
    q = torch.randn(len(lens), Hq, D, generator=torch.Generator().manual_seed(3)).to(dtype).to(device)
    out = torch.full_like(q, float("nan"))  # every row must be written, padding rows too
    o = paged_fp16_pool_decode(q, k, v, table, seq, out=out, **kw)
    r = paged_fp16_pool_decode_reference(q, k, v, table, seq)
    assert o.data_ptr() == out.data_ptr() and o.dtype == q.dtype
    torch.testing.assert_close(o.float(), r.float(), atol=ATOL if dtype == torch.float16 else 1.6e-2, rtol=0)
    for b, n in enumerate(lens):
        if n == 0:
            assert bool((o[b] == 0).all()), "a request without keys must give exactly 0"
    return o


@pytest.mark.parametrize("Hq,Hkv,D", [(4, 2, 32), (3, 1, 64), (2, 2, 16), (9, 3, 64)])
def test_decode_gqa_and_auto_split(Hq, Hkv, D):
    _check([37, 5, 0, 16], Hq, Hkv, D, 16)


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("pages_per_iter", [1, 2, 4])
@pytest.mark.parametrize("even", [False, True])
def test_decode_fixed_wide_plan(splits, pages_per_iter, even):
    """The CUDA-graph plan: a table padded to a fixed width, a split plan made once for it.
    Splits past a request's pages are no-ops (even: each request spreads its pages over them);
    one split writes o directly, more merge; steps of several pages cross split edges."""
    plan = (-(-16 // splits), splits)
    _check([150, 0, 20, 64, 33], 4, 2, 32, 16, width=16, split_plan=plan, even_splits=even,
           pages_per_iter=pages_per_iter, check=False)


@pytest.mark.parametrize("splits", [1, 2])
def test_decode_longest_first_order_gives_the_same_outputs(splits):
    lens = [20, 150, 0, 64, 5]
    order = longest_first_order(torch.tensor(lens, dtype=torch.int32, device=DEVICE))
    assert order.dtype == torch.int32 and order.tolist()[:2] == [1, 3] and sorted(order.tolist()) == list(range(5))
    _check(lens, 4, 2, 32, 16, split_plan=(-(-10 // splits), splits), request_order=order)


def test_plan_and_pages_per_iter():
    assert plan_fp16_splits(10, 1, 1, "cpu", pages_per_split=3) == (3, 4)
    pps, S = plan_fp16_splits(100, 2, 2, "cpu")
    assert S == -(-100 // pps) and S >= 1
    assert default_pages_per_iter(64, 64) == 2  # SmolLM2 heads on the triton backend's pages
    assert default_pages_per_iter(64, 128) == 1  # Llama-3-8B heads
    assert default_pages_per_iter(16, 32) == 4  # capped
    assert default_pages_per_iter(128, 128) == 1


@pytest.mark.gpu  # the CPU interpreter's bf16 tl.dot is wrong; DOT_F32 covers the interpreter
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("Hq,Hkv,D", [(32, 8, 128), (9, 3, 64)])
def test_decode_real_shapes_gpu(Hq, Hkv, D, dtype):
    _check([3000, 9000, 50, 4100, 0], Hq, Hkv, D, 64, dtype=dtype, device="cuda")


def test_decode_bf16_interpreter():
    _check([33, 7], 4, 2, 32, 16, dtype=torch.bfloat16)
