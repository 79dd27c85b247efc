"""TieredKVPool (SpectrumKV): each token's K/V lives in the store of its precision tier.

Global slot ids (what req_to_token rows and radix nodes hold) cover three stores back to back:

    0 | 1 ......... n16 | n16+1   | b8 ............ b8+n8-1 | b4 ............ b4+n4-1
    pad   fp16 store      scratch   int8 store (pages)        int4 store (pages)
          (every new token is written here; the scheduler's allocator hands out these ids)

    b8 = base(int8) = n16 + 2,  b4 = base(int4) = b8 + n8      (n8, n4: whole pages of PAGE)
    fp16 id s      -> row s of the fp16 store (row 0 = padding, row n16+1 = CUDA-graph scratch)
    int id s       -> page (s - base(t)) // PAGE, offset (s - base(t)) % PAGE of store t

Per layer, store t holds the codec's format (kernels/tier_codec.py, group size G), the int
stores in kernels/paged_layout.py's head-major pages (its TierPages, PAGE = kv_tier_page_size):
    fp16   k, v  [n16 + 2, Hkv, D]            model dtype (slot-granular: PAGE 1)
    int8   k, v  [n8 / PAGE, Hkv, PAGE, D]    uint8    k/v scale, zero [n8 / PAGE, Hkv, PAGE, D / G] fp16
    int4   k, v  [n4 / PAGE, Hkv, PAGE, D/2]  uint8    k/v scale, zero likewise

Invariants: a token's tier is a function of its slot id (`tier_of`); slot 0 in a request row
is a dropped token (TIER_DROP), masked by attention (`drops_tokens`), never read as data.
`move` copies data only: who owns an id (and which page slots are live) is
TieredSlotAllocator's business. The stores are allocated once (CUDA graphs keep their
addresses); only `resize_int_stores` (start-up, empty stores) reallocates the int ones.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from sgl_kvxfer.kernels.tier_codec import dequantize, payload_bytes, quantize
from sgl_kvxfer.mem_cache.kv_pool import KVPool
from sgl_kvxfer.mem_cache.tier_plan import TierStorePlan, split_int_stores
from sgl_kvxfer.spectrum.formats import IntFormat, StoreFormats
from sgl_kvxfer.spectrum.tiers import TIER_DROP, TIER_FP16, TIER_INT4, TIER_INT8

INT_TIERS = (TIER_INT8, TIER_INT4)
DEFAULT_TIER_PAGE_SIZE = 64
_STREAMS = ("k", "v", "k_scale", "k_zero", "v_scale", "v_zero")


@dataclass
class SlotRoute:
    """Where each of a set of slot ids lives, as _split yields it: (tier, positions in the flat
    ids or None (all in one store), rows (fp16) or (page, offset) (int)). Built once by
    TieredKVPool.route and reused for every layer, so per-layer get/set run no host sync."""

    shape: tuple
    parts: list


class _IntPages:
    """One layer's int store in the codec's format: packed codes plus fp16 scale/zero per group,
    in pages. `bits` is the store's format in this layer (8 or 4; spectrum/formats.py)."""

    relocatable = True  # codes mean the same on any page: relocation copies them bit for bit

    def __init__(self, bits: int, pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                 group_size: int, device: str):
        self.bits, self.group_size = bits, group_size
        width = head_dim if bits == 8 else head_dim // 2
        shape = (pages, num_kv_heads, page_size, width)
        sshape = (pages, num_kv_heads, page_size, head_dim // group_size)
        self.k = torch.zeros(shape, dtype=torch.uint8, device=device)
        self.v = torch.zeros_like(self.k)
        self.k_scale, self.k_zero, self.v_scale, self.v_zero = (
            torch.zeros(sshape, dtype=torch.float16, device=device) for _ in range(4))

    def tensors(self) -> tuple:
        return tuple(getattr(self, s) for s in _STREAMS)

    def write(self, page, off, k, v):
        # x[page, :, off] with index tensors page, off [n] addresses [n, Hkv, W]
        bits, g = self.bits, self.group_size
        self.k[page, :, off], self.k_scale[page, :, off], self.k_zero[page, :, off] = quantize(k, bits, g)
        self.v[page, :, off], self.v_scale[page, :, off], self.v_zero[page, :, off] = quantize(v, bits, g)

    def codes(self, page, off) -> tuple:
        """The six streams of tokens (page, off) as [n, Hkv, W] (k, v, k_scale, k_zero, v_scale, v_zero)."""
        return tuple(x[page, :, off] for x in self.tensors())

    def put_codes(self, page, off, parts) -> None:
        for x, src in zip(self.tensors(), parts):
            x[page, :, off] = src

    def read(self, page, off, dtype):
        kq, vq, ks, kz, vs, vz = self.codes(page, off)
        return (dequantize(kq, ks, kz, self.bits, self.group_size, dtype),
                dequantize(vq, vs, vz, self.bits, self.group_size, dtype))

    def read_keys(self, page, off, dtype):
        return dequantize(self.k[page, :, off], self.k_scale[page, :, off], self.k_zero[page, :, off], self.bits,
                          self.group_size, dtype)


def _int_pages(fmt: IntFormat, pages: int, page_size: int, num_kv_heads: int, head_dim: int, group_size: int,
               device: str):
    """The store class of one layer's int store format (spectrum/formats.py)."""
    if fmt.key_axis == "channel":
        from sgl_kvxfer.mem_cache.kivi_pages import ChannelKeyIntPages

        return ChannelKeyIntPages(fmt.bits, pages, page_size, num_kv_heads, head_dim, group_size, device)
    return _IntPages(fmt.bits, pages, page_size, num_kv_heads, head_dim, group_size, device)


class TieredKVPool(KVPool):
    drops_tokens = True
    layout = "tiered"

    def __init__(self, size: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: str, plan: TierStorePlan, group_size: int = 32,
                 page_size: int = DEFAULT_TIER_PAGE_SIZE, formats: StoreFormats | None = None):
        super().__init__(plan.total, num_layers, num_kv_heads, head_dim, dtype, device)
        self.formats = formats or StoreFormats.uniform(num_layers)
        if self.formats.num_layers != num_layers:
            raise ValueError(f"store formats cover {self.formats.num_layers} layers, the pool {num_layers}")
        if group_size < 2 or head_dim % group_size:
            raise ValueError(f"head_dim {head_dim} must be a multiple of kv_quant_group_size {group_size}")
        if page_size < 1:
            raise ValueError(f"kv_tier_page_size must be >= 1, got {page_size}")
        self.memory_tokens = size  # fp16 tokens whose memory the stores share
        self.group_size = group_size
        self.page_size = page_size  # of the int stores (the fp16 store is slot-granular)
        shape = (plan.n16 + 2, num_kv_heads, head_dim)  # + padding row 0 and the scratch row
        self.k16 = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v16 = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.scratch_slot = plan.n16 + 1  # CUDA-graph padding rows write here; never handed out
        self._alloc_int_stores(plan)
        self._occupancy: Callable[[], dict[int, int]] | None = None
        # host fp16 copies of int4 tokens (scheduler/cold_tier.py); None: no cold tier
        self.cold = None

    def _alloc_int_stores(self, plan: TierStorePlan) -> None:
        P = self.page_size
        plan = TierStorePlan(plan.n16, plan.n8 - plan.n8 % P, plan.n4 - plan.n4 % P)  # whole pages
        self.plan = plan
        self.size = plan.total
        counts = {TIER_INT8: plan.n8, TIER_INT4: plan.n4}
        self.stores = {t: [_int_pages(self.formats.of(t, layer), counts[t] // P, P, self.num_kv_heads, self.head_dim,
                                      self.group_size, self.device) for layer in range(self.num_layers)]
                       for t in INT_TIERS}

    def int_store_sizes(self, f8: float, f4: float, formats: StoreFormats | None = None) -> tuple[int, int]:
        """(n8, n4), whole pages, for an int mix f8 : f4 in the memory the fp16 store leaves over
        (int token bytes of `formats`, default the pool's own)."""
        left = self.memory_tokens * self.full_bytes_per_token() - (self.plan.n16 + 2) * self.token_bytes(TIER_FP16)
        old, self.formats = self.formats, formats or self.formats
        try:
            b8, b4 = self.token_bytes(TIER_INT8), self.token_bytes(TIER_INT4)
        finally:
            self.formats = old
        return split_int_stores(left, f8, f4, b8, b4, self.page_size)

    def resize_int_stores(self, n8: int, n4: int, formats: StoreFormats | None = None) -> None:
        """Re-divide the int stores (int4 probe changed the mix; new per-layer formats). Only while
        they hold nothing. NOTE: new tensors: anything holding views of the old ones (captured CUDA
        graphs, layer views) must be rebuilt (ModelRunner.kv_pool_resized)."""
        if formats is not None:
            if formats.num_layers != self.num_layers:
                raise ValueError(f"store formats cover {formats.num_layers} layers, the pool {self.num_layers}")
            self.formats = formats
        self.stores = {}
        self._alloc_int_stores(TierStorePlan(self.plan.n16, n8, n4))
        if self.cold is not None:  # ids of the old int4 store: their host copies are void
            self.cold.rebind(self.base(TIER_INT4), self.plan.n4)

    # ------------------------------------------------------------------ slot id ranges
    def num_slots(self, tier: int) -> int:
        return {TIER_FP16: self.plan.n16, TIER_INT8: self.plan.n8, TIER_INT4: self.plan.n4}[tier]

    def num_pages(self, tier: int) -> int:
        """Pages of an int store."""
        return self.num_slots(tier) // self.page_size

    def base(self, tier: int) -> int:
        """First global id of a store (fp16: 0, the padding row)."""
        return {TIER_FP16: 0, TIER_INT8: self.plan.n16 + 2, TIER_INT4: self.plan.n16 + 2 + self.plan.n8}[tier]

    @property
    def id_end(self) -> int:
        """One past the largest global id."""
        return self.base(TIER_INT4) + self.plan.n4

    def tier_of(self, slots: torch.Tensor) -> torch.Tensor:
        """int8 tier id of every slot id (0 -> TIER_DROP)."""
        tiers = torch.full(slots.shape, TIER_FP16, dtype=torch.int8, device=slots.device)
        tiers[slots >= self.base(TIER_INT8)] = TIER_INT8
        tiers[slots >= self.base(TIER_INT4)] = TIER_INT4
        tiers[slots == 0] = TIER_DROP
        return tiers

    def page_offset(self, tier: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(page, offset in page) of int ids of store `tier`."""
        r = slots - self.base(tier)
        return r // self.page_size, r % self.page_size

    def _split(self, flat: torch.Tensor):
        """Yield (tier, positions in flat, store index) for each store that `flat` touches: the
        fp16 row, or (page, offset) for an int store."""
        b8, b4 = self.base(TIER_INT8), self.base(TIER_INT4)
        is16 = flat < b8
        if bool(is16.all()):
            yield TIER_FP16, None, flat
            return
        for tier, mask in ((TIER_FP16, is16), (TIER_INT8, (flat >= b8) & (flat < b4)), (TIER_INT4, flat >= b4)):
            pos = mask.nonzero().squeeze(1)
            if pos.numel():
                ids = flat[pos]
                yield tier, pos, ids if tier == TIER_FP16 else self.page_offset(tier, ids)

    # ------------------------------------------------------------------ KVPool
    def route(self, slots: torch.Tensor) -> SlotRoute:
        """_split on the host (one device-to-host copy of `slots` at most), its index tensors
        then moved to the pool's device: get_kv_routed / set_kv_routed over these slots in every
        layer run without a host sync. (get_kv / set_kv split on the slots' own device, which
        syncs per call on a GPU.)"""
        flat = slots.reshape(-1).cpu()
        dev = self._to_device
        parts = [(tier, None if pos is None else dev(pos), dev(where) if tier == TIER_FP16 else tuple(map(dev, where)))
                 for tier, pos, where in self._split(flat)]
        return SlotRoute(tuple(slots.shape), parts)

    def _to_device(self, x: torch.Tensor) -> torch.Tensor:
        if str(self.device).startswith("cuda"):
            return x.pin_memory().to(self.device, non_blocking=True)
        return x.to(self.device)

    def set_kv(self, layer_id, slots, k, v):
        self.set_kv_routed(layer_id, SlotRoute(tuple(slots.shape), list(self._split(slots.reshape(-1)))), k, v)

    def set_kv_routed(self, layer_id: int, route: SlotRoute, k, v) -> None:
        for tier, pos, where in route.parts:
            kk, vv = (k, v) if pos is None else (k[pos], v[pos])
            if tier == TIER_FP16:
                self.k16[layer_id][where] = kk.to(self.dtype)
                self.v16[layer_id][where] = vv.to(self.dtype)
            else:
                self.stores[tier][layer_id].write(*where, kk, vv)

    def set_kv_fp16(self, layer_id, slots, k, v):
        """set_kv for ids known to be fp16 (new tokens): no host sync, CUDA-graph safe."""
        self.k16[layer_id][slots] = k.to(self.dtype)
        self.v16[layer_id][slots] = v.to(self.dtype)

    def get_kv(self, layer_id, slots):
        return self.get_kv_routed(layer_id, SlotRoute(tuple(slots.shape), list(self._split(slots.reshape(-1)))))

    def get_kv_routed(self, layer_id: int, route: SlotRoute):
        n = 1
        for d in route.shape:
            n *= d
        out_shape = (*route.shape, self.num_kv_heads, self.head_dim)
        k = torch.empty((n, self.num_kv_heads, self.head_dim), dtype=self.dtype, device=self.device)
        v = torch.empty_like(k)
        for tier, pos, where in route.parts:
            if tier == TIER_FP16:
                kk, vv = self.k16[layer_id].index_select(0, where), self.v16[layer_id].index_select(0, where)
            else:
                kk, vv = self.stores[tier][layer_id].read(*where, self.dtype)
            if pos is None:
                return kk.view(out_shape), vv.view(out_shape)
            k.index_copy_(0, pos, kk)
            v.index_copy_(0, pos, vv)
        return k.view(out_shape), v.view(out_shape)

    def get_k_routed(self, layer_id: int, route: SlotRoute) -> torch.Tensor:
        """Keys only of get_kv_routed, [*shape, Hkv, D] (the cold tier's scoring reads no values)."""
        n = 1
        for d in route.shape:
            n *= d
        k = torch.empty((n, self.num_kv_heads, self.head_dim), dtype=self.dtype, device=self.device)
        for tier, pos, where in route.parts:
            if tier == TIER_FP16:
                kk = self.k16[layer_id].index_select(0, where)
            else:
                kk = self.stores[tier][layer_id].read_keys(*where, self.dtype)
            if pos is None:
                return kk.view(*route.shape, self.num_kv_heads, self.head_dim)
            k.index_copy_(0, pos, kk)
        return k.view(*route.shape, self.num_kv_heads, self.head_dim)

    def stored_codes(self, layer_id: int, tier: int, slots: torch.Tensor) -> tuple:
        """The stored streams (k, v, k_scale, k_zero, v_scale, v_zero) [n, Hkv, W] of int ids of `tier`."""
        return self.stores[tier][layer_id].codes(*self.page_offset(tier, slots))

    def put_codes(self, layer_id: int, tier: int, slots: torch.Tensor, parts) -> None:
        """Write stored streams (as stored_codes returns them) at int ids of `tier`, as they are."""
        self.stores[tier][layer_id].put_codes(*self.page_offset(tier, slots), parts)

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy tokens src -> dst in every layer, quantizing into dst's store. Ids of the same
        int tier on both sides copy their codes bit for bit (relocation, not requantization).
        Which store each id is in is worked out once, on the host; the layer loop runs no sync."""
        src, dst = src.reshape(-1).cpu(), dst.reshape(-1).cpu()
        ts, td = self.tier_of(src), self.tier_of(dst)
        same = (ts == td) & (ts != TIER_FP16)
        for tier in INT_TIERS:  # per-page key scales (KIVI): requantize instead of copying codes
            if not all(store.relocatable for store in self.stores[tier]):
                same &= ts != tier
        relocate = []
        for tier in INT_TIERS:
            m = same & (ts == tier)
            if bool(m.any()):
                relocate.append((tier, tuple(map(self._to_device, self.page_offset(tier, src[m]))),
                                 tuple(map(self._to_device, self.page_offset(tier, dst[m])))))
        rest = ~same
        requant = (self.route(src[rest]), self.route(dst[rest])) if bool(rest.any()) else None
        capture = self.cold.begin_move(src, dst, ts, td, rest) if self.cold is not None else None
        for layer_id in range(self.num_layers):
            for tier, s_where, d_where in relocate:
                store = self.stores[tier][layer_id]
                store.put_codes(*d_where, store.codes(*s_where))
            if requant is not None:
                k, v = self.get_kv_routed(layer_id, requant[0])
                self.set_kv_routed(layer_id, requant[1], k, v)
                if capture is not None:  # NOTE: k, v are the exact fp16 values of demoted tokens
                    self.cold.capture(capture, layer_id, k, v)
        if capture is not None:
            self.cold.end_move(capture)

    # ------------------------------------------------------------------ bytes
    def token_bytes(self, tier: int, with_scales: bool = True) -> float:
        """Bytes one token takes in a store, all layers, K and V (fp16 store: model dtype; int
        stores: their per-layer formats, a fraction where channel-axis keys amortize page scales)."""
        if tier in INT_TIERS and not self.formats.is_uniform:
            return self.formats.token_bytes(tier, self.num_kv_heads, self.head_dim, self.group_size,
                                            self.page_size, 2 if with_scales else 0)
        elem = torch.finfo(self.dtype).bits // 8
        head = payload_bytes(tier, self.head_dim, self.group_size, elem, with_scales)
        return 2 * self.num_layers * self.num_kv_heads * head

    def full_bytes_per_token(self) -> int:
        return self.token_bytes(TIER_FP16)

    def bind_occupancy(self, occupancy: Callable[[], dict[int, int]]) -> None:
        """The allocator that owns the ids reports how many slots of each store are in use."""
        self._occupancy = occupancy

    def bytes_per_token(self, with_scales: bool = True) -> float:
        """Resident average: bytes of the tokens held now / their count (dropped tokens hold no
        slot and are not counted; unused tail slots of int pages are not counted either).
        Before any token is resident: the planned store mix."""
        used = self._occupancy() if self._occupancy is not None else {}
        if sum(used.values()) == 0:
            used = {TIER_FP16: self.plan.n16, TIER_INT8: self.plan.n8, TIER_INT4: self.plan.n4}
        total = sum(used.values())
        return sum(c * self.token_bytes(t, with_scales) for t, c in used.items()) / max(total, 1)
