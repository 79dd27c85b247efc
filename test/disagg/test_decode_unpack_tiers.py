"""The PD decode's unpack of tiered segments into a pool full of cached tiered requests (CPU):
a segment's int tokens evict cache leaves for pages of their own store, so they keep their
tier and the segment unpacks in the all-layer path (kv_payload._unpack_stacked) instead of
the per-layer dequantizing one; each tier's slots reach the unpack in position order; the
trace splits each unpack into its parts."""
import random
from types import SimpleNamespace

import numpy as np
import torch

import sgl_kvxfer.disagg.decode_unpack as du
import sgl_kvxfer.mem_cache.kv_payload as kp
from sgl_kvxfer.disagg.decode_unpack import DecodeUnpack
from sgl_kvxfer.disagg.trace import PhaseTrace
from sgl_kvxfer.mem_cache.req_to_token import ReqToTokenPool
from sgl_kvxfer.mem_cache.tier_plan import TierStorePlan
from sgl_kvxfer.mem_cache.tiered_allocator import TieredSlotAllocator
from sgl_kvxfer.mem_cache.tiered_pool import TieredKVPool
from sgl_kvxfer.message.disagg import KVSegment
from sgl_kvxfer.scheduler.kv_lifecycle import KVLifecycle
from sgl_kvxfer.spectrum.tiers import TIER_FP16, TIER_INT4, TIER_INT8

L, H, D, PAGE, PROMPT, SEG = 2, 1, 64, 4, 64, 16


class _Role(DecodeUnpack):
    """The state DecodeUnpack reads: a tiered pool whose fp16 store outlasts its int stores."""

    def __init__(self):
        self.pool = TieredKVPool(256, L, H, D, torch.float16, "cpu", TierStorePlan(512, 96, 128),
                                 group_size=32, page_size=PAGE)
        self.table = ReqToTokenPool(8, PROMPT)
        self.kv = KVLifecycle(TieredSlotAllocator(self.pool, "cpu"), self.table, use_radix=True)
        self.tiered, self.rooms = True, {}

    def _end(self, room, why):
        raise AssertionError(why)


def _receive(role: _Role, room: int, rng: np.random.Generator):
    """One request's prompt in segments of random tiers, then cached as a finished request."""
    req = SimpleNamespace(req_pool_idx=None, prefix_len=0, kv_len=0, last_node=None, share_prefix=True,
                          num_retractions=0, bootstrap=SimpleNamespace(room=room),
                          fill_ids=[random.randrange(1 << 30) for _ in range(PROMPT)])
    assert role.kv.admit_external(req)
    role.rooms[room] = SimpleNamespace(trace=PhaseTrace())
    sent = []
    for start in range(0, PROMPT, SEG):
        tiers = rng.choice([TIER_FP16, TIER_INT8, TIER_INT4], size=SEG, p=[0.2, 0.3, 0.5]).astype(np.uint8)
        lens = tuple(int((tiers == t).sum()) for t in (TIER_FP16, TIER_INT8, TIER_INT4))
        payload = torch.randint(0, 255, (kp.segment_layout(role.pool, lens).total_bytes,), dtype=torch.uint8)
        seg = KVSegment(room=room, seq=start // SEG, start=start, end=start + SEG, tiers=tiers.tobytes(),
                        lens=lens, offset=0, nbytes=payload.numel(), block_bytes=payload.numel(), checksums=[])
        assert role._write_segment(req, seg, payload)
        sent.append(tiers)
    held = role.pool.tier_of(role.table.read(req.req_pool_idx, PROMPT)).tolist()
    role.kv.cache(req, finished=True)
    return np.concatenate(sent).tolist(), held


def test_int_tokens_evict_for_their_own_store_and_unpack_in_one_pass(monkeypatch):
    random.seed(0)
    rng = np.random.default_rng(0)
    role = _Role()
    stacked = []
    real = kp._unpack_stacked
    monkeypatch.setattr(kp, "_unpack_stacked", lambda *a: stacked.append(real(*a)) or stacked[-1])
    evicting = 0
    for room in range(12):  # the int stores hold ~3 prompts: later ones evict cached requests
        sent, held = _receive(role, room, rng)
        assert held == sent, room  # every token in the store of its tier, none dequantized to fp16
        role.kv.allocator.debug_check()
        names = [name.split("[")[0] for name, _, _ in role.rooms[room].trace.spans]
        assert names.count("unpack_alloc") == names.count("unpack_write") == names.count("unpack_row") == PROMPT // SEG
        evicting += names.count("unpack_evict")
        if room < 3:  # room to spare: no eviction, no evict span
            assert "unpack_evict" not in names, room
    assert evicting >= 12 - 3  # the int stores full of cached pages: each later prompt evicts
    assert stacked == [True] * len(stacked) and len(stacked) == 12 * PROMPT // SEG
    assert role.kv.allocator.available_size() > PROMPT  # fp16 room to spare: only the int stores evicted


def test_each_tier_gets_its_positions_slots_in_position_order(monkeypatch):
    """What unpack_segment receives per tier: the row's new slots at that tier's positions."""
    random.seed(1)
    rng = np.random.default_rng(1)
    role = _Role()
    given = []
    real_unpack = du.unpack_segment
    monkeypatch.setattr(du, "unpack_segment", lambda pool, payload, lens, by_tier:
                        given.append([x.clone() for x in by_tier]) or real_unpack(pool, payload, lens, by_tier))
    rows = []
    monkeypatch.setattr(role.kv, "cache", lambda req, finished: rows.append(
        role.table.read(req.req_pool_idx, PROMPT).clone()) or role.kv.release(req))
    sent, _ = _receive(role, 0, rng)
    tiers = torch.tensor(sent).view(-1, SEG)
    for k, by_tier in enumerate(given):
        seg_row = rows[0][k * SEG:(k + 1) * SEG]
        for t, slots in zip((TIER_FP16, TIER_INT8, TIER_INT4), by_tier):
            assert torch.equal(slots, seg_row[tiers[k] == t]), (k, t)
