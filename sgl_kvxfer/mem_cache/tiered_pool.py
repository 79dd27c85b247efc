"""TieredKVPool (SpectrumKV): each token's K/V lives in the store of its precision tier.

Global slot ids (what req_to_token rows and radix nodes hold) cover three stores back to back:

    0 | 1 ......... n16 | n16+1   | b8 ............ b8+n8-1 | b4 ............ b4+n4-1
    pad   fp16 store      scratch   int8 store (pages)        int4 store (pages)
          (every new token is written here; the scheduler's allocator hands out these ids)

    b8 = base(int8) = n16 + 2,  b4 = base(int4) = b8 + n8      (n8, n4: whole pages of PAGE)
    fp16 id s      -> row s of the fp16 store (row 0 = padding, row n16+1 = CUDA-graph scratch)
    int id s       -> page (s - base(t)) // PAGE, offset (s - base(t)) % PAGE of store t

Per layer, store t holds the codec's format (kernels/tier_codec.py, group size G), the int
stores as kernels/paged_layout.py's page-head blocks (its TierPages, PAGE = kv_tier_page_size),
unless `formats` (spectrum/formats.py) gives a layer's int store another format: a token-axis
int8 block in the int4 store (per-layer budgets), or KIVI's channel-key pages (int8c / int4c /
int2c, mem_cache/kivi_pages.py; read by the torch attention backend only):
    fp16   k, v  [n16 + 2, Hkv, D]                  model dtype (slot-granular: PAGE 1)
    int8   k, v  [n8 / PAGE, Hkv, BLOCK] uint8      per (page, kv head): codes (K token-major,
    int4   k, v  [n4 / PAGE, Hkv, BLOCK] uint8      V dim-major), then PAGE scales, PAGE zeros (fp16)

Invariants: a token's tier is a function of its slot id (`tier_of`); slot 0 in a request row
is a dropped token (TIER_DROP), masked by attention (`drops_tokens`), never read as data.
`move` copies data only: who owns an id (and which page slots are live) is
TieredSlotAllocator's business. The stores are allocated once, never resized (CUDA graphs keep
their addresses); the int4 decision and the per-layer formats that size them are made before the
pool is built (mem_cache/__init__.py: create_kv_pool).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from sgl_kvxfer.kernels.paged_layout import TierPages, block_bytes, int_tier_pages
from sgl_kvxfer.kernels.tier_codec import TIER_BITS, dequantize, payload_bytes
from sgl_kvxfer.mem_cache.kv_pool import KVPool
from sgl_kvxfer.mem_cache.tier_plan import TierStorePlan
from sgl_kvxfer.spectrum.formats import IntFormat, StoreFormats
from sgl_kvxfer.spectrum.tiers import TIER_DROP, TIER_FP16, TIER_INT4, TIER_INT8

INT_TIERS = (TIER_INT8, TIER_INT4)
DEFAULT_TIER_PAGE_SIZE = 64


@dataclass
class SlotRoute:
    """Where each of a set of slot ids lives, as _split yields it: (tier, positions in the flat
    ids or None (all in one store), rows (fp16) or (page, offset) (int)). Built once by
    TieredKVPool.route and reused for every layer, so per-layer get/set run no host sync."""

    shape: tuple
    parts: list


def _int_pages(fmt: IntFormat, pages: int, page_size: int, num_kv_heads: int, head_dim: int, group_size: int,
               device: str):
    """One layer's int store in format `fmt`: page-head blocks (token key axis, 8 or 4 bits), or
    KIVI's channel-key pages."""
    if fmt.key_axis == "channel":
        from sgl_kvxfer.mem_cache.kivi_pages import ChannelKeyIntPages

        return ChannelKeyIntPages(fmt.bits, pages, page_size, num_kv_heads, head_dim, group_size, device)
    tier = TIER_INT8 if fmt.bits == 8 else TIER_INT4
    return int_tier_pages(tier, pages, page_size, num_kv_heads, head_dim, group_size, device)


def _read_keys(store, page, off, dtype) -> torch.Tensor:
    """Keys only of an int store's tokens (page, off), [n, Hkv, D]."""
    if isinstance(store, TierPages):
        return dequantize(store.k_codes[page, :, off], store.k_scale[page, :, off], store.k_zero[page, :, off],
                          TIER_BITS[store.tier], store.group_size, dtype)
    return store.read_keys(page, off, dtype)


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
        if group_size < 2 or head_dim % group_size or (group_size != head_dim and (head_dim // 2) % group_size):
            raise ValueError(f"kv_quant_group_size {group_size} must be head_dim ({head_dim}) or divide "
                             f"head_dim / 2 (int4 packs channels j and j + head_dim / 2 in one byte)")
        if page_size < 1:
            raise ValueError(f"kv_tier_page_size must be >= 1, got {page_size}")
        self.memory_tokens = size  # fp16 tokens whose memory the stores share
        self.group_size = group_size
        self.page_size = page_size  # of the int stores (the fp16 store is slot-granular)
        shape = (plan.n16 + 2, num_kv_heads, head_dim)  # + padding row 0 and the scratch row
        # every layer's rows in one tensor [L, rows, Hkv, D]; k16[layer] is a view of it, so a
        # transfer gathers or scatters all layers' rows in one op (stacked_rows, kv_payload.py)
        self._k16_all = torch.zeros((num_layers, *shape), dtype=dtype, device=device)
        self._v16_all = torch.zeros((num_layers, *shape), dtype=dtype, device=device)
        self.k16, self.v16 = list(self._k16_all.unbind(0)), list(self._v16_all.unbind(0))
        self.scratch_slot = plan.n16 + 1  # CUDA-graph padding rows write here; never handed out
        self._alloc_int_stores(plan)
        self._occupancy: Callable[[], dict[int, int]] | None = None
        # re-tiering quantizes with kernels/tier_store.py on CUDA into page-head blocks (the torch
        # codec elsewhere and for KIVI pages: same bytes for the blocks)
        self._fused_quantize = str(device).startswith("cuda")
        # int -> same-int moves: one relocation launch per (layer, tier) on CUDA (tier_relocate.py)
        self._fused_relocate = str(device).startswith("cuda")
        # get_kv_no_sync: one gather launch per layer on CUDA for page-head block stores
        # (tiered_gather.py); per-layer formats (KIVI pages) and the CPU take the torch form
        self._fused_gather = str(device).startswith("cuda") and self.formats.is_uniform
        # host fp16 copies of int4 tokens (scheduler/cold_tier.py); None: no cold tier
        self.cold = None

    def _alloc_int_stores(self, plan: TierStorePlan) -> None:
        P = self.page_size
        plan = TierStorePlan(plan.n16, plan.n8 - plan.n8 % P, plan.n4 - plan.n4 % P)  # whole pages
        self.plan = plan
        self.size = plan.total
        counts = {TIER_INT8: plan.n8, TIER_INT4: plan.n4}
        self._int_all = {}  # tier -> TierPages of every layer's blocks (uniform page-head formats)
        if self.formats.is_uniform:
            # one [L * pages, Hkv, BLOCK] tensor per tier and K / V; each layer's store is a view
            self.stores = {}
            for t in INT_TIERS:
                n = counts[t] // P
                shape = (self.num_layers * n, self.num_kv_heads, block_bytes(t, P, self.head_dim, self.group_size))
                k = torch.zeros(shape, dtype=torch.uint8, device=self.device)
                v = torch.zeros(shape, dtype=torch.uint8, device=self.device)
                self._int_all[t] = TierPages(t, k, v, P, self.head_dim, self.group_size)
                self.stores[t] = [TierPages(t, k[l * n:(l + 1) * n], v[l * n:(l + 1) * n], P, self.head_dim,
                                            self.group_size) for l in range(self.num_layers)]
            return
        self.stores = {t: [_int_pages(self.formats.of(t, layer), counts[t] // P, P, self.num_kv_heads, self.head_dim,
                                      self.group_size, self.device) for layer in range(self.num_layers)]
                       for t in INT_TIERS}

    # ------------------------------------------------------------------ all layers at once
    def stacked_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) fp16-store rows of every layer, [L, rows, Hkv, D] (k16[layer] is [layer])."""
        return self._k16_all, self._v16_all

    def stacked_store(self, tier: int) -> TierPages | None:
        """Every layer's int store `tier` as one TierPages of L * num_pages(tier) pages: layer l's
        page p is page l * num_pages(tier) + p. None: per-layer formats (not stacked)."""
        return self._int_all.get(tier)

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

    def fp16_route(self, slots: torch.Tensor) -> SlotRoute:
        """route() of ids the caller knows are all fp16 ids (a prompt's own tokens before its
        re-tier): the ids stay on their device and nothing is read back, so building it never
        waits for the stream (route's one host copy waits for everything queued before it, e.g.
        the previous chunk's whole forward when chunks overlap). Wrong ids would read the wrong
        rows: only the caller can know this holds."""
        return SlotRoute(tuple(slots.shape), [(TIER_FP16, None, slots.reshape(-1))])

    def _to_device(self, x: torch.Tensor) -> torch.Tensor:
        if str(self.device).startswith("cuda"):
            return x.pin_memory().to(self.device, non_blocking=True)
        return x.to(self.device)

    def _to_device_many(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        """_to_device of each host tensor of `xs`, as ONE copy per dtype: concatenated, staged
        once (CUDA: one pinned block, one non-blocking DMA) and split into views of the result."""
        out: list = [None] * len(xs)
        by_dtype: dict = {}
        for i, x in enumerate(xs):
            by_dtype.setdefault(x.dtype, []).append(i)
        for at in by_dtype.values():
            flat = self._to_device(torch.cat([xs[i].reshape(-1) for i in at]))
            for i, part in zip(at, flat.split([xs[i].numel() for i in at])):
                out[i] = part.view(xs[i].shape)
        return out

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

    def get_kv_no_sync(self, layer_id, slots):
        """get_kv with no host sync (get_kv splits the ids by store on the host). On CUDA one
        gather launch (kernels/tiered_gather.py: each id read from its own store); elsewhere
        every id is read from each store with its id clamped into that store's range, and a
        select keeps the read of the store it is in (about three times get_kv's reads). Dropped
        tokens (id 0) read the zero padding row."""
        flat = slots.reshape(-1)
        b8, b4 = self.base(TIER_INT8), self.base(TIER_INT4)
        shape = (*slots.shape, self.num_kv_heads, self.head_dim)
        if self._fused_gather:
            from sgl_kvxfer.kernels.tiered_gather import gather_tiered_kv

            int8, int4 = (self.stores[t][layer_id] if self.num_pages(t) else None for t in INT_TIERS)
            k, v = gather_tiered_kv(self.k16[layer_id], self.v16[layer_id], int8, int4, flat, b8, b4, self.dtype)
            return k.view(shape), v.view(shape)
        rows = torch.where(flat < b8, flat, 0)
        k, v = self.k16[layer_id].index_select(0, rows), self.v16[layer_id].index_select(0, rows)
        for tier, lo, hi in ((TIER_INT8, b8, b4), (TIER_INT4, b4, self.id_end)):
            if self.num_pages(tier) == 0:
                continue
            inside = (flat >= lo) & (flat < hi)
            kk, vv = self.stores[tier][layer_id].read(*self.page_offset(tier, torch.where(inside, flat, lo)), self.dtype)
            keep = inside[:, None, None]
            k, v = torch.where(keep, kk, k), torch.where(keep, vv, v)
        return k.view(shape), v.view(shape)

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
                kk = _read_keys(self.stores[tier][layer_id], *where, self.dtype)
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
        int tier on both sides copy their codes bit for bit (relocation, not requantization);
        fp16 -> int on CUDA is one quantize-and-store launch per tier for all layers of the stacked
        stores where the move is only that (every re-tier), else one per (layer, tier) (tier_store.py).
        Which store each id is in is worked out once, on the host; the layer loop runs no sync.
        KIVI pages (per-page key scales) requantize instead of relocating, and take fp16 rows
        through their own torch write. With a cold tier, every fp16 -> int4 token's fp16 values
        are copied to host memory on the way (host_cold_store.py)."""
        src, dst = src.reshape(-1).cpu(), dst.reshape(-1).cpu()
        ts, td = self.tier_of(src), self.tier_of(dst)
        same = (ts == td) & (ts != TIER_FP16)
        for tier in INT_TIERS:  # per-page key scales (KIVI): requantize instead of copying codes
            if not all(getattr(store, "relocatable", True) for store in self.stores[tier]):
                same &= ts != tier
        # every host index tensor below goes to the device in one staged copy (staged: its
        # position in `host`, replaced by the device view after the planning)
        host: list[torch.Tensor] = []

        def stage(*xs):
            host.extend(xs)
            return tuple(range(len(host) - len(xs), len(host)))

        relocate = []
        for tier in INT_TIERS:
            m = same & (ts == tier)
            if bool(m.any()):
                # one relocation launch per layer where no destination is also a source (the
                # kernel reads and writes in one pass); else the torch gather-then-write
                fused_ok = self._fused_relocate and not bool(torch.isin(dst[m], src[m]).any())
                relocate.append((tier, stage(*self.page_offset(tier, src[m])), stage(*self.page_offset(tier, dst[m])),
                                 fused_ok))
        rest = ~same
        capture = cap_src = None
        if self.cold is not None:  # NOTE: also for pure int4 relocations: the copies share the host rows
            capture = self.cold.begin_move(src, dst, ts, td, rest)
            if capture is not None:  # the demoted tokens' exact values: their fp16 rows
                (cap_src,) = stage(src[rest][capture.sel.cpu()])
                capture.sel = torch.arange(host[cap_src].numel(), device=self.device)
        # fp16 -> int (every re-tiering): one quantize-and-store launch per (layer, tier) on CUDA
        fused, stacked = [], []
        if self._fused_quantize and bool(rest.any()):
            down = rest & (ts == TIER_FP16) & (td != TIER_FP16)
            # a pure fp16 -> int move (every re-tier) into stacked stores: ONE launch per tier for
            # every layer, over the [L * rows] rows and [L * pages] pages (layer l's row r is row
            # l * rows + r, its page p page l * pages + p): the same kernel on the same rows, so
            # the same codes as the per-layer launches. Only with nothing else in the move (no
            # relocation or requantization ordered per layer around it).
            whole = not relocate and not bool((rest & ~down).any())
            for tier in INT_TIERS:
                m = down & (td == tier)
                if bool(m.any()):
                    if whole and self.stacked_store(tier) is not None:
                        # the per-token ids go over; their L-fold expansion is built on the device
                        # (on the host it was ~25 MB of int64 to make, pin and copy at 32k tokens,
                        # on the critical path after the last chunk's importance readback)
                        stacked.append((tier, *stage(src[m], *self.page_offset(tier, dst[m]))))
                    else:
                        fused.append((tier, *stage(src[m], *self.page_offset(tier, dst[m]))))
            rest = rest & ~down
        dev = self._to_device_many(host)
        relocate = [(tier, tuple(dev[i] for i in s_at), tuple(dev[i] for i in d_at), ok)
                    for tier, s_at, d_at, ok in relocate]
        fused = [(tier, *(dev[i] for i in at)) for tier, *at in fused]
        stacked = [(tier, *self._stacked_ids(tier, *(dev[i] for i in at))) for tier, *at in stacked]
        if cap_src is not None:
            cap_src = dev[cap_src]
        requant = (self.route(src[rest]), self.route(dst[rest])) if bool(rest.any()) else None
        if fused or stacked:
            from sgl_kvxfer.kernels.tier_store import store_rows_quantized
        if any(r[3] for r in relocate):
            from sgl_kvxfer.kernels.tier_relocate import relocate_codes
        for layer_id in range(self.num_layers):
            k16, v16 = self.k16[layer_id], self.v16[layer_id]
            if capture is not None:  # before any write of this layer (sources are fp16 rows: untouched)
                self.cold.capture(capture, layer_id, k16.index_select(0, cap_src), v16.index_select(0, cap_src))
            for tier, s_where, d_where, fused_ok in relocate:
                store = self.stores[tier][layer_id]
                if fused_ok and isinstance(store, TierPages):
                    relocate_codes(store, *s_where, *d_where)
                else:
                    store.put_codes(*d_where, store.codes(*s_where))
            for tier, rows, page, off in fused:
                store = self.stores[tier][layer_id]
                if isinstance(store, TierPages):
                    store_rows_quantized(k16, v16, rows, store, page, off)
                else:  # KIVI pages: torch write
                    store.write(page, off, k16.index_select(0, rows), v16.index_select(0, rows))
            if requant is not None:
                k, v = self.get_kv_routed(layer_id, requant[0])
                self.set_kv_routed(layer_id, requant[1], k, v)
        if stacked:  # after the captures above read the fp16 rows (which it only reads too)
            L, rows = self._k16_all.shape[:2]
            k_all = self._k16_all.view(L * rows, *self._k16_all.shape[2:])
            v_all = self._v16_all.view(L * rows, *self._v16_all.shape[2:])
            for tier, rows_at, page, off in stacked:
                store_rows_quantized(k_all, v_all, rows_at, self.stacked_store(tier), page, off)
        if capture is not None:
            self.cold.end_move(capture)

    def _stacked_ids(self, tier: int, rows: torch.Tensor, page: torch.Tensor, off: torch.Tensor):
        """Per-token (fp16 row, int page, offset) -> the same for every layer of the stacked stores:
        layer l's row r is row l * rows + r, its page p page l * pages + p (device ops, no sync)."""
        layers = torch.arange(self.num_layers, device=rows.device)[:, None]
        return ((layers * self._k16_all.shape[1] + rows[None, :]).reshape(-1),
                (layers * self.num_pages(tier) + page[None, :]).reshape(-1), off.repeat(self.num_layers))

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
