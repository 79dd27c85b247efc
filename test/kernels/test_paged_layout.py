"""TieredBlockTables' filled form: the reference gather reads each listed page's prefix."""
import torch

from sgl_kvxfer.kernels.paged_layout import TieredBlockTables, allocate_tiered_layer, gather_request_kv


def _layer(page=4):
    torch.manual_seed(0)
    layer = allocate_tiered_layer((6, 6, 6), page, 2, 16, group_size=16, fill=0.0)
    for tp in layer.pages:
        for x in tp.tensors():
            x.copy_(torch.randint(0, 200, x.shape).to(x.dtype) if x.dtype == torch.uint8 else torch.randn(x.shape))
    return layer


def _i32(x):
    return torch.tensor(x, dtype=torch.int32)


def test_filled_tables_with_full_fills_match_dense_tables():
    layer = _layer()
    pages = (_i32([[3, 1, 0]]), _i32([[2, 5, 0]]), _i32([[4, 0, 0]]))
    lens = (_i32([7]), _i32([8]), _i32([2]))
    dense = TieredBlockTables(pages, lens)
    fills = (_i32([[4, 3, 0]]), _i32([[4, 4, 0]]), _i32([[2, 0, 0]]))
    filled = TieredBlockTables(pages, lens, fills, (_i32([2]), _i32([2]), _i32([1])))
    for a, b in zip(gather_request_kv(layer, dense, 0), gather_request_kv(layer, filled, 0)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_filled_tables_skip_each_page_tail():
    layer = _layer()
    pages = (_i32([[3, 1]]), _i32([[0, 0]]), _i32([[0, 0]]))
    fills = (_i32([[2, 3]]), _i32([[0, 0]]), _i32([[0, 0]]))
    tables = TieredBlockTables(pages, (_i32([5]), _i32([0]), _i32([0])), fills, (_i32([2]), _i32([0]), _i32([0])))
    k, v = gather_request_kv(layer, tables, 0)
    want = torch.cat([layer[0].k[3, :, :2], layer[0].k[1, :, :3]], dim=1).permute(1, 0, 2).float()
    torch.testing.assert_close(k, want, rtol=0, atol=0)
    assert v.shape == k.shape == (5, 2, 16)
