"""The transfer layer of the KV memory stack: a token range's KV as bytes on the wire, and back.

A *segment* is prompt positions [start, end) of one request, each at a *wire tier* (fp16 = the
model dtype, int8, int4, or dropped: no bytes). Its payload is, layer after layer, each tier's
streams in the tier codec's per-token format (kernels/tier_codec.py; token-exact, head-major):

    payload = layer 0 | layer 1 | ... | layer L-1            (L = layers the pool stores)
    layer   = fp16: K [Hkv, n16, D*eb] | V
              int8: K [Hkv, n8, D] | V | K scale [Hkv, n8, D/G*2] | K zero | V scale | V zero
              int4: K [Hkv, n4, D/2] | V | K scale | K zero | V scale | V zero  (split halves)
    tokens of a tier appear in position order; `lens` = (n16, n8, n4)
    bytes per layer = sum_t n_t * Hkv * 2 * payload_bytes(t, D, G, eb)

so both sides need the same model dtype, layer count, kv heads, head dim and group size (the
`KVLayoutInfo` of message/disagg.py), but not the same pool family, page size or slot ids: the
wire carries tokens, not the stores' page-head blocks (TierPages.codes / put_codes convert).

    pack_segment(pool, slots, wire_tiers, out)   prefill: the pool's tokens -> bytes in `out`
    unpack_segment(pool, payload, lens, slots)   decode: bytes -> the slots it allocated

Tokens a tiered pool already holds at their wire tier travel as stored codes, not requantized
(gathered from the paged int stores at (page, offset)), so a decode server that unpacks
into a tiered pool holds bit-for-bit what a single tiered server holds. Anything else is read at
the model dtype (`get_kv`) and quantized with the tier codec on the way out. A fp16-family
decode pool dequantizes what it receives.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from sgl_kvxfer.kernels import tier_codec as tc
from sgl_kvxfer.mem_cache.kv_pool import KVPool
from sgl_kvxfer.spectrum.tiers import TIER_DROP, TIER_FP16, TIER_INT4, TIER_INT8

_BITS = {TIER_INT8: 8, TIER_INT4: 4}


@dataclass(frozen=True)
class SegmentLayout:
    lens: tuple[int, int, int]  # tokens per wire tier (fp16, int8, int4)
    layer_bytes: int
    num_layers: int

    @property
    def total_bytes(self) -> int:
        return self.layer_bytes * self.num_layers


def elem_bytes(pool: KVPool) -> int:
    return torch.finfo(pool.dtype).bits // 8


def segment_layout(pool: KVPool, lens) -> SegmentLayout:
    lens = tuple(int(n) for n in lens)
    D, g, eb = pool.head_dim, group_size(pool), elem_bytes(pool)
    per_layer = sum(n * pool.num_kv_heads * 2 * tc.payload_bytes(t, D, g, eb) for t, n in enumerate(lens))
    layers = sum(pool.stores_layer(i) for i in range(pool.num_layers))
    return SegmentLayout(lens, per_layer, layers)


def group_size(pool: KVPool) -> int:
    return getattr(pool, "group_size", tc.DEFAULT_GROUP_SIZE)


def tier_counts(wire_tiers: torch.Tensor) -> tuple[int, int, int]:
    counts = torch.bincount(wire_tiers.to(torch.int64).cpu(), minlength=4).tolist()
    return counts[TIER_FP16], counts[TIER_INT8], counts[TIER_INT4]


def _head_major(x: torch.Tensor) -> torch.Tensor:
    """[n, Hkv, W] -> bytes of [Hkv, n, W]."""
    return x.permute(1, 0, 2).contiguous().view(torch.uint8).reshape(-1)


def _tier_streams(pool: KVPool, layer: int, slots: torch.Tensor, tier: int) -> list[torch.Tensor]:
    """The byte streams of `slots` at wire tier `tier`, in pack order. Tokens a tiered pool
    holds at that tier give their stored codes; the others are read at the model dtype (a
    tiered pool's fp16 store is exact) and quantized."""
    held = (pool.tier_of(slots) == tier) if getattr(pool, "layout", "") == "tiered" else None
    if tier == TIER_FP16 or held is None or not bool(held.any()):
        return [_head_major(x) for x in _read_as(pool, layer, slots, tier)]
    if bool(held.all()):
        return [_head_major(x) for x in _stored_codes(pool, layer, slots, tier)]
    rows = [None] * 6
    for mask, parts in ((held, _stored_codes(pool, layer, slots[held], tier)),
                        (~held, _read_as(pool, layer, slots[~held], tier))):
        idx = mask.nonzero().squeeze(1)
        for i, x in enumerate(parts):
            if rows[i] is None:
                rows[i] = torch.empty((slots.numel(), *x.shape[1:]), dtype=x.dtype, device=x.device)
            rows[i].index_copy_(0, idx, x)
    return [_head_major(x) for x in rows]


def _stored_codes(pool, layer: int, slots: torch.Tensor, tier: int) -> tuple:
    return pool.stored_codes(layer, tier, slots)


def _read_as(pool, layer: int, slots: torch.Tensor, tier: int) -> tuple:
    k, v = pool.get_kv(layer, slots)
    if tier == TIER_FP16:
        return k, v
    g = group_size(pool)
    kq, ks, kz = tc.quantize(k, _BITS[tier], g)
    vq, vs, vz = tc.quantize(v, _BITS[tier], g)
    return kq, vq, ks, kz, vs, vz


def pack_segment(pool: KVPool, slots: torch.Tensor, wire_tiers: torch.Tensor | None, out: torch.Tensor) -> SegmentLayout:
    """Pack the tokens at `slots` [n] (position order) at `wire_tiers` [n] (None: all at the
    model dtype; TIER_DROP tokens send nothing) into `out` (uint8, >= total bytes).

    NOTE: copies into `out` are non-blocking; on CUDA synchronize before `out`'s bytes leave."""
    slots = slots.reshape(-1)
    if wire_tiers is None:
        wire_tiers = torch.zeros(slots.numel(), dtype=torch.int8)
    wire_tiers = wire_tiers.to(torch.int8).cpu()
    lay = segment_layout(pool, tier_counts(wire_tiers))
    assert out.dtype == torch.uint8 and out.numel() >= lay.total_bytes, (out.dtype, out.numel(), lay.total_bytes)
    groups = [(t, slots[(wire_tiers == t).nonzero().squeeze(1).to(slots.device)]) for t in (TIER_FP16, TIER_INT8, TIER_INT4)]
    if getattr(pool, "layout", "") == "tiered" and all(
            g.numel() == 0 or bool((pool.tier_of(g) == t).all()) for t, g in groups):
        _pack_stored_tiers(pool, groups, lay, out)
        return lay
    pos = 0
    for layer in range(pool.num_layers):
        if not pool.stores_layer(layer):
            continue
        for tier, tier_slots in groups:
            if tier_slots.numel() == 0:
                continue
            for stream in _tier_streams(pool, layer, tier_slots, tier):
                out[pos:pos + stream.numel()].copy_(stream, non_blocking=True)
                pos += stream.numel()
    assert pos == lay.total_bytes, (pos, lay.total_bytes)
    return lay


def _pack_stored_tiers(pool, groups, lay: SegmentLayout, out: torch.Tensor) -> None:
    """Every token travels at the tier the (tiered) pool holds it at, as stored: one gather per
    stream (fp16 rows; int tokens at (page, offset) of head-major pages) into a device stage,
    then one copy out (a torch path)."""
    on_gpu = groups[0][1].device.type == "cuda"
    stage = torch.empty(lay.total_bytes, dtype=torch.uint8, device=groups[0][1].device) if on_gpu else out
    pos = 0
    for layer in range(pool.num_layers):
        if not pool.stores_layer(layer):
            continue
        for tier, slots in groups:
            if slots.numel() == 0:
                continue
            parts = ((pool.k16[layer][slots], pool.v16[layer][slots]) if tier == TIER_FP16
                     else pool.stored_codes(layer, tier, slots))
            for x in parts:
                stream = _head_major(x)
                stage[pos:pos + stream.numel()].copy_(stream)
                pos += stream.numel()
    assert pos == lay.total_bytes, (pos, lay.total_bytes)
    if on_gpu:
        out[:lay.total_bytes].copy_(stage, non_blocking=True)


def _read_streams(payload: torch.Tensor, pos: int, n: int, H: int, widths: list[tuple[int, torch.dtype]]):
    """Cut len(widths) head-major streams [H, n, w] of dtype off `payload` at byte `pos`;
    returns ([n, H, w] tensors, new pos)."""
    out = []
    for w, dtype in widths:
        nb = H * n * w * torch.finfo(dtype).bits // 8 if dtype.is_floating_point else H * n * w
        out.append(payload[pos:pos + nb].view(dtype).view(H, n, w).permute(1, 0, 2))
        pos += nb
    return out, pos


def unpack_segment(pool: KVPool, payload: torch.Tensor, lens, slots_by_tier: tuple) -> None:
    """Write a packed segment into this pool. `slots_by_tier[t]` holds the n_t slots the caller
    allocated for tier t's tokens (in position order). A tiered pool must have allocated each
    tier's tokens in that tier's store (codes are copied as they are); any other pool gets the
    tokens dequantized to its dtype."""
    lay = segment_layout(pool, lens)
    assert payload.dtype == torch.uint8 and payload.numel() >= lay.total_bytes
    H, D, g, dtype = pool.num_kv_heads, pool.head_dim, group_size(pool), pool.dtype
    gs = D // g
    tiered = getattr(pool, "layout", "") == "tiered"
    pos = 0
    for layer in range(pool.num_layers):
        if not pool.stores_layer(layer):
            continue
        for tier in (TIER_FP16, TIER_INT8, TIER_INT4):
            n, slots = lay.lens[tier], slots_by_tier[tier]
            if n == 0:
                continue
            assert slots.numel() == n, (tier, slots.numel(), n)
            if tier == TIER_FP16:
                (k, v), pos = _read_streams(payload, pos, n, H, [(D, dtype), (D, dtype)])
                pool.set_kv(layer, slots, k.to(pool.device), v.to(pool.device))
                continue
            width = D if tier == TIER_INT8 else D // 2
            parts, pos = _read_streams(payload, pos, n, H, [(width, torch.uint8)] * 2 + [(gs, torch.float16)] * 4)
            kq, vq, ks, kz, vs, vz = (x.to(pool.device) for x in parts)
            if tiered and bool((pool.tier_of(slots) == tier).all()):
                pool.put_codes(layer, tier, slots, (kq, vq, ks, kz, vs, vz))
            else:
                k = tc.dequantize(kq, ks, kz, _BITS[tier], g, dtype)
                v = tc.dequantize(vq, vs, vz, _BITS[tier], g, dtype)
                pool.set_kv(layer, slots, k, v)
    assert pos == lay.total_bytes, (pos, lay.total_bytes)


def wire_tier_of(pool: KVPool, slots: torch.Tensor) -> torch.Tensor:
    """The tier each token is held at (int8, CPU): a tiered pool's store, else the model dtype;
    slot 0 in a row (a dropped token) is TIER_DROP."""
    if getattr(pool, "layout", "") == "tiered":
        return pool.tier_of(slots).cpu()
    tiers = torch.zeros(slots.numel(), dtype=torch.int8)
    tiers[(slots == 0).cpu()] = TIER_DROP
    return tiers
