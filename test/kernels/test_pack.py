"""pack/unpack of one request's tiered KV: bytes equal to the torch reference, exact size,
and pack(unpack(buf)) == buf into different page ids."""
import pytest
import torch

from sgl_kvxfer.kernels import payload_bytes
from sgl_kvxfer.kernels.pack import (
    pack_layout,
    pack_tiered_kv,
    pack_tiered_kv_reference,
    pack_tiered_kv_slots,
    pack_tiered_kv_slots_reference,
    unpack_tiered_kv,
    unpack_tiered_kv_reference,
    unpack_tiered_kv_slots,
    unpack_tiered_kv_slots_reference,
)
from sgl_kvxfer.kernels.paged_layout import allocate_tiered_layer
from sgl_kvxfer.kernels.testing import build_random_cache, fill_random_pools

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


def _random_slots(layer, lens, seed, device):
    """Per tier: lens[t] distinct token rows (page * PAGE + offset) of the store, random order."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for t in range(3):
        rows = layer[t].num_pages * layer.page_size_of(t)
        assert lens[t] <= rows
        out.append(torch.randperm(rows, generator=g)[:lens[t]].to(torch.int32).to(device))
    return tuple(out)


def _check_slots(lens, H, D, G, pages, rx_pages, device=DEVICE):
    """Slot-addressed pack from a store of per-tier page sizes, unpack into another store with
    other page sizes at other slots, and pack again: the same bytes, equal to the references."""
    layer = _layer_of(tuple(-(-lens[t] // pages[t]) + 2 for t in range(3)), pages, H, D, G, device)
    fill_random_pools(layer, seed=3)
    slots = _random_slots(layer, lens, 1, device)
    buf = pack_tiered_kv_slots(layer, slots)
    assert buf.numel() == pack_layout(lens, H, D, G).total_bytes
    assert buf.numel() == sum(lens[t] * H * 2 * payload_bytes(t, D, G) for t in range(3))
    assert torch.equal(buf, pack_tiered_kv_slots_reference(layer, slots).to(device))
    pools = tuple(-(-lens[t] // rx_pages[t]) + 3 for t in range(3))
    rx, rx_ref = (_layer_of(pools, rx_pages, H, D, G, device) for _ in range(2))
    rslots = _random_slots(rx, lens, 2, device)
    unpack_tiered_kv_slots(buf, rx, rslots)
    unpack_tiered_kv_slots_reference(buf, rx_ref, rslots)
    for t in range(3):
        for a, b in zip(rx[t].tensors(), rx_ref[t].tensors()):
            assert torch.equal(a, b)
    assert torch.equal(pack_tiered_kv_slots(rx, rslots), buf)
    return layer, slots, buf


def _layer_of(pools, pages, H, D, G, device):
    from sgl_kvxfer.kernels.paged_layout import TieredKVLayer

    tiers = [allocate_tiered_layer(tuple(pools[t] if i == t else 1 for i in range(3)), pages[t], H, D, G,
                                   device=device, fill=0.0)[t] for t in range(3)]
    return TieredKVLayer(tuple(tiers), D, G)


@pytest.mark.parametrize("lens", [(20, 5, 33), (0, 17, 0), (3, 0, 0), (0, 0, 0), (40, 64, 70)])
@pytest.mark.parametrize("G", [32, 16])
def test_pack_slots_fp16_rows_paged_int(lens, G):
    _check_slots(lens, H=2, D=32, G=G, pages=(1, 16, 32), rx_pages=(1, 64, 16))


def test_pack_slots_matches_dense_pack_on_page_order_slots():
    """Slots listing a dense request's pages in order give pack_tiered_kv's bytes."""
    lens, PAGE = (20, 5, 33), 16
    layer, tables, _ = build_random_cache([lens, (1, 1, 1)], 2, 32, 16, PAGE)
    ids = tuple(tables.tables[t][0].contiguous() for t in range(3))
    slots = tuple((ids[t].long()[torch.arange(lens[t]) // PAGE] * PAGE + torch.arange(lens[t]) % PAGE)
                  .to(torch.int32).to(ids[t].device) for t in range(3))
    assert torch.equal(pack_tiered_kv_slots(layer, slots), pack_tiered_kv(layer, ids, lens))


@pytest.mark.gpu
@pytest.mark.parametrize("H,D,G", [(8, 128, 128), (3, 64, 32)])
def test_pack_slots_real_shapes_gpu(H, D, G):
    _check_slots((1000, 3000, 8191), H, D, G, pages=(1, 64, 256), rx_pages=(1, 16, 64), device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("H,D", [(8, 128), (3, 64)])
def test_pack_real_shapes_gpu(H, D):
    _check((1000, 3000, 8191), H, D, 32, 64, device="cuda")
