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
    formats = getattr(pool, "formats", None)
    if formats is not None and not formats.is_uniform:
        raise ValueError("PD segments carry the codec's int8 / int4; this pool stores per-layer formats "
                         "(--kv-layer-budget profile, --kv-tier-policy kivi)")
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


# pack_segment quantizes the layers of a tier in groups of at most this many model-dtype
# elements (K and V together): bounded scratch (~10 float32 temporaries of it) for long segments;
# on the host a group stays about cache-sized (one launch per op matters only on a GPU)
_QUANT_GROUP_ELEMS = 1 << 24
_QUANT_GROUP_ELEMS_HOST = 1 << 18


def _segment_args(pool: KVPool, slots: torch.Tensor, wire_tiers: torch.Tensor | None, out: torch.Tensor) -> tuple:
    """pack_segment's inputs made plain: slots flat, wire tiers int8 on the host (None: all at the
    model dtype), the segment's layout; `out` checked to hold it."""
    slots = slots.reshape(-1)
    if wire_tiers is None:
        wire_tiers = torch.zeros(slots.numel(), dtype=torch.int8)
    wire_tiers = wire_tiers.to(torch.int8).cpu()
    lay = segment_layout(pool, tier_counts(wire_tiers))
    assert out.dtype == torch.uint8 and out.numel() >= lay.total_bytes, (out.dtype, out.numel(), lay.total_bytes)
    return slots, wire_tiers, lay


def pack_segment(pool: KVPool, slots: torch.Tensor, wire_tiers: torch.Tensor | None, out: torch.Tensor) -> SegmentLayout:
    """Pack the tokens at `slots` [n] (position order) at `wire_tiers` [n] (None: all at the
    model dtype; TIER_DROP tokens send nothing) into `out` (uint8, >= total bytes); the bytes
    of pack_segment_reference.

    Which token goes which way (stored codes, or read at the model dtype and quantized) is
    decided once on the host (one copy of `slots` back), so the layer loop runs no host sync.
    Per tier: one gather per stored layer and stream, the quantization of all layers' K and V
    in one codec call (per layer group of _QUANT_GROUP_ELEMS), and one strided copy per stream
    and layer group straight into `out`'s head-major layout (no staging buffer).

    NOTE: copies into `out` are non-blocking; on CUDA synchronize before `out`'s bytes leave."""
    slots, wire_tiers, lay = _segment_args(pool, slots, wire_tiers, out)
    if lay.total_bytes == 0:
        return lay
    layers = [i for i in range(pool.num_layers) if pool.stores_layer(i)]
    # a GPU pool packs on the device, then one copy into a host `out` (not one per stream)
    staged = torch.device(pool.device).type == "cuda" and out.device.type != "cuda"
    dst = torch.empty(lay.total_bytes, dtype=torch.uint8, device=pool.device) if staged else out[:lay.total_bytes]
    by_layer = dst.view(len(layers), lay.layer_bytes)
    flat = slots.cpu()
    tiered = getattr(pool, "layout", "") == "tiered"
    held_all = pool.tier_of(flat) if tiered else None
    H, D, g, eb = pool.num_kv_heads, pool.head_dim, group_size(pool), elem_bytes(pool)
    off = 0
    for tier in (TIER_FP16, TIER_INT8, TIER_INT4):
        ids = flat[wire_tiers == tier]
        n = ids.numel()
        if n == 0:
            continue
        # (byte width, dtype) of each stream, in pack order
        if tier == TIER_FP16:
            widths = [(D * eb, pool.dtype)] * 2
        else:
            w = D if tier == TIER_INT8 else D // 2
            widths = [(w, torch.uint8)] * 2 + [((D // g) * 2, torch.float16)] * 4
        dests, pos = [], off
        for wb, _ in widths:
            dests.append(by_layer[:, pos:pos + H * n * wb].view(len(layers), H, n, wb))
            pos += H * n * wb
        held = (held_all[wire_tiers == tier] == tier) if (tiered and tier != TIER_FP16) else torch.zeros(n, dtype=torch.bool)
        _pack_tier(pool, layers, tier, ids, held, widths, dests)
        off = pos
    assert off == lay.layer_bytes, (off, lay.layer_bytes)
    if staged:
        out[:lay.total_bytes].copy_(dst, non_blocking=True)
    return lay


def _bytes(x: torch.Tensor) -> torch.Tensor:
    """[..., n, H, W] of any dtype -> [..., H, n, W * itemsize] uint8 (a view, head-major order)."""
    return x.view(torch.uint8).transpose(-3, -2)


def _pack_tier(pool, layers: list, tier: int, ids: torch.Tensor, held: torch.Tensor, widths, dests) -> None:
    """One wire tier's streams of tokens `ids` (host) into `dests` (one [L, H, n, wb] uint8 view
    per stream): stored codes for the `held` ones, the others read at the model dtype and
    quantized (fp16: copied)."""
    if _pack_tier_stacked(pool, layers, tier, ids, held, dests):
        return
    n, dev = ids.numel(), pool.device
    to_dev = pool._to_device if hasattr(pool, "_to_device") else (lambda x: x.to(dev))
    stored = held.nonzero().squeeze(1)
    read = (~held).nonzero().squeeze(1)
    mixed = 0 < stored.numel() < n
    if stored.numel():
        where = tuple(map(to_dev, pool.page_offset(tier, ids[stored])))
        at = to_dev(stored)
        for li, layer in enumerate(layers):
            parts = pool.stores[tier][layer].codes(*where)  # = pool.stored_codes(layer, tier, ids[stored])
            for dest, x in zip(dests, parts):
                if mixed:  # the stored rows at their positions; the read rows follow below
                    dest[li].index_copy_(1, at, _bytes(x))
                else:
                    dest[li].copy_(_bytes(x), non_blocking=True)
    if not read.numel():
        return
    rows = ids[read]
    route = pool.route(rows) if hasattr(pool, "route") else None
    rows_dev = None if route is not None else rows.to(dev)
    m = rows.numel()
    per_layer = 2 * m * pool.num_kv_heads * pool.head_dim
    cap = _QUANT_GROUP_ELEMS if torch.device(dev).type == "cuda" else min(_QUANT_GROUP_ELEMS, _QUANT_GROUP_ELEMS_HOST)
    step = max(1, cap // per_layer)
    at = to_dev(read) if mixed else None
    if tier == TIER_FP16:  # model dtype: each layer's rows copied as they are, no scratch
        for li, layer in enumerate(layers):
            kv = pool.get_kv_routed(layer, route) if route is not None else pool.get_kv(layer, rows_dev)
            for dest, x in zip(dests, kv):
                x = _bytes(x.reshape(m, pool.num_kv_heads, pool.head_dim))
                if mixed:
                    dest[li].index_copy_(1, at, x)
                else:
                    dest[li].copy_(x, non_blocking=True)
        return
    for l0 in range(0, len(layers), step):
        group = layers[l0:l0 + step]
        kv = torch.empty((2, len(group), m, pool.num_kv_heads, pool.head_dim), dtype=pool.dtype, device=dev)
        for j, layer in enumerate(group):
            k, v = (pool.get_kv_routed(layer, route) if route is not None else pool.get_kv(layer, rows_dev))
            kv[0, j].copy_(k.reshape(m, pool.num_kv_heads, pool.head_dim))
            kv[1, j].copy_(v.reshape(m, pool.num_kv_heads, pool.head_dim))
        q, sc, zr = tc.quantize(kv, _BITS[tier], group_size(pool))
        parts = (q[0], q[1], sc[0], zr[0], sc[1], zr[1])
        for dest, x in zip(dests, parts):
            d = dest[l0:l0 + len(group)]
            if mixed:
                d.index_copy_(2, at, _bytes(x))
            else:
                d.copy_(_bytes(x), non_blocking=True)


def _stacked(pool, layers: list, tier: int, stored: bool, read_rows: torch.Tensor | None):
    """(fp16 rows [L, rows, Hkv, D] x2, int store of `tier` over all layers) when the pool keeps
    every layer in one tensor (TieredKVPool.stacked_rows / stacked_store) and this tier's tokens
    can be taken from it: None otherwise (the per-layer path)."""
    if getattr(pool, "layout", "") != "tiered" or not hasattr(pool, "stacked_rows"):
        return None
    k16, v16 = pool.stacked_rows()
    if k16.shape[0] != len(layers) or layers != list(range(len(layers))):
        return None
    store = pool.stacked_store(tier) if tier != TIER_FP16 else None
    if stored and store is None:
        return None
    # tokens read at the model dtype must all sit in the fp16 store (no dequantized reads)
    if read_rows is not None and read_rows.numel() and not bool((read_rows < pool.base(TIER_INT8)).all()):
        return None
    return k16, v16, store


def _pack_tier_stacked(pool, layers: list, tier: int, ids: torch.Tensor, held: torch.Tensor, dests) -> bool:
    """_pack_tier over every layer at once: one gather per stream for all layers' stored codes,
    one gather of all layers' fp16 rows (per layer group when quantized), one copy per stream
    (per group) into `dests`. False (nothing written): the pool is not stacked, or tokens read at
    the model dtype are not fp16-store rows; the per-layer path runs instead."""
    n, dev = ids.numel(), pool.device
    stored = held.nonzero().squeeze(1)
    read = (~held).nonzero().squeeze(1)
    got = _stacked(pool, layers, tier, bool(stored.numel()), ids[read] if read.numel() else None)
    if got is None:
        return False
    k16, v16, store = got
    to_dev = pool._to_device
    L, H, Dh = len(layers), pool.num_kv_heads, pool.head_dim
    mixed = 0 < stored.numel() < n

    def put(dest: torch.Tensor, x: torch.Tensor, at) -> None:  # dest [g, H, n, wb]; x [g, m, H, W]
        if at is None:
            dest.copy_(_bytes(x), non_blocking=True)
        else:
            dest.index_copy_(2, at, _bytes(x))

    if stored.numel():
        s = stored.numel()
        page, off = pool.page_offset(tier, ids[stored])
        # layer l's page p is page l * pages + p of the stacked store
        pages = (torch.arange(L, dtype=page.dtype)[:, None] * pool.num_pages(tier) + page[None, :]).reshape(-1)
        parts = store.codes(to_dev(pages), to_dev(off.repeat(L)))
        at = to_dev(stored) if mixed else None
        for dest, x in zip(dests, parts):
            put(dest, x.view(L, s, *x.shape[1:]), at)
    if not read.numel():
        return True
    m, R = read.numel(), k16.shape[1]
    at = to_dev(read) if mixed else None
    per_layer = 2 * m * H * Dh
    cap = _QUANT_GROUP_ELEMS if torch.device(dev).type == "cuda" else min(_QUANT_GROUP_ELEMS, _QUANT_GROUP_ELEMS_HOST)
    step = L if tier == TIER_FP16 else max(1, min(L, cap // per_layer))
    # rows of a group of layers in the [layers * R, Hkv, D] view: (layer - first) * R + row (a
    # gather along dim 0: the contiguous-row path, several times faster on the host than dim 1)
    rows = to_dev((torch.arange(step)[:, None] * R + ids[read][None, :]).reshape(-1))

    def gather(x: torch.Tensor, l0: int, g: int, out=None) -> torch.Tensor:  # -> [g * m, Hkv, D]
        return torch.index_select(x[l0:l0 + g].reshape(g * R, H, Dh), 0, rows[:g * m], out=out)

    if tier == TIER_FP16:  # model dtype: all layers' rows in one gather per K / V
        for dest, x in zip(dests, (k16, v16)):
            put(dest, gather(x, 0, L).view(L, m, H, Dh), at)
        return True
    for l0 in range(0, L, step):
        g = min(step, L - l0)
        kv = torch.empty((2, g, m, H, Dh), dtype=pool.dtype, device=dev)
        gather(k16, l0, g, kv[0].view(g * m, H, Dh))
        gather(v16, l0, g, kv[1].view(g * m, H, Dh))
        q, sc, zr = tc.quantize(kv, _BITS[tier], group_size(pool))
        for dest, x in zip(dests, (q[0], q[1], sc[0], zr[0], sc[1], zr[1])):
            put(dest[l0:l0 + g], x, at)
    return True


def pack_segment_reference(pool: KVPool, slots: torch.Tensor, wire_tiers: torch.Tensor | None,
                           out: torch.Tensor) -> SegmentLayout:
    """The torch reference of pack_segment, layer by layer and stream by stream (same bytes).
    Pack the tokens at `slots` [n] (position order) at `wire_tiers` [n] (None: all at the
    model dtype; TIER_DROP tokens send nothing) into `out` (uint8, >= total bytes).

    NOTE: copies into `out` are non-blocking; on CUDA synchronize before `out`'s bytes leave."""
    slots, wire_tiers, lay = _segment_args(pool, slots, wire_tiers, out)
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
    device = groups[0][1].device
    # a GPU pool stages on the device, then one copy out; into a GPU `out` directly
    on_gpu = device.type == "cuda" and out.device != device
    stage = torch.empty(lay.total_bytes, dtype=torch.uint8, device=device) if on_gpu else out
    # (page, offset) of each int tier's tokens, looked up once, not per layer
    where = {t: pool.page_offset(t, slots) for t, slots in groups if t != TIER_FP16 and slots.numel()}
    pos = 0
    for layer in range(pool.num_layers):
        if not pool.stores_layer(layer):
            continue
        for tier, slots in groups:
            if slots.numel() == 0:
                continue
            parts = ((pool.k16[layer][slots], pool.v16[layer][slots]) if tier == TIER_FP16
                     else pool.stores[tier][layer].codes(*where[tier]))  # = pool.stored_codes(layer, tier, slots)
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
    # int tokens the caller allocated in their own store take the codes as they are: decided
    # once per tier, not per layer (each check reads device ids back to the host)
    direct = {t: pool.page_offset(t, slots_by_tier[t]) for t in (TIER_INT8, TIER_INT4)
              if tiered and lay.lens[t] and bool((pool.tier_of(slots_by_tier[t]) == t).all())}
    # where each fp16-tier token goes, worked out once (a tiered pool's set_kv would split the
    # ids on the device, a host sync per layer)
    route16 = pool.route(slots_by_tier[TIER_FP16]) if tiered and lay.lens[TIER_FP16] else None
    if _unpack_stacked(pool, payload, lay, slots_by_tier, direct, route16):
        return
    # an int tier some of whose tokens the caller placed elsewhere (fp16 where its store was
    # short) is written dequantized, routed once here for every layer
    routes = {t: pool.route(slots_by_tier[t]) for t in (TIER_INT8, TIER_INT4)
              if tiered and lay.lens[t] and t not in direct}
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
                if route16 is not None:
                    pool.set_kv_routed(layer, route16, k.to(pool.device), v.to(pool.device))
                else:
                    pool.set_kv(layer, slots, k.to(pool.device), v.to(pool.device))
                continue
            width = D if tier == TIER_INT8 else D // 2
            parts, pos = _read_streams(payload, pos, n, H, [(width, torch.uint8)] * 2 + [(gs, torch.float16)] * 4)
            kq, vq, ks, kz, vs, vz = (x.to(pool.device) for x in parts)
            if tier in direct:  # = pool.put_codes(layer, tier, slots, ...)
                pool.stores[tier][layer].put_codes(*direct[tier], (kq, vq, ks, kz, vs, vz))
            else:
                k = tc.dequantize(kq, ks, kz, _BITS[tier], g, dtype)
                v = tc.dequantize(vq, vs, vz, _BITS[tier], g, dtype)
                if tier in routes:
                    pool.set_kv_routed(layer, routes[tier], k, v)
                else:
                    pool.set_kv(layer, slots, k, v)
    assert pos == lay.total_bytes, (pos, lay.total_bytes)


def _unpack_stacked(pool, payload: torch.Tensor, lay: SegmentLayout, slots_by_tier: tuple, direct: dict,
                    route16) -> bool:
    """unpack_segment over every layer at once: one scatter per stream for all layers. Taken when
    the pool is stacked (TieredKVPool.stacked_rows / stacked_store), every stored layer is in it,
    fp16 tokens go to fp16-store rows and int tokens to their own store (codes as they are);
    False (nothing written) otherwise."""
    layers = [i for i in range(pool.num_layers) if pool.stores_layer(i)]
    if not hasattr(pool, "stacked_rows"):
        return False
    k16, v16 = pool.stacked_rows()
    if k16.shape[0] != len(layers) or layers != list(range(len(layers))):
        return False
    if lay.lens[TIER_FP16] and not (len(route16.parts) == 1 and route16.parts[0][0] == TIER_FP16
                                    and route16.parts[0][1] is None):
        return False
    for t in (TIER_INT8, TIER_INT4):
        if lay.lens[t] and (t not in direct or pool.stacked_store(t) is None):
            return False
    L, H, D = len(layers), pool.num_kv_heads, pool.head_dim
    gs = D // group_size(pool)
    by_layer = payload[:lay.total_bytes].view(L, lay.layer_bytes)
    dev, pos = pool.device, 0

    def streams(n: int, widths) -> list:
        """The next len(widths) streams of every layer, each [L, n, H, w] (views, then on the pool's device)."""
        nonlocal pos
        out = []
        for w, dtype in widths:
            nb = H * n * w * (torch.finfo(dtype).bits // 8 if dtype.is_floating_point else 1)
            out.append(by_layer[:, pos:pos + nb].view(dtype).view(L, H, n, w).transpose(1, 2).to(dev))
            pos += nb
        return out

    for tier in (TIER_FP16, TIER_INT8, TIER_INT4):
        n = lay.lens[tier]
        if n == 0:
            continue
        assert slots_by_tier[tier].numel() == n, (tier, slots_by_tier[tier].numel(), n)
        if tier == TIER_FP16:
            # layer l's row r is row l * R + r of the [L * R, Hkv, D] view (a scatter along dim 0)
            R = k16.shape[1]
            rows = route16.parts[0][2].long()  # index_copy_ takes int64 indices only
            rows = (torch.arange(L, device=rows.device)[:, None] * R + rows[None, :]).reshape(-1)
            for dst, x in zip((k16, v16), streams(n, [(D, pool.dtype)] * 2)):
                dst.view(L * R, H, D).index_copy_(0, rows, x.reshape(L * n, H, D))
            continue
        width = D if tier == TIER_INT8 else D // 2
        parts = streams(n, [(width, torch.uint8)] * 2 + [(gs, torch.float16)] * 4)
        page, off = direct[tier]
        # layer l's page p is page l * pages + p of the stacked store; indices [L, n] pick [L, n, H, w]
        page = page.reshape(1, -1) + (torch.arange(L, device=page.device) * pool.num_pages(tier))[:, None]
        pool.stacked_store(tier).put_codes(page, off.reshape(1, -1).expand(L, -1), parts)
    assert pos == lay.layer_bytes, (pos, lay.layer_bytes)
    return True


def wire_tier_of(pool: KVPool, slots: torch.Tensor) -> torch.Tensor:
    """The tier each token is held at (int8, CPU): a tiered pool's store, else the model dtype;
    slot 0 in a row (a dropped token) is TIER_DROP."""
    if getattr(pool, "layout", "") == "tiered":
        return pool.tier_of(slots).cpu()
    tiers = torch.zeros(slots.numel(), dtype=torch.int8)
    tiers[(slots == 0).cpu()] = TIER_DROP
    return tiers
