"""extend_attention_tiered vs the torch reference (tiered prefix + causal fp16 new tokens)."""
import pytest
import torch

from sgl_kvxfer.kernels.extend_attention import (
    extend_attention_tiered,
    extend_attention_tiered_reference,
)
from sgl_kvxfer.kernels.testing import build_random_cache

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ATOL = 4e-3  # kernel vs reference reading the same dequantized prefix


def _check(prefix_lens, new_lens, Hq, Hkv, D, G, PAGE, dtype=torch.float16, device=DEVICE):
    layer, tables, _ = build_random_cache(prefix_lens, Hkv, D, G, PAGE, dtype, device, seed=5)
    g = torch.Generator().manual_seed(11)
    N = sum(new_lens)
    q = torch.randn(N, Hq, D, generator=g).to(dtype).to(device)
    k = torch.randn(N, Hkv, D, generator=g).to(dtype).to(device)
    v = torch.randn(N, Hkv, D, generator=g).to(dtype).to(device)
    ind = torch.tensor([0] + new_lens, dtype=torch.int32).cumsum(0).to(torch.int32).to(device)
    o = extend_attention_tiered(q, k, v, ind, layer, tables)
    r = extend_attention_tiered_reference(q, k, v, ind, layer, tables)
    torch.testing.assert_close(o.float(), r.float(), atol=ATOL, rtol=0)


def test_extend_mixed_prefix_small():
    _check([(17, 5, 20), (0, 0, 0), (2, 0, 16)], [5, 9, 3], Hq=4, Hkv=2, D=32, G=16, PAGE=16)


def test_extend_no_prefix_is_causal_self_attention():
    _check([(0, 0, 0)], [21], Hq=3, Hkv=1, D=16, G=16, PAGE=16)


def test_extend_empty_request_in_batch():
    _check([(3, 3, 3), (1, 1, 1)], [0, 6], Hq=2, Hkv=2, D=32, G=32, PAGE=16)


@pytest.mark.gpu
@pytest.mark.parametrize("Hq,Hkv,D", [(32, 8, 128), (9, 3, 64)])
def test_extend_real_shapes_gpu(Hq, Hkv, D):
    _check([(500, 1000, 2000), (0, 0, 0), (64, 640, 0)], [700, 1024, 33], Hq, Hkv, D, 32, 64,
           device="cuda")
