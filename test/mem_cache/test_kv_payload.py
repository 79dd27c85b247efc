"""The transfer layer (mem_cache/kv_payload.py): a segment packed from one pool and unpacked
into another holds the same KV, in every direction the PD path uses.

- tiered -> tiered at the stored tiers: the codes travel as they are (bitwise equal stores);
- tiered -> fp16 pool: dequantized on arrival (equal to the tiered pool's own get_kv);
- fp16 -> fp16 at the model dtype: bitwise equal; fp16 -> tiered at int8 (the streamed
  variant): equal to quantizing the fp16 values with the codec;
- the byte count is the pack format's, and dropped tokens send nothing.
"""
import pytest
import torch

from sgl_kvxfer.kernels.tier_codec import dequantize, quantize
from sgl_kvxfer.mem_cache.allocator import TokenSlotAllocator
from sgl_kvxfer.mem_cache.fp16_pool import Fp16KVPool
from sgl_kvxfer.mem_cache.kv_payload import (pack_segment, pack_segment_reference, segment_layout, tier_counts,
                                             unpack_segment, wire_tier_of)
from sgl_kvxfer.mem_cache.tier_plan import TierStorePlan
from sgl_kvxfer.mem_cache.tiered_allocator import TieredSlotAllocator
from sgl_kvxfer.mem_cache.tiered_pool import TieredKVPool
from sgl_kvxfer.spectrum.tiers import TIER_DROP, TIER_FP16, TIER_INT4, TIER_INT8

L, H, D, G = 3, 2, 64, 32
PAGE = 4  # int-store page (the engine's is >= 16): tokens span pages, partial last pages


def tiered(dtype=torch.float16):
    pool = TieredKVPool(64, L, H, D, dtype, "cpu", TierStorePlan(32, 32, 32), group_size=G, page_size=PAGE)
    return pool, TieredSlotAllocator(pool, "cpu")


def fp16(dtype=torch.float16):
    pool = Fp16KVPool(64, L, H, D, dtype, "cpu")
    return pool, TokenSlotAllocator(64, "cpu")


def fill(pool, alloc, n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    slots = alloc.alloc(n)
    kv = [(torch.randn(n, H, D, generator=gen).to(pool.dtype), torch.randn(n, H, D, generator=gen).to(pool.dtype))
          for _ in range(L)]
    for layer, (k, v) in enumerate(kv):
        pool.set_kv(layer, slots, k, v)
    return slots, kv


def alloc_like(pool, alloc, lens):
    """Slots per wire tier in the receiving pool (a tiered pool: in that tier's store)."""
    if isinstance(alloc, TieredSlotAllocator):
        return (alloc.alloc(lens[0]), alloc.alloc_tier(TIER_INT8, lens[1]), alloc.alloc_tier(TIER_INT4, lens[2]))
    return tuple(alloc.alloc(n) if n else torch.empty(0, dtype=torch.int64) for n in lens)


def transfer(src, slots, wire, dst, dst_alloc):
    lens = tier_counts(wire[wire != TIER_DROP]) if wire is not None else (slots.numel(), 0, 0)
    buf = torch.empty(segment_layout(src, lens).total_bytes + 7, dtype=torch.uint8)
    lay = pack_segment(src, slots, wire, buf)
    assert lay.lens == lens and lay.total_bytes == segment_layout(dst, lens).total_bytes
    got = alloc_like(dst, dst_alloc, lens)
    unpack_segment(dst, buf[: lay.total_bytes], lens, got)
    return got


def test_tiered_to_tiered_moves_the_stored_codes():
    src, sa = tiered()
    slots, _ = fill(src, sa, 10)
    slots, _ = sa.retier(slots, torch.tensor([0, 1, 2, 1, 2, 2, 1, 0, 3, 2], dtype=torch.int8))
    wire = wire_tier_of(src, slots)
    assert wire.tolist() == [0, 1, 2, 1, 2, 2, 1, 0, 3, 2]  # slot 0 = dropped
    dst, da = tiered()
    got = transfer(src, slots[wire != TIER_DROP], wire[wire != TIER_DROP], dst, da)
    for layer in range(L):
        for tier in (TIER_INT8, TIER_INT4):
            sent = src.stored_codes(layer, tier, slots[wire == tier])
            landed = dst.stored_codes(layer, tier, got[tier])
            assert all(torch.equal(a, b) for a, b in zip(sent, landed))
            assert int((got[tier] - dst.base(tier)).min()) % PAGE == 0  # on a fresh page, from slot 0
        k16, _ = src.get_kv(layer, slots[wire == TIER_FP16])
        assert torch.equal(k16, dst.get_kv(layer, got[TIER_FP16])[0])


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_tiered_to_fp16_pool_dequantizes(dtype):
    src, sa = tiered(dtype)
    slots, _ = fill(src, sa, 8, seed=1)
    slots, _ = sa.retier(slots, torch.tensor([0, 1, 1, 2, 2, 1, 0, 2], dtype=torch.int8))
    wire = wire_tier_of(src, slots)
    dst, da = fp16(dtype)
    got = transfer(src, slots, wire, dst, da)
    for layer in range(L):
        for tier in (TIER_FP16, TIER_INT8, TIER_INT4):
            want_k, want_v = src.get_kv(layer, slots[wire == tier])
            k, v = dst.get_kv(layer, got[tier])
            assert torch.equal(k, want_k) and torch.equal(v, want_v)


def test_fp16_to_fp16_is_bitwise_and_fp16_to_tiered_int8_is_the_codec():
    src, sa = fp16()
    slots, kv = fill(src, sa, 12, seed=2)
    dst, da = fp16()
    got = transfer(src, slots, None, dst, da)
    for layer, (k, v) in enumerate(kv):
        assert torch.equal(dst.get_kv(layer, got[0])[0], k) and torch.equal(dst.get_kv(layer, got[0])[1], v)
    tdst, tda = tiered()
    got = transfer(src, slots, torch.full((12,), TIER_INT8, dtype=torch.int8), tdst, tda)
    for layer, (k, v) in enumerate(kv):
        rk, rv = tdst.get_kv(layer, got[TIER_INT8])
        assert torch.equal(rk, dequantize(*quantize(k, 8, G), 8, G, torch.float16))
        assert torch.equal(rv, dequantize(*quantize(v, 8, G), 8, G, torch.float16))


def test_payload_bytes_follow_the_tiers():
    pool, _ = fp16()
    full = segment_layout(pool, (10, 0, 0)).total_bytes
    assert full == 10 * 2 * L * H * D * 2
    assert segment_layout(pool, (0, 10, 0)).total_bytes == 10 * 2 * L * H * (D + 2 * 2 * D // G)
    assert segment_layout(pool, (0, 0, 10)).total_bytes == 10 * 2 * L * H * (D // 2 + 2 * 2 * D // G)


def _both(pool, slots, wire):
    """pack_segment and pack_segment_reference of the same tokens: (fast bytes, reference bytes)."""
    lens = tier_counts(wire[wire != TIER_DROP]) if wire is not None else (slots.numel(), 0, 0)
    nbytes = segment_layout(pool, lens).total_bytes
    fast, ref = torch.full((nbytes + 5,), 7, dtype=torch.uint8), torch.full((nbytes + 5,), 7, dtype=torch.uint8)
    assert pack_segment(pool, slots, wire, fast).lens == pack_segment_reference(pool, slots, wire, ref).lens == lens
    return fast, ref


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", ["stored", "requant", "mixed", "mixed16", "fp16_only", "all_fp16_pool"])
def test_pack_fast_path_equals_reference(dtype, case, monkeypatch):
    """The batched pack (host split once, all layers' quantization in one codec call, strided
    copies into the payload; from a tiered pool every layer in one gather per stream) writes the
    reference's bytes exactly, in every mix the PD path uses: stored tiers ("end"), fp16-held
    tokens quantized on the way ("chunk" / "int8"), a tier whose tokens are partly stored and
    partly quantized (from the fp16 store: "mixed16", the all-layer path; from another int store:
    "mixed", the per-layer one), and layer groups split."""
    import sgl_kvxfer.mem_cache.kv_payload as kp

    monkeypatch.setattr(kp, "_QUANT_GROUP_ELEMS", 2 * 7 * H * D)  # forces several layer groups
    monkeypatch.setattr(kp, "_QUANT_GROUP_ELEMS_HOST", 2 * 7 * H * D)
    taken = []
    stacked = kp._pack_tier_stacked
    monkeypatch.setattr(kp, "_pack_tier_stacked", lambda *a: taken.append(stacked(*a)) or taken[-1])
    gen = torch.Generator().manual_seed(3)
    if case == "all_fp16_pool":
        pool, alloc = fp16(dtype)
        slots, _ = fill(pool, alloc, 12)
        wire = torch.randint(0, 3, (12,), generator=gen, dtype=torch.int8)
    else:
        pool, alloc = tiered(dtype)
        slots, _ = fill(pool, alloc, 12)
        stored = torch.tensor([0, 1, 2, 1, 2, 2, 1, 0, 3, 2, 1, 0], dtype=torch.int8)
        if case != "fp16_only":
            slots, _ = alloc.retier(slots, stored)
        held = wire_tier_of(pool, slots)
        live = held != TIER_DROP
        slots, held = slots[live], held[live]
        wire = {"stored": held, "fp16_only": torch.randint(0, 3, (slots.numel(),), generator=gen, dtype=torch.int8),
                "requant": torch.where(held == TIER_FP16, torch.full_like(held, TIER_INT8), held),
                "mixed": torch.full_like(held, TIER_INT8),
                "mixed16": torch.where(held == TIER_INT4, held, torch.full_like(held, TIER_INT8))}[case]
    fast, ref = _both(pool, slots, wire)
    assert torch.equal(fast, ref)
    assert fast[-5:].tolist() == [7] * 5  # nothing written past the segment
    # which path packed each tier: all layers at once unless a token is read from an int store
    assert taken and all(taken) == any(taken) == (case not in ("mixed", "all_fp16_pool")), taken


def test_unpack_all_layers_at_once_writes_what_the_layer_loop_writes(monkeypatch):
    """The decode side: a tiered segment unpacked into a tiered pool in one scatter per stream
    (every layer) leaves the pool's storage byte for byte as the per-layer loop does."""
    import sgl_kvxfer.mem_cache.kv_payload as kp

    src, sa = tiered(torch.bfloat16)
    slots, _ = fill(src, sa, 14, seed=4)
    slots, _ = sa.retier(slots, torch.tensor([0, 1, 2, 1, 2, 2, 1, 0, 3, 2, 0, 1, 1, 2], dtype=torch.int8))
    wire = wire_tier_of(src, slots)
    live = wire != TIER_DROP
    lens = tier_counts(wire[live])
    buf = torch.empty(segment_layout(src, lens).total_bytes, dtype=torch.uint8)
    pack_segment(src, slots[live], wire[live], buf)
    stores = []
    for stacked in (True, False):
        dst, da = tiered(torch.bfloat16)
        da.alloc(3)  # not the sender's slot ids
        got = alloc_like(dst, da, lens)
        taken = []
        real = kp._unpack_stacked
        monkeypatch.setattr(kp, "_unpack_stacked",
                            (lambda *a: taken.append(real(*a)) or taken[-1]) if stacked else (lambda *a: False))
        unpack_segment(dst, buf, lens, got)
        assert taken == ([True] if stacked else [])
        stores.append([*dst.stacked_rows(), *(x for t in (TIER_INT8, TIER_INT4) for x in dst.stacked_store(t).tensors())])
    assert all(torch.equal(a, b) for a, b in zip(*stores))
    assert any(bool(x.any()) for x in stores[0])  # something landed


def test_pack_fast_path_all_model_dtype():
    pool, alloc = tiered()
    slots, _ = fill(pool, alloc, 9)
    fast, ref = _both(pool, slots, None)
    assert torch.equal(fast, ref)


def test_an_int_tier_partly_placed_in_fp16_is_routed_once_and_written_as_set_kv_would(monkeypatch):
    """The decode's fallback: a short int store's tokens land in fp16 slots. That tier is written
    dequantized through one host route for all layers (not a device split per layer), leaving
    the pool as per-layer set_kv of the dequantized codes does."""
    src, sa = tiered()
    slots, _ = fill(src, sa, 12)
    slots, _ = sa.retier(slots, torch.tensor([0, 1, 1, 1, 1, 2, 2, 2, 2, 2, 0, 1], dtype=torch.int8))
    wire = wire_tier_of(src, slots)
    lens = tier_counts(wire)
    buf = torch.empty(segment_layout(src, lens).total_bytes, dtype=torch.uint8)
    pack_segment(src, slots, wire, buf)
    pools = []
    for routed in (True, False):
        dst, da = tiered()
        i8 = torch.cat([da.alloc_tier(TIER_INT8, 3), da.alloc(lens[1] - 3)])  # the store ran short
        got = (da.alloc(lens[0]), i8, da.alloc(lens[2]))  # int4: all in fp16
        if routed:
            splits = []
            real = dst._split
            monkeypatch.setattr(dst, "_split", lambda flat: splits.append(1) or real(flat))
            unpack_segment(dst, buf, lens, got)
            assert len(splits) == 3  # the fp16 tier's route and one per int tier, for every layer
        else:  # the reference: each layer's dequantized codes through set_kv
            for layer in range(L):
                for t in (TIER_FP16, TIER_INT8, TIER_INT4):
                    ids = slots[wire == t]
                    if t == TIER_FP16:
                        k, v = src.get_kv(layer, ids)
                    else:
                        kq, vq, ks, kz, vs, vz = src.stores[t][layer].codes(*src.page_offset(t, ids))
                        bits = 8 if t == TIER_INT8 else 4
                        k, v = dequantize(kq, ks, kz, bits, G, src.dtype), dequantize(vq, vs, vz, bits, G, src.dtype)
                    dst.set_kv(layer, got[t], k, v)
        pools.append([*dst.stacked_rows(), *(x for t in (TIER_INT8, TIER_INT4) for x in dst.stacked_store(t).tensors())])
    assert all(torch.equal(a, b) for a, b in zip(*pools))
