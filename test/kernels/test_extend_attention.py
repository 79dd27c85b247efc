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
from sgl_kvxfer.kernels.testing import build_random_cache

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ATOL = 4e-3  # kernel vs reference reading the same dequantized prefix


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
