"""Paged KV (--page-size > 1): allocator, radix page alignment, request lifecycle invariants."""
import pytest
import torch

from sgl_kvxfer.config import EngineConfig
from sgl_kvxfer.mem_cache import create_slot_allocator
from sgl_kvxfer.mem_cache.allocator import TokenSlotAllocator
from sgl_kvxfer.mem_cache.paged_allocator import PagedTokenSlotAllocator, pages_needed
from sgl_kvxfer.mem_cache.paged_fp16_pool import PagedFp16KVPool
from sgl_kvxfer.mem_cache.radix_cache import RadixCache
from sgl_kvxfer.mem_cache.req_to_token import ReqToTokenPool
from sgl_kvxfer.message import TokenizedGenerateReq
from sgl_kvxfer.sampling.params import SamplingParams
from sgl_kvxfer.scheduler.kv_lifecycle import KVLifecycle
from sgl_kvxfer.scheduler.policy import PrefillAdder
from sgl_kvxfer.scheduler.req import Req

P = 4


def test_allocator_pages_and_padding():
    alloc = PagedTokenSlotAllocator(size=18, page_size=P)  # 4 whole pages; page 0 is padding
    assert alloc.size == 16 and alloc.available_size() == 16
    slots = alloc.alloc(6)  # 2 pages, the second partial
    assert slots.numel() == 6 and bool((slots >= P).all())
    assert slots.tolist()[:4] == list(range(slots[0], slots[0] + 4)) and int(slots[0]) % P == 0
    assert int(slots[4]) % P == 0 and alloc.available_size() == 8
    assert alloc.alloc_pages(3) is None and alloc.available_size() == 8  # no partial allocation
    alloc.free(slots)
    alloc.debug_check()
    assert alloc.available_size() == 16
    pool = PagedFp16KVPool(64, 1, 1, 16, torch.float32, "cpu", page_size=16)
    assert isinstance(create_slot_allocator(EngineConfig(attention_backend="torch"), pool, "cpu"), TokenSlotAllocator)
    paged = create_slot_allocator(EngineConfig(attention_backend="torch", page_size=16), pool, "cpu")
    assert isinstance(paged, PagedTokenSlotAllocator) and paged.size == 64


def test_allocator_extend_continues_partial_pages():
    alloc = PagedTokenSlotAllocator(size=40, page_size=P)
    first = alloc.alloc(6)  # row A holds positions 0..5; last page has room for 2
    # Row A adds 5 (2 on its page, 3 on a fresh one); row B (empty) adds 2.
    out = alloc.alloc_extend(torch.tensor([int(first[5]), 0]), [6, 0], [5, 2])
    assert out[:2].tolist() == [int(first[5]) + 1, int(first[5]) + 2]
    assert int(out[2]) % P == 0 and out[2:5].tolist() == list(range(int(out[2]), int(out[2]) + 3))
    assert int(out[5]) % P == 0 and int(out[6]) == int(out[5]) + 1
    assert len({int(s) // P for s in out[2:]}) == 2  # two fresh pages, distinct
    assert pages_needed([6, 0], [5, 2], P) == 2 and pages_needed([4], [1], P) == 1
    assert pages_needed([5], [3], P) == 0


def test_double_free_is_caught():
    alloc = PagedTokenSlotAllocator(size=16, page_size=P)
    slots = alloc.alloc(P)
    alloc.free(slots)
    alloc.free(slots)
    with pytest.raises(AssertionError, match="double free"):
        alloc.debug_check()


def test_radix_matches_and_inserts_whole_pages_only():
    alloc = PagedTokenSlotAllocator(size=64, page_size=P)
    tree = RadixCache(alloc, page_size=P)
    key = list(range(10))
    slots = alloc.alloc(10)
    assert tree.insert(key, slots) == 0
    assert tree.evictable_size() == 8  # the partial last page (2 tokens) is not cached
    alloc.free(slots[8:])
    m, _ = tree.match_prefix(key[:7] + [99])  # 7 common tokens -> 1 whole page
    assert m.tolist() == slots[:4].tolist()
    # Same first token, different first page: a sibling, not a split inside page 0.
    other = [0, 1, 2, 50, 51, 52, 53, 54]
    s2 = alloc.alloc(8)
    assert tree.insert(other, s2) == 0
    assert tree.match_prefix(other)[0].tolist() == s2.tolist()
    assert tree.match_prefix(key)[0].tolist() == slots[:8].tolist()
    # A key sharing 6 tokens splits the 8-token edge at 4 (a page boundary).
    s3 = alloc.alloc(8)
    present = tree.insert(key[:6] + [70, 71, 72, 73], s3)
    assert present == 4
    alloc.free(s3[:4])  # duplicates stay with the caller
    for node in _nodes(tree):
        assert len(node.key) % P == 0 and int(node.value[0]) % P == 0
    cached = tree.evictable_size()
    assert cached == 8 + 8 + 4  # key's 2 pages, other's 2 pages, the new 1-page branch
    assert tree.evict(1000) == cached and tree.evictable_size() == 0
    alloc.debug_check()
    assert alloc.available_size() == alloc.size


def _nodes(tree):
    stack = list(tree.root.children.values())
    while stack:
        node = stack.pop()
        yield node
        stack.extend(node.children.values())


def _req(ids, rid="r", max_new=8):
    return Req(TokenizedGenerateReq(rid=rid, input_ids=ids, sampling=SamplingParams(max_new_tokens=max_new)), 0)


def _extend(lc, req, n):
    """What the scheduler does around one forward: alloc, prepare_batch's row write, kv_len."""
    loc = lc.alloc([req], [n])
    assert loc is not None
    lc.req_to_token.write(req.req_pool_idx, req.kv_len, loc)
    req.kv_len += n


def _decode(lc, reqs):
    loc = lc.alloc(reqs)
    assert loc is not None
    for i, r in enumerate(reqs):
        lc.req_to_token.write(r.req_pool_idx, r.kv_len, loc[i : i + 1])
        r.kv_len += 1
        r.output_ids.append(7)


def _check_row(lc, req):
    """slot(pos) = page(pos // P) * P + pos % P over the whole row."""
    row = lc.req_to_token.read(req.req_pool_idx, req.kv_len)
    pos = torch.arange(req.kv_len)
    assert bool((row % P == pos % P).all()), row
    assert bool((row // P == row[pos - pos % P] // P).all()), row
    assert bool((row >= P).all())  # never the padding page


def _lifecycle(size=64, radix=True):
    alloc = PagedTokenSlotAllocator(size, P)
    return KVLifecycle(alloc, ReqToTokenPool(4, 64), use_radix=radix)


@pytest.mark.parametrize("radix", [True, False])
def test_lifecycle_keeps_rows_page_consistent_and_frees_everything(radix):
    lc = _lifecycle(radix=radix)
    a = _req(list(range(100, 111)), "a")  # 11 prompt tokens
    assert lc.admit(a)
    _extend(lc, a, 6)  # chunked prefill: 6 then 5 (the second continues a's partial page)
    _extend(lc, a, 5)
    _check_row(lc, a)
    lc.cache(a, finished=False)
    assert a.prefix_len == (8 if radix else 0) and a.kv_len == 11
    _check_row(lc, a)
    for _ in range(6):  # decode across a page boundary (11 -> 17)
        _decode(lc, [a])
        _check_row(lc, a)
    b = _req(list(range(100, 111)) + [5, 6], "b")
    assert lc.admit(b)
    assert b.prefix_len == (8 if radix else 0)  # whole pages of a's cached prompt
    _extend(lc, b, len(b.fill_ids) - b.kv_len)
    _check_row(lc, b)
    lc.cache(b, finished=False)
    _decode(lc, [a, b])
    _check_row(lc, a)
    _check_row(lc, b)
    lc.cache(a, finished=True)
    lc.release(b)  # retraction: private pages (incl. the partial one) freed, lock dropped
    if radix:
        assert lc.tree.protected_size() == 0
        lc.flush()
    lc.allocator.debug_check()
    assert lc.allocator.available_size() == lc.allocator.size


def test_lifecycle_alloc_fails_cleanly_and_page1_unchanged():
    lc = _lifecycle(size=16)  # 4 pages
    a = _req(list(range(30)), "a")
    assert lc.admit(a)
    assert lc.alloc([a], [17]) is None  # needs 5 pages
    assert lc.allocator.available_size() == 16
    lc1 = KVLifecycle(TokenSlotAllocator(32), ReqToTokenPool(2, 32), use_radix=True)
    r = _req([1, 2, 3], "p1")
    assert lc1.admit(r)
    assert lc1.alloc([r], [3]).tolist() == [1, 2, 3]  # token-granular, as before


def test_prefill_adder_charges_page_slack():
    adder = PrefillAdder(token_budget=1000, chunk_size=None, free_tokens=100, max_new_reqs=8, page_size=16)
    assert adder.try_add(90, 0) is None  # 90 + 15 slack > 100
    assert adder.try_add(85, 0).extend_len == 85


def test_paged_pool_set_get_roundtrip():
    pool = PagedFp16KVPool(32, num_layers=1, num_kv_heads=2, head_dim=8, dtype=torch.float32,
                           device="cpu", page_size=16)
    assert pool.k_buffer[0].shape == (4, 2, 16, 8) and bool((pool.k_buffer[0][0] == 0).all())
    assert pool.scratch_slot == 3 * 16  # page 3: after the allocator's pages 1..2
    slots = torch.tensor([16, 17, 40])
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    pool.set_kv(0, slots, k, v)
    assert torch.equal(pool.k_buffer[0][2, :, 8], k[2])  # slot 40 = page 2, offset 8 (head-major)
    gk, gv = pool.get_kv(0, slots.view(1, 3))
    assert gk.shape == (1, 3, 2, 8) and torch.equal(gk[0], k) and torch.equal(gv[0], v)
