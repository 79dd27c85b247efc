"""pack/unpack of one request's tiered KV: bytes equal to the torch reference, exact size,
and pack(unpack(buf)) == buf into different page ids."""
import pytest
import torch

from sgl_kvxfer.kernels import payload_bytes
from sgl_kvxfer.kernels.pack import (
    pack_layout,
    pack_tiered_kv,
    pack_tiered_kv_reference,
    unpack_tiered_kv,
    unpack_tiered_kv_reference,
)
from sgl_kvxfer.kernels.paged_layout import allocate_tiered_layer
from sgl_kvxfer.kernels.testing import build_random_cache

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _check(lens, H, D, G, PAGE, device=DEVICE):
    layer, tables, _ = build_random_cache([lens, (1, 1, 1)], H, D, G, PAGE, device=device)
    ids = tuple(tables.tables[t][0].contiguous() for t in range(3))
    buf = pack_tiered_kv(layer, ids, lens)
    assert buf.numel() == sum(lens[t] * H * 2 * payload_bytes(t, D, G) for t in range(3))
    assert buf.numel() == pack_layout(lens, H, D, G).total_bytes
    assert torch.equal(buf, pack_tiered_kv_reference(layer, ids, lens).to(device))
    # receiver: other pool sizes, other (reversed) page ids
    npg = [-(-n // PAGE) for n in lens]
    pools = tuple(n + 2 for n in npg)
    rx = allocate_tiered_layer(pools, PAGE, H, D, G, device=device, fill=0.0)
    rx_ref = allocate_tiered_layer(pools, PAGE, H, D, G, device=device, fill=0.0)
    rids = tuple(torch.arange(pools[t] - 1, pools[t] - 1 - npg[t], -1, dtype=torch.int32,
                              device=device) for t in range(3))
    unpack_tiered_kv(buf, rx, rids, lens)
    unpack_tiered_kv_reference(buf, rx_ref, rids, lens)
    for t in range(3):
        for a, b in zip(rx[t].tensors(), rx_ref[t].tensors()):
            assert torch.equal(a, b)
    assert torch.equal(pack_tiered_kv(rx, rids, lens), buf)


@pytest.mark.parametrize("lens", [(20, 5, 33), (0, 17, 0), (3, 0, 0), (0, 0, 0)])
def test_pack_small(lens):
    _check(lens, H=2, D=32, G=16, PAGE=16)


@pytest.mark.gpu
@pytest.mark.parametrize("H,D", [(8, 128), (3, 64)])
def test_pack_real_shapes_gpu(H, D):
    _check((1000, 3000, 8191), H, D, 32, 64, device="cuda")
