"""decode_attention_filled vs the torch reference: filled and dense tables, per-tier page sizes
(the engine's fp16 rows at PAGE 1 beside paged int tiers), folded scales (G = D) and per-group
dequantization (G < D), GQA, splits, empty tiers / requests, bf16. CPU: Triton interpreter at
tiny shapes; GPU (-m gpu): real shapes."""
import pytest
import torch

from sgl_kvxfer.kernels.filled_decode_attention import (
    FilledDecodeConfig, FilledDecodePlan, decode_attention_filled, decode_attention_filled_reference,
    plan_filled_decode, with_config,
)
from sgl_kvxfer.kernels.testing import build_random_paged_cache

GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"


def _run(lens, Hq, Hkv, D, G, pages, dtype=torch.float16, filled=True, splits=None, config=None, seed=0):
    layer, tables = build_random_paged_cache(lens, Hkv, D, G, pages, dtype, DEV, seed=seed, filled=filled)
    g = torch.Generator().manual_seed(seed + 7)
    q = torch.randn(len(lens), Hq, D, generator=g).to(dtype).to(DEV)
    plan = None if splits is None else FilledDecodePlan(splits)
    got = decode_attention_filled(q, layer, tables, plan=plan, config=config)
    ref = decode_attention_filled_reference(q, layer, tables)
    return got.float(), ref.float()


def _close(got, ref, dtype):
    # folded scales skip the reference's fp16 rounding of each dequantized element, and P is
    # rounded to the model dtype before P @ V: a few model-dtype ulps of an O(1) output
    tol = 2e-2 if dtype == torch.float16 else 4e-2
    err = (got - ref).abs().max().item()
    assert err <= tol, f"max err {err:.3g} > {tol}"


@pytest.mark.parametrize("G", [64, 16])
@pytest.mark.parametrize("pages", [(1, 16, 16), (1, 32, 16), (16, 16, 16)])
def test_filled_mixed_tiers(G, pages):
    lens = [(5, 40, 23), (0, 17, 50), (30, 0, 0), (3, 9, 1)]
    got, ref = _run(lens, 8, 2, 64, G, pages)
    _close(got, ref, torch.float16)


@pytest.mark.parametrize("splits", [1, 2, 5])
def test_filled_splits_cross_every_tier(splits):
    lens = [(21, 70, 45), (2, 3, 90)]
    got, ref = _run(lens, 4, 1, 32, 32, (1, 16, 16), splits=splits)
    _close(got, ref, torch.float16)


def test_dense_tables_mixed_page_sizes():
    lens = [(7, 33, 20), (16, 16, 16)]
    got, ref = _run(lens, 4, 2, 32, 32, (1, 16, 32), filled=False)
    _close(got, ref, torch.float16)


def test_single_tier_and_empty_requests():
    for lens in ([(0, 40, 0), (0, 0, 0)], [(0, 0, 37), (0, 0, 0)], [(0, 0, 0)]):
        got, ref = _run(lens, 4, 2, 32, 32, (1, 16, 16), splits=3)
        _close(got, ref, torch.float16)
    got, _ = _run([(0, 0, 0)], 4, 2, 32, 32, (1, 16, 16))
    assert torch.count_nonzero(got) == 0  # a padding row attends nothing and returns 0


@pytest.mark.parametrize("Hq,Hkv", [(3, 1), (9, 3), (4, 4)])
def test_gqa_groups(Hq, Hkv):
    got, ref = _run([(4, 20, 30), (1, 2, 3)], Hq, Hkv, 32, 32, (1, 16, 16))
    _close(got, ref, torch.float16)


@pytest.mark.parametrize("G", [32, 16])
def test_bf16(G):
    got, ref = _run([(6, 30, 25)], 4, 2, 32, G, (1, 16, 16), dtype=torch.bfloat16)
    _close(got, ref, torch.bfloat16)


@pytest.mark.parametrize("prefetch", [True, False])
def test_knobs(prefetch):
    small = FilledDecodeConfig(tile16=16, tile8=32, tile4=16, num_stages=1, prefetch=prefetch)
    got, ref = _run([(9, 50, 41), (0, 5, 70)], 4, 2, 32, 32, (1, 16, 16), config=small, splits=2)
    _close(got, ref, torch.float16)


def test_large_pages_walked_in_tile_chunks():
    # int pages of 64 walked 16 slots a step (PAGE > TILE), partial pages anywhere in the list
    got, ref = _run([(3, 100, 70)], 4, 2, 32, 32, (1, 64, 64), splits=2)
    _close(got, ref, torch.float16)


def test_plan_is_host_only_and_bounded():
    cfg = FilledDecodeConfig(split_waves=4, min_split_tokens=512)
    # CPU counts 4 "SMs" (_tiles.num_sms): 16 programs wanted over 1 x 8 (request, kv-head) pairs
    assert plan_filled_decode(1, 8, 32768, "cpu", cfg).num_splits == 2
    assert plan_filled_decode(1, 1, 32768, "cpu", cfg).num_splits == 16
    assert plan_filled_decode(1, 1, 1500, "cpu", cfg).num_splits == 2  # >= 512 tokens a split
    assert plan_filled_decode(64, 8, 32768, "cpu", cfg).num_splits == 1


def test_config_validation():
    with pytest.raises(ValueError, match="tile8"):
        FilledDecodeConfig(tile8=24)
    assert with_config(tile4=64).tile4 == 64


@pytest.mark.gpu
@pytest.mark.parametrize("Hq,Hkv,D", [(32, 8, 128), (9, 3, 64)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("G", [None, 32])
def test_filled_real_shapes_gpu(Hq, Hkv, D, dtype, G):
    lens = [(70, 2000, 1500), (5, 0, 4000), (0, 3000, 0), (1, 1, 1)]
    got, ref = _run(lens, Hq, Hkv, D, G or D, (1, 64, 64), dtype=dtype)
    _close(got, ref, dtype)
