"""Gather-pack / unpack one request's tiered KV (one layer) to / from a contiguous byte buffer.

    pack_tiered_kv(layer, page_ids, lens, out=None) -> uint8 [pack_layout(...).total_bytes]
    unpack_tiered_kv(buf, layer, page_ids, lens) -> None (writes the pool pages)

page_ids: (fp16, int8, int4) int32 1-D tensors, the request's pages of each tier in fill
order (>= cdiv(n_t, PAGE) entries); lens: (n16, n8, n4) python ints (host-known counts).

Buffer layout (token-exact: no page padding travels), streams in this order:

    fp16: K [Hkv, n16, D*eb] | V [Hkv, n16, D*eb]
    int8: K [Hkv, n8, D] | V | K scale [Hkv, n8, D/G * 2B] | K zero | V scale | V zero
    int4: K [Hkv, n4, D/2] | V | K scale | K zero | V scale | V zero

so total = sum_t n_t * Hkv * 2 * payload_bytes(t, D, G, eb) exactly. The receiver may use other
page ids (and pool sizes) but the same PAGE, D, G. Each stream of a (page, kv-head) is one
contiguous run on both sides, so the kernel is a byte mover: grid (max pages, Hkv, 3 tiers).

Slot-addressed variant, for stores whose tokens of a request are arbitrary (page, offset) slots
(the engine's paged tiered pool: filled pages, fp16 rows at PAGE 1):

    pack_tiered_kv_slots(layer, slots, out=None) -> uint8 [pack_layout(...).total_bytes]
    unpack_tiered_kv_slots(buf, layer, slots) -> None

slots: (fp16, int8, int4) int32 1-D tensors of token rows of each tier's store, row =
page * PAGE_t + offset (PAGE_t = layer.page_size_of(t), tiers may differ; at PAGE 1 the row is
the store row); n_t = slots[t].numel() (no host sync), tokens travel in the given order. Same
buffer format as above, so either side may use either variant. grid (cdiv(max n_t, BLOCK_T),
Hkv, 3 tiers); a program moves BLOCK_T tokens x one kv-head, every stream of its tier:

    store row of (token row r, kv-head h) in [P * Hkv * PAGE] rows: ((r // PAGE) * Hkv + h) * PAGE + r % PAGE
    buffer row of (token i, kv-head h) in a stream [Hkv, n_t]:      h * n_t + i
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import tier_codec as tc
from .paged_layout import TieredKVLayer

_STREAMS = ("k", "v", "k_scale", "k_zero", "v_scale", "v_zero")
COPY_BLOCK = 2048  # bytes per inner step
SLOT_BLOCK = 32  # tokens per program of the slot-addressed kernel


@dataclass(frozen=True)
class PackLayout:
    lens: tuple
    num_kv_heads: int
    row_bytes: tuple  # per tier: (data row bytes, scale row bytes)
    offsets: tuple  # per tier: byte offset of each stream (2 for fp16, 6 for int tiers)
    total_bytes: int


def pack_layout(lens, num_kv_heads: int, head_dim: int, group_size: int = tc.DEFAULT_GROUP_SIZE,
                elem_bytes: int = 2) -> PackLayout:
    rows = ((head_dim * elem_bytes, 0), (head_dim, head_dim // group_size * 2),
            (head_dim // 2, head_dim // group_size * 2))
    offsets, pos = [], 0
    for t in tc.TIERS:
        n = int(lens[t])
        offs = []
        for s in range(2 if t == tc.TIER_FP16 else 6):
            offs.append(pos)
            pos += num_kv_heads * n * rows[t][0 if s < 2 else 1]
        offsets.append(tuple(offs))
    return PackLayout(tuple(int(x) for x in lens), num_kv_heads, rows, tuple(offsets), pos)


@triton.jit
def _move_rows(pool_ptr, buf_ptr, pool_off, buf_off, nbytes, UNPACK: tl.constexpr,
               BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    for c in range(0, nbytes, BLOCK):
        m = c + offs < nbytes
        if UNPACK:
            x = tl.load(buf_ptr + buf_off + c + offs, mask=m)
            tl.store(pool_ptr + pool_off + c + offs, x, mask=m)
        else:
            x = tl.load(pool_ptr + pool_off + c + offs, mask=m)
            tl.store(buf_ptr + buf_off + c + offs, x, mask=m)


@triton.jit
def _move_tier_page(
    buf_ptr, kd_ptr, vd_ptr, ks_ptr, kz_ptr, vs_ptr, vz_ptr, ids_ptr, n_tok, p, h,
    o_k, o_v, o_ks, o_kz, o_vs, o_vz,
    QUANT: tl.constexpr, ROW: tl.constexpr, SROW: tl.constexpr, PAGE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr, UNPACK: tl.constexpr, BLOCK: tl.constexpr,
):
    """Move rows [0, valid) of (page p of this tier's request list, kv-head h), all streams.
    pool block of (page, h): bytes [(page*Hkv + h) * PAGE*ROW, ... + PAGE*ROW)
    buffer stream [Hkv, n_tok, ROW]: (h, p*PAGE) starts at h*n_tok*ROW + p*PAGE*ROW."""
    valid = tl.minimum(n_tok - p * PAGE, PAGE)
    if valid > 0:
        page = tl.load(ids_ptr + p).to(tl.int64)
        blk = page * NUM_KV_HEADS + h
        row0 = h * n_tok + p * PAGE
        _move_rows(kd_ptr, buf_ptr, blk * (PAGE * ROW), o_k + row0 * ROW, valid * ROW, UNPACK, BLOCK)
        _move_rows(vd_ptr, buf_ptr, blk * (PAGE * ROW), o_v + row0 * ROW, valid * ROW, UNPACK, BLOCK)
        if QUANT:
            sp = blk * (PAGE * SROW)
            sn = valid * SROW
            _move_rows(ks_ptr, buf_ptr, sp, o_ks + row0 * SROW, sn, UNPACK, BLOCK)
            _move_rows(kz_ptr, buf_ptr, sp, o_kz + row0 * SROW, sn, UNPACK, BLOCK)
            _move_rows(vs_ptr, buf_ptr, sp, o_vs + row0 * SROW, sn, UNPACK, BLOCK)
            _move_rows(vz_ptr, buf_ptr, sp, o_vz + row0 * SROW, sn, UNPACK, BLOCK)


@triton.jit
def _pack_tiered_kernel(
    buf_ptr,
    k16_ptr, v16_ptr,
    k8_ptr, v8_ptr, k8s_ptr, k8z_ptr, v8s_ptr, v8z_ptr,
    k4_ptr, v4_ptr, k4s_ptr, k4z_ptr, v4s_ptr, v4z_ptr,
    ids16_ptr, ids8_ptr, ids4_ptr, n16, n8, n4,
    o16k, o16v, o8k, o8v, o8ks, o8kz, o8vs, o8vz, o4k, o4v, o4ks, o4kz, o4vs, o4vz,
    ROW16: tl.constexpr, ROW8: tl.constexpr, ROW4: tl.constexpr, SROW: tl.constexpr,
    PAGE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, UNPACK: tl.constexpr, BLOCK: tl.constexpr,
):
    p = tl.program_id(0)
    h = tl.program_id(1)
    tier = tl.program_id(2)
    if tier == 0:
        _move_tier_page(buf_ptr, k16_ptr, v16_ptr, k16_ptr, k16_ptr, k16_ptr, k16_ptr, ids16_ptr,
                        n16, p, h, o16k, o16v, 0, 0, 0, 0,
                        False, ROW16, SROW, PAGE, NUM_KV_HEADS, UNPACK, BLOCK)
    elif tier == 1:
        _move_tier_page(buf_ptr, k8_ptr, v8_ptr, k8s_ptr, k8z_ptr, v8s_ptr, v8z_ptr, ids8_ptr,
                        n8, p, h, o8k, o8v, o8ks, o8kz, o8vs, o8vz,
                        True, ROW8, SROW, PAGE, NUM_KV_HEADS, UNPACK, BLOCK)
    else:
        _move_tier_page(buf_ptr, k4_ptr, v4_ptr, k4s_ptr, k4z_ptr, v4s_ptr, v4z_ptr, ids4_ptr,
                        n4, p, h, o4k, o4v, o4ks, o4kz, o4vs, o4vz,
                        True, ROW4, SROW, PAGE, NUM_KV_HEADS, UNPACK, BLOCK)


def _bytes_view(x: torch.Tensor) -> torch.Tensor:
    assert x.is_contiguous()
    return x.view(torch.uint8)


def _launch(buf, layer: TieredKVLayer, page_ids, lens, unpack: bool) -> PackLayout:
    layer.check()
    PAGE, H = layer.page_size, layer.num_kv_heads
    lay = pack_layout(lens, H, layer.head_dim, layer.group_size, layer[0].k.element_size())
    assert buf.dtype == torch.uint8 and buf.dim() == 1 and buf.is_contiguous()
    assert buf.numel() >= lay.total_bytes, (buf.numel(), lay.total_bytes)
    for t in tc.TIERS:
        ids = page_ids[t]
        assert ids.dtype == torch.int32 and ids.dim() == 1 and ids.is_contiguous()
        assert ids.numel() >= triton.cdiv(int(lens[t]), PAGE), (t, ids.numel(), lens[t])
    max_pages = max(triton.cdiv(int(n), PAGE) for n in lens)
    if max_pages == 0:
        return lay
    f16, i8, i4 = layer.pages
    ptrs = [_bytes_view(x) for tp in (f16, i8, i4) for x in tp.tensors()]
    offs = [o for t in tc.TIERS for o in lay.offsets[t]]
    _pack_tiered_kernel[(max_pages, H, 3)](
        buf, *ptrs, page_ids[0], page_ids[1], page_ids[2], *[int(n) for n in lens], *offs,
        ROW16=lay.row_bytes[0][0], ROW8=lay.row_bytes[1][0], ROW4=lay.row_bytes[2][0],
        SROW=lay.row_bytes[1][1], PAGE=PAGE, NUM_KV_HEADS=H, UNPACK=unpack, BLOCK=COPY_BLOCK,
        num_warps=4,
    )
    return lay


def pack_tiered_kv(layer: TieredKVLayer, page_ids, lens, out=None) -> torch.Tensor:
    """Gather one request's tiered KV of one layer into `out` (uint8, allocated if None)."""
    lay = pack_layout(lens, layer.num_kv_heads, layer.head_dim, layer.group_size,
                      layer[0].k.element_size())
    if out is None:
        out = torch.empty(lay.total_bytes, dtype=torch.uint8, device=layer[0].k.device)
    _launch(out, layer, page_ids, lens, unpack=False)
    return out[:lay.total_bytes]


def unpack_tiered_kv(buf: torch.Tensor, layer: TieredKVLayer, page_ids, lens) -> None:
    """Scatter a buffer made by pack_tiered_kv into this layer's pages `page_ids`."""
    _launch(buf, layer, page_ids, lens, unpack=True)


def _stream_rows(x: torch.Tensor, ids: torch.Tensor, n: int) -> torch.Tensor:
    """pool [P, H, PAGE, W] -> bytes [H, n, W*elem] of the request's first n tokens."""
    PAGE = x.shape[2]
    npg = triton.cdiv(n, PAGE)
    r = x[ids[:npg].long()].permute(1, 0, 2, 3).reshape(x.shape[1], npg * PAGE, x.shape[3])[:, :n]
    return r.contiguous().view(torch.uint8)


def pack_tiered_kv_reference(layer: TieredKVLayer, page_ids, lens) -> torch.Tensor:
    parts = []
    for t in tc.TIERS:
        n = int(lens[t])
        for x in layer[t].tensors():
            parts.append(_stream_rows(x, page_ids[t], n).flatten())
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8)


def unpack_tiered_kv_reference(buf: torch.Tensor, layer: TieredKVLayer, page_ids, lens) -> None:
    PAGE, H = layer.page_size, layer.num_kv_heads
    pos = 0
    for t in tc.TIERS:
        n = int(lens[t])
        ids = page_ids[t].long()
        for x in layer[t].tensors():
            w = x.shape[3]
            nb = H * n * w * x.element_size()
            rows = buf[pos:pos + nb].view(x.dtype).view(H, n, w)
            pos += nb
            i = torch.arange(n, device=x.device)
            x[ids[i // PAGE], :, i % PAGE] = rows.permute(1, 0, 2)


# ---- slot-addressed variant (module docstring)

@triton.jit
def _move_stream_rows(pool_ptr, buf_ptr, pool_row, buf_row, tmask, ROW: tl.constexpr,
                      ROWP: tl.constexpr, UNPACK: tl.constexpr):
    """Move [BLOCK_T, ROW] bytes: pool rows pool_row (int64 [BLOCK_T], in units of ROW bytes)
    <-> buffer rows buf_row. ROWP: next power of two >= ROW."""
    cols = tl.arange(0, ROWP)
    m = tmask[:, None] & (cols < ROW)[None, :]
    p_off = pool_row[:, None] * ROW + cols[None, :]
    b_off = buf_row[:, None] * ROW + cols[None, :]
    if UNPACK:
        tl.store(pool_ptr + p_off, tl.load(buf_ptr + b_off, mask=m), mask=m)
    else:
        tl.store(buf_ptr + b_off, tl.load(pool_ptr + p_off, mask=m), mask=m)


@triton.jit
def _move_tier_slots(
    buf_ptr, kd_ptr, vd_ptr, ks_ptr, kz_ptr, vs_ptr, vz_ptr, slots_ptr, n_tok, i0, h,
    o_k, o_v, o_ks, o_kz, o_vs, o_vz,
    QUANT: tl.constexpr, ROW: tl.constexpr, SROW: tl.constexpr, ROWP: tl.constexpr, SROWP: tl.constexpr,
    PAGE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, UNPACK: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """Tokens [i0, i0 + BLOCK_T) of one tier's slot list, kv-head h, every stream.
    Buffer stream s starts at byte o_s; its rows are ROW (data) or SROW (scale) bytes."""
    i = i0 + tl.arange(0, BLOCK_T)
    tmask = i < n_tok
    r = tl.load(slots_ptr + i, mask=tmask, other=0).to(tl.int64)
    prow = ((r // PAGE) * NUM_KV_HEADS + h) * PAGE + r % PAGE
    brow = h * n_tok + i.to(tl.int64)
    _move_stream_rows(kd_ptr, buf_ptr + o_k, prow, brow, tmask, ROW, ROWP, UNPACK)
    _move_stream_rows(vd_ptr, buf_ptr + o_v, prow, brow, tmask, ROW, ROWP, UNPACK)
    if QUANT:
        _move_stream_rows(ks_ptr, buf_ptr + o_ks, prow, brow, tmask, SROW, SROWP, UNPACK)
        _move_stream_rows(kz_ptr, buf_ptr + o_kz, prow, brow, tmask, SROW, SROWP, UNPACK)
        _move_stream_rows(vs_ptr, buf_ptr + o_vs, prow, brow, tmask, SROW, SROWP, UNPACK)
        _move_stream_rows(vz_ptr, buf_ptr + o_vz, prow, brow, tmask, SROW, SROWP, UNPACK)


@triton.jit
def _pack_slots_kernel(
    buf_ptr,
    k16_ptr, v16_ptr,
    k8_ptr, v8_ptr, k8s_ptr, k8z_ptr, v8s_ptr, v8z_ptr,
    k4_ptr, v4_ptr, k4s_ptr, k4z_ptr, v4s_ptr, v4z_ptr,
    slots16_ptr, slots8_ptr, slots4_ptr, n16, n8, n4,
    o16k, o16v, o8k, o8v, o8ks, o8kz, o8vs, o8vz, o4k, o4v, o4ks, o4kz, o4vs, o4vz,
    ROW16: tl.constexpr, ROW8: tl.constexpr, ROW4: tl.constexpr, SROW: tl.constexpr,
    ROWP16: tl.constexpr, ROWP8: tl.constexpr, ROWP4: tl.constexpr, SROWP: tl.constexpr,
    PAGE16: tl.constexpr, PAGE8: tl.constexpr, PAGE4: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr, UNPACK: tl.constexpr, BLOCK_T: tl.constexpr,
):
    i0 = tl.program_id(0) * BLOCK_T
    h = tl.program_id(1)
    tier = tl.program_id(2)
    if tier == 0:
        if i0 < n16:
            _move_tier_slots(buf_ptr, k16_ptr, v16_ptr, k16_ptr, k16_ptr, k16_ptr, k16_ptr, slots16_ptr,
                             n16, i0, h, o16k, o16v, 0, 0, 0, 0,
                             False, ROW16, SROW, ROWP16, SROWP, PAGE16, NUM_KV_HEADS, UNPACK, BLOCK_T)
    elif tier == 1:
        if i0 < n8:
            _move_tier_slots(buf_ptr, k8_ptr, v8_ptr, k8s_ptr, k8z_ptr, v8s_ptr, v8z_ptr, slots8_ptr,
                             n8, i0, h, o8k, o8v, o8ks, o8kz, o8vs, o8vz,
                             True, ROW8, SROW, ROWP8, SROWP, PAGE8, NUM_KV_HEADS, UNPACK, BLOCK_T)
    else:
        if i0 < n4:
            _move_tier_slots(buf_ptr, k4_ptr, v4_ptr, k4s_ptr, k4z_ptr, v4s_ptr, v4z_ptr, slots4_ptr,
                             n4, i0, h, o4k, o4v, o4ks, o4kz, o4vs, o4vz,
                             True, ROW4, SROW, ROWP4, SROWP, PAGE4, NUM_KV_HEADS, UNPACK, BLOCK_T)


def _slot_lens(slots) -> tuple:
    for x in slots:
        assert x.dtype == torch.int32 and x.dim() == 1 and x.is_contiguous(), (x.dtype, x.shape)
    return tuple(int(x.numel()) for x in slots)


def _launch_slots(buf, layer: TieredKVLayer, slots, unpack: bool) -> PackLayout:
    layer.check(uniform=False)
    H = layer.num_kv_heads
    lens = _slot_lens(slots)
    lay = pack_layout(lens, H, layer.head_dim, layer.group_size, layer[0].k.element_size())
    assert buf.dtype == torch.uint8 and buf.dim() == 1 and buf.is_contiguous()
    assert buf.numel() >= lay.total_bytes, (buf.numel(), lay.total_bytes)
    if max(lens) == 0:
        return lay
    ptrs = [_bytes_view(x) for tp in layer.pages for x in tp.tensors()]
    offs = [o for t in tc.TIERS for o in lay.offsets[t]]
    _pack_slots_kernel[(triton.cdiv(max(lens), SLOT_BLOCK), H, 3)](
        buf, *ptrs, slots[0], slots[1], slots[2], *lens, *offs,
        ROW16=lay.row_bytes[0][0], ROW8=lay.row_bytes[1][0], ROW4=lay.row_bytes[2][0],
        SROW=lay.row_bytes[1][1], ROWP16=triton.next_power_of_2(lay.row_bytes[0][0]),
        ROWP8=triton.next_power_of_2(lay.row_bytes[1][0]), ROWP4=triton.next_power_of_2(lay.row_bytes[2][0]),
        SROWP=triton.next_power_of_2(lay.row_bytes[1][1]), PAGE16=layer.page_size_of(0), PAGE8=layer.page_size_of(1),
        PAGE4=layer.page_size_of(2), NUM_KV_HEADS=H, UNPACK=unpack, BLOCK_T=SLOT_BLOCK, num_warps=4,
    )
    return lay


def pack_tiered_kv_slots(layer: TieredKVLayer, slots, out=None) -> torch.Tensor:
    """Gather the tokens at `slots` (per tier: int32 token rows page * PAGE_t + offset) of one
    layer into `out` (uint8, allocated if None), in pack_tiered_kv's format."""
    lay = pack_layout(_slot_lens(slots), layer.num_kv_heads, layer.head_dim, layer.group_size,
                      layer[0].k.element_size())
    if out is None:
        out = torch.empty(lay.total_bytes, dtype=torch.uint8, device=layer[0].k.device)
    _launch_slots(out, layer, slots, unpack=False)
    return out[:lay.total_bytes]


def unpack_tiered_kv_slots(buf: torch.Tensor, layer: TieredKVLayer, slots) -> None:
    """Scatter a packed buffer (either pack variant) into this layer's `slots` (per tier)."""
    _launch_slots(buf, layer, slots, unpack=True)


def _slot_index(x: torch.Tensor, rows: torch.Tensor):
    """Token rows -> (page, offset) index tensors into a [P, H, PAGE, W] store."""
    rows = rows.long().to(x.device)
    return rows // x.shape[2], rows % x.shape[2]


def pack_tiered_kv_slots_reference(layer: TieredKVLayer, slots) -> torch.Tensor:
    parts = []
    for t in tc.TIERS:
        if slots[t].numel() == 0:
            continue
        for x in layer[t].tensors():
            page, off = _slot_index(x, slots[t])
            parts.append(x[page, :, off].permute(1, 0, 2).contiguous().view(torch.uint8).flatten())
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8)


def unpack_tiered_kv_slots_reference(buf: torch.Tensor, layer: TieredKVLayer, slots) -> None:
    H, pos = layer.num_kv_heads, 0
    for t in tc.TIERS:
        n = int(slots[t].numel())
        for x in layer[t].tensors():
            w = x.shape[3]
            nb = H * n * w * x.element_size()
            rows = buf[pos:pos + nb].to(x.device).view(x.dtype).view(H, n, w)
            pos += nb
            page, off = _slot_index(x, slots[t])
            x[page, :, off] = rows.permute(1, 0, 2)
