"""extend_attention_tiered vs the torch reference (tiered prefix + causal fp16 new tokens)."""
import pytest
import torch

from sgl_kvxfer.kernels.extend_attention import (
    build_tiles,
    extend_attention_tiered,
    extend_attention_tiered_reference,
    graph_block_tokens,
    max_tiles,
)
from sgl_kvxfer.kernels.testing import build_random_cache, build_random_paged_cache

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ATOL = 4e-3  # kernel vs reference reading the same dequantized prefix
ATOL_BF16 = 1.6e-2  # one bf16 output ulp (the interpreter truncates fp32 -> bf16 casts)


def _check(prefix_lens, new_lens, Hq, Hkv, D, G, PAGE, dtype=torch.float16, device=DEVICE, tiled=False):
    layer, tables, _ = build_random_cache(prefix_lens, Hkv, D, G, PAGE, dtype, device, seed=5)
    g = torch.Generator().manual_seed(11)
    N = sum(new_lens)
    q = torch.randn(N, Hq, D, generator=g).to(dtype).to(device)
    k = torch.randn(N, Hkv, D, generator=g).to(dtype).to(device)
    v = torch.randn(N, Hkv, D, generator=g).to(dtype).to(device)
    ind = torch.tensor([0] + new_lens, dtype=torch.int32).cumsum(0).to(torch.int32).to(device)
    tiles = None
    if tiled:  # as graph prefill launches it: more tiles than needed, spare ones on an empty request
        assert new_lens[-1] == 0, "the last request is the spare one"
        bt = graph_block_tokens(Hq // Hkv)
        req, blk = build_tiles(new_lens, bt, max_tiles(N + 3 * bt, len(new_lens), bt), len(new_lens) - 1)
        tiles = (torch.from_numpy(req).to(device), torch.from_numpy(blk).to(device))
    o = extend_attention_tiered(q, k, v, ind, layer, tables, tiles=tiles)
    r = extend_attention_tiered_reference(q, k, v, ind, layer, tables)
    torch.testing.assert_close(o.float(), r.float(), atol=ATOL, rtol=0)


def _inputs(new_lens, Hq, Hkv, D, dtype, device, seed=11):
    g = torch.Generator().manual_seed(seed)
    N = sum(new_lens)
    q, k, v = (torch.randn(N, h, D, generator=g).to(dtype).to(device) for h in (Hq, Hkv, Hkv))
    ind = torch.tensor([0] + list(new_lens), dtype=torch.int32).cumsum(0).to(torch.int32).to(device)
    return q, k, v, ind


def _check_paged(prefix_lens, new_lens, Hq, Hkv, D, G, pages, filled=True, dtype=torch.float16,
                 device=DEVICE, tiled=False, seed=5, **kw):
    """Per-tier page sizes (fp16 rows at PAGE 1 and paged int tiers) and the filled form."""
    layer, tables = build_random_paged_cache(prefix_lens, Hkv, D, G, pages, dtype, device, seed=seed,
                                             filled=filled)
    q, k, v, ind = _inputs(new_lens, Hq, Hkv, D, dtype, device)
    tiles = None
    if tiled:
        assert new_lens[-1] == 0, "the last request is the spare one"
        bt = graph_block_tokens(Hq // Hkv)
        req, blk = build_tiles(new_lens, bt, max_tiles(sum(new_lens) + 3 * bt, len(new_lens), bt),
                               len(new_lens) - 1)
        tiles = (torch.from_numpy(req).to(device), torch.from_numpy(blk).to(device))
    o = extend_attention_tiered(q, k, v, ind, layer, tables, tiles=tiles, **kw)
    r = extend_attention_tiered_reference(q, k, v, ind, layer, tables)
    atol = ATOL_BF16 if dtype == torch.bfloat16 else ATOL
    torch.testing.assert_close(o.float(), r.float(), atol=atol, rtol=0)
    return o


# fp16 rows (PAGE 1) + paged int tiers, filled tables with partial / empty pages in the middle,
# G = D (folded scales) and G < D (dequantized tiles), GQA, several requests.
@pytest.mark.parametrize("G", [32, 16])
@pytest.mark.parametrize("pages", [(1, 16, 16), (1, 32, 16), (1, 16, 64)])
def test_extend_filled_fp16_rows_paged_int(G, pages):
    _check_paged([(21, 37, 50), (0, 0, 0), (5, 0, 70), (40, 20, 0)], [7, 12, 3, 17],
                 Hq=4, Hkv=2, D=32, G=G, pages=pages)


@pytest.mark.parametrize("pages", [(16, 16, 16), (4, 8, 16), (1, 1, 1), (32, 64, 16)])
def test_extend_filled_page_sizes(pages):
    _check_paged([(30, 35, 40), (9, 60, 3)], [5, 20], Hq=3, Hkv=1, D=32, G=32, pages=pages)


@pytest.mark.parametrize("G", [32, 16])
def test_extend_dense_tables_mixed_page_sizes(G):
    _check_paged([(21, 37, 50), (3, 0, 70)], [9, 4], Hq=4, Hkv=2, D=32, G=G, pages=(1, 16, 64), filled=False)


def test_extend_filled_empty_tiers_and_prefixes():
    _check_paged([(0, 0, 0), (0, 0, 0)], [6, 11], Hq=2, Hkv=2, D=16, G=16, pages=(1, 16, 16))
    _check_paged([(0, 33, 0), (0, 0, 0), (0, 5, 0)], [6, 0, 4], Hq=8, Hkv=2, D=16, G=16, pages=(1, 16, 16))


@pytest.mark.parametrize("G", [64, 16])
def test_extend_filled_head_dim_64_gqa(G):
    _check_paged([(17, 26, 45), (50, 2, 7)], [13, 2], Hq=6, Hkv=2, D=64, G=G, pages=(1, 16, 32))


def test_extend_fold_scales_matches_dequantized_tiles():
    args = ([(21, 37, 50), (5, 19, 70)], [7, 12])
    kw = dict(Hq=4, Hkv=2, D=32, G=32, pages=(1, 16, 16))
    a = _check_paged(*args, **kw, fold_scales=True)
    b = _check_paged(*args, **kw, fold_scales=False)
    torch.testing.assert_close(a.float(), b.float(), atol=ATOL, rtol=0)


@pytest.mark.parametrize("G", [32, 16])
def test_extend_filled_bf16(G):
    _check_paged([(21, 37, 50), (3, 0, 9)], [7, 12], Hq=4, Hkv=2, D=32, G=G, pages=(1, 16, 16),
                 dtype=torch.bfloat16)


def test_extend_filled_tiled_launch():
    _check_paged([(21, 37, 50), (0, 0, 0), (5, 20, 3), (0, 0, 0)], [5, 19, 3, 0], Hq=6, Hkv=2, D=32, G=32,
                 pages=(1, 16, 32), tiled=True)


# int_tiers=False: the one PASS_FP16 launch (the paged fp16 pool; a prefix known to be all fp16)
@pytest.mark.parametrize("pages,filled", [((1, 16, 16), True), ((16, 16, 16), False), ((64, 16, 16), True)])
def test_extend_fp16_only_pass(pages, filled):
    _check_paged([(45, 0, 0), (0, 0, 0), (7, 0, 0)], [9, 20, 3], Hq=4, Hkv=2, D=32, G=32, pages=pages,
                 filled=filled, int_tiers=False)


def test_extend_fp16_only_pass_rejects_int_tokens():
    with pytest.raises(ValueError, match="int_tiers=False"):
        _check_paged([(5, 3, 0)], [4], Hq=2, Hkv=1, D=16, G=16, pages=(1, 16, 16), int_tiers=False)


def test_extend_int_pass_merges_per_request():
    """Requests with and without int tokens in one batch: PASS_INT merges only the first kind and
    leaves the others' PASS_FP16 rows as they were."""
    args = ([(9, 0, 0), (4, 30, 17), (0, 0, 0), (0, 0, 21)], [6, 8, 5, 3])
    kw = dict(Hq=4, Hkv=2, D=32, G=32, pages=(1, 16, 16))
    both = _check_paged(*args, **kw)
    layer, tables = build_random_paged_cache(args[0], 2, 32, 32, (1, 16, 16), torch.float16, DEVICE, seed=5,
                                             filled=True)
    q, k, v, ind = _inputs(args[1], 4, 2, 32, torch.float16, DEVICE)
    for t in (1, 2):  # the same batch with every int tier hidden: only requests 0 and 2 keep their rows
        tables.num_pages[t].zero_()
    fp16_only = extend_attention_tiered(q, k, v, ind, layer, tables, int_tiers=False)
    for lo, hi in ((0, 6), (14, 19)):
        torch.testing.assert_close(both[lo:hi], fp16_only[lo:hi], atol=ATOL, rtol=0)
    assert (both[6:14] - fp16_only[6:14]).abs().max() > 0.05


def test_extend_mixed_prefix_small():
    _check([(17, 5, 20), (0, 0, 0), (2, 0, 16)], [5, 9, 3], Hq=4, Hkv=2, D=32, G=16, PAGE=16)


def test_extend_no_prefix_is_causal_self_attention():
    _check([(0, 0, 0)], [21], Hq=3, Hkv=1, D=16, G=16, PAGE=16)


def test_extend_empty_request_in_batch():
    _check([(3, 3, 3), (1, 1, 1)], [0, 6], Hq=2, Hkv=2, D=32, G=32, PAGE=16)


def test_extend_tiled_launch_matches_reference():
    _check([(17, 5, 20), (0, 0, 0), (2, 0, 16), (0, 0, 0)], [5, 19, 3, 0], Hq=6, Hkv=2, D=32, G=16, PAGE=16,
           tiled=True)


def test_build_tiles_lists_every_block_once_deepest_first():
    req, blk = build_tiles([5, 0, 17, 8], 8, max_tiles(30, 4, 8), spare_req=1)
    assert len(req) == max_tiles(30, 4, 8) == 8
    live = sorted(zip(req[:5].tolist(), blk[:5].tolist()))
    assert live == [(0, 0), (2, 0), (2, 1), (2, 2), (3, 0)]
    assert blk[0] == 2 and list(blk[:5]) == sorted(blk[:5], reverse=True)
    assert (req[5:] == 1).all() and (blk[5:] == 0).all()
    with pytest.raises(AssertionError):
        build_tiles([64], 8, 7, spare_req=1)


@pytest.mark.gpu
@pytest.mark.parametrize("Hq,Hkv,D", [(32, 8, 128), (9, 3, 64)])
@pytest.mark.parametrize("tiled", [False, True])
def test_extend_real_shapes_gpu(Hq, Hkv, D, tiled):
    prefix, new = [(500, 1000, 2000), (0, 0, 0), (64, 640, 0)], [700, 1024, 33]
    if tiled:
        prefix, new = prefix + [(0, 0, 0)], new + [0]
    _check(prefix, new, Hq, Hkv, D, 32, 64, device="cuda", tiled=tiled)


@pytest.mark.gpu
@pytest.mark.parametrize("Hq,Hkv,D", [(32, 8, 128), (9, 3, 64)])
@pytest.mark.parametrize("G,pages", [("D", (1, 64, 64)), (32, (1, 16, 256)), ("D", (1, 128, 32))])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_extend_filled_real_shapes_gpu(Hq, Hkv, D, G, pages, dtype):
    G = D if G == "D" else G
    prefix, new = [(500, 1000, 2000), (0, 0, 0), (64, 640, 0), (0, 3000, 1500)], [700, 1024, 33, 129]
    _check_paged(prefix, new, Hq, Hkv, D, G, pages, dtype=dtype, device="cuda")
    _check_paged(prefix + [(0, 0, 0)], new + [0], Hq, Hkv, D, G, pages, dtype=dtype, device="cuda", tiled=True)


@pytest.mark.gpu
@pytest.mark.parametrize("Hq,Hkv,D", [(32, 8, 128), (9, 3, 64)])
@pytest.mark.parametrize("pages,filled,dtype", [((1, 64, 64), True, torch.bfloat16),
                                                 ((64, 64, 64), False, torch.float16)])
def test_extend_fp16_only_real_shapes_gpu(Hq, Hkv, D, pages, filled, dtype):
    """PASS_FP16 alone at its 64-128-row configs (wgmma on sm_90)."""
    prefix, new = [(3000, 0, 0), (0, 0, 0), (640, 0, 0), (4500, 0, 0)], [700, 1024, 33, 129]
    _check_paged(prefix, new, Hq, Hkv, D, D, pages, filled=filled, dtype=dtype, device="cuda",
                 int_tiers=False, max_prefix_len=4500)
