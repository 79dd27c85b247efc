"""decode_attention_gather (slot-granular tier stores, PAGE = 1) vs the dequantize-then-attend
torch reference, plus per-tier accuracy against attention on the original K/V.

The random caches give every request its rows in a random order (testing.random_block_tables
at page size 1), so tiles gather non-adjacent rows; small tokens_per_split values make splits
start and end inside tiers and span tier boundaries."""

import pytest
import torch

from sgl_kvxfer.kernels.gather_decode_attention import (
    decode_attention_gather,
    decode_attention_gather_reference,
    plan_gather_splits,
)
from sgl_kvxfer.kernels.testing import TIER_ATOL, build_random_cache, exact_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# max |kernel - reference|, both reading the same dequantized values: fp16 P in the PV dot (GPU),
# bf16: one output ulp at |o| ~ 1 is 2^-7 (the reference rounds fp32 -> bf16 once, too)
KERNEL_ATOL = {torch.float16: 4e-3, torch.bfloat16: 1.6e-2}


def _check(lens, Hq, Hkv, D, G, mix, tps=None, dtype=torch.float16, device=DEVICE, **kw):
    layer, tables, (k, v) = build_random_cache(lens, Hkv, D, G, 1, dtype, device, seed=len(lens) + D)
    q = torch.randn(len(lens), Hq, D, generator=torch.Generator().manual_seed(3)).to(dtype).to(device)
    max_tokens = max(sum(l) for l in lens)
    o = decode_attention_gather(q, layer, tables, max_tokens=max_tokens, tokens_per_split=tps, **kw)
    r = decode_attention_gather_reference(q, layer, tables)
    assert o.shape == q.shape and o.dtype == q.dtype
    torch.testing.assert_close(o.float(), r.float(), atol=KERNEL_ATOL[dtype], rtol=0)
    ex = exact_attention(q, k, v, lens, Hq // Hkv)
    for b, l in enumerate(lens):
        if sum(l) == 0:  # no keys: the merge returns zeros
            assert not o[b].any()
    err = (o.float() - ex).abs().max().item()
    assert err < TIER_ATOL[mix] + (KERNEL_ATOL[dtype] if dtype == torch.bfloat16 else 0), (mix, err)


@pytest.mark.parametrize(
    "mix,lens",
    [
        ("fp16", [(37, 0, 0), (5, 0, 0)]),
        ("int8", [(0, 40, 0), (0, 3, 0)]),
        ("int4", [(0, 0, 33), (0, 0, 16)]),
        ("mixed", [(17, 5, 40), (0, 0, 0), (1, 33, 2)]),
    ],
)
def test_gather_tiers_small(mix, lens):
    _check(lens, Hq=4, Hkv=2, D=32, G=16, mix=mix, tps=20)


@pytest.mark.parametrize("Hq,Hkv,D,G", [(3, 1, 64, 32), (2, 2, 16, 16), (8, 2, 32, 32)])
def test_gather_gqa_shapes_and_auto_split(Hq, Hkv, D, G):
    _check([(9, 20, 18), (0, 7, 0)], Hq=Hq, Hkv=Hkv, D=D, G=G, mix="mixed")


def test_gather_bf16_cpu_dot_in_fp32():
    """bf16 models: on the interpreter the dot runs in fp32 (Triton 3.9 CPU bf16 dot bug)."""
    _check([(3, 17, 5), (20, 0, 9)], Hq=4, Hkv=2, D=32, G=16, mix="mixed", tps=16,
           dtype=torch.bfloat16)


@pytest.mark.parametrize("prefetch,fast", [(False, True), (True, False)])
def test_gather_knobs_and_weights_match_default(prefetch, fast):
    layer, tables, _ = build_random_cache([(2, 40, 35)], 1, 32, 16, 1, device=DEVICE, seed=9)
    q = torch.randn(1, 2, 32, generator=torch.Generator().manual_seed(2)).half().to(DEVICE)
    a = decode_attention_gather(q, layer, tables, max_tokens=77, tokens_per_split=32)
    b = decode_attention_gather(q, layer, tables, max_tokens=77, tokens_per_split=24, tier_weights=(3, 2, 1),
                                prefetch=prefetch, fast_dequant=fast)
    r = decode_attention_gather_reference(q, layer, tables)
    torch.testing.assert_close(a.float(), b.float(), atol=2e-3, rtol=0)
    torch.testing.assert_close(b.float(), r.float(), atol=KERNEL_ATOL[torch.float16], rtol=0)


def test_gather_duplicate_and_padding_rows_are_plain_keys():
    """A table entry is one key: the same row twice counts twice (the engine never does this,
    but it pins down that nothing dedups or skips row 0)."""
    layer, tables, _ = build_random_cache([(6, 0, 0)], 1, 16, 16, 1, device=DEVICE, seed=4)
    t16 = tables.tables[0].clone()
    t16[0, 5] = t16[0, 4]
    tables.tables = (t16, tables.tables[1], tables.tables[2])
    q = torch.randn(1, 1, 16, generator=torch.Generator().manual_seed(5)).half().to(DEVICE)
    o = decode_attention_gather(q, layer, tables, max_tokens=6)
    r = decode_attention_gather_reference(q, layer, tables)
    torch.testing.assert_close(o.float(), r.float(), atol=KERNEL_ATOL[torch.float16], rtol=0)


def test_plan_covers_the_cost_line():
    """The grid must cover every tile of the dearest request: S * split_cost >= cost bound."""
    for max_tokens, bn, w, tps in ((0, 16, (1, 1, 1), None), (100, 16, (1, 1, 1), 7), (4096, 64, (4, 3, 2), None)):
        cost, S = plan_gather_splits(max_tokens, 2, 2, torch.device("cpu"), bn, w, tps)
        assert S * cost >= (-(-max_tokens // bn) + 2) * bn * max(w) and S >= 1


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("Hq,Hkv,D", [(32, 8, 128), (9, 3, 64)])
@pytest.mark.parametrize("mix", ["fp16", "int8", "int4", "mixed"])
def test_gather_real_shapes_gpu(Hq, Hkv, D, mix, dtype):
    base = [4096, 3000, 50, 1100]
    lens = {
        "fp16": [(n, 0, 0) for n in base],
        "int8": [(0, n, 0) for n in base],
        "int4": [(0, 0, n) for n in base],
        "mixed": [(n // 5, 2 * n // 5, n - n // 5 - 2 * n // 5) for n in base],
    }[mix]
    _check(lens, Hq, Hkv, D, 32, mix, dtype=dtype, device="cuda")


@pytest.mark.gpu
def test_gather_many_splits_and_empty_request_gpu():
    _check([(700, 2100, 1300), (0, 0, 0), (64, 0, 1)], 32, 8, 128, 32, "mixed", tps=256, device="cuda")
