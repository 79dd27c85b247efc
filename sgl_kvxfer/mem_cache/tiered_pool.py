"""TieredKVPool (SpectrumKV): each token's K/V lives in the store of its precision tier.

Global slot ids (what req_to_token rows and radix nodes hold) cover three stores back to back:

    0 | 1 ......... n16 | n16+1 ........ n16+n8 | n16+n8+1 ........ n16+n8+n4
    pad   fp16 store       int8 store               int4 store
          (every new token is written here; the scheduler's allocator hands out these ids)

    store row = id - base(t):   base(fp16) = 0 (row 0 = padding), base(int8) = n16 + 1,
                                base(int4) = n16 + n8 + 1

Per layer, store t holds the codec's format (kernels/tier_codec.py, group size G):
    fp16   k, v  [n16 + 1, Hkv, D]   model dtype
    int8   k, v  [n8, Hkv, D]        uint8    k/v scale, k/v zero [n8, Hkv, D // G] fp16
    int4   k, v  [n4, Hkv, D // 2]   uint8    k/v scale, k/v zero [n4, Hkv, D // G] fp16
This is kernels/paged_layout.py's [P, Hkv, PAGE, W] with PAGE = 1 (`x[:, :, None, :]`).

Invariants: a token's tier is a function of its slot id (`tier_of`); slot 0 in a request row
is a dropped token (TIER_DROP), masked by attention (`drops_tokens`), never read as data.
`move` copies data only: who owns an id is TieredSlotAllocator's business.
"""
from __future__ import annotations

from typing import Callable

import torch

from sgl_kvxfer.kernels.tier_codec import dequantize, payload_bytes, quantize
from sgl_kvxfer.mem_cache.kv_pool import KVPool
from sgl_kvxfer.mem_cache.tier_plan import TierStorePlan, split_int_stores
from sgl_kvxfer.spectrum.tiers import TIER_DROP, TIER_FP16, TIER_INT4, TIER_INT8

INT_TIERS = (TIER_INT8, TIER_INT4)
_BITS = {TIER_INT8: 8, TIER_INT4: 4}


class _IntStore:
    """One layer's int8 or int4 store: packed codes plus fp16 scale/zero per group."""

    def __init__(self, tier: int, n: int, num_kv_heads: int, head_dim: int, group_size: int, device: str):
        width = head_dim if tier == TIER_INT8 else head_dim // 2
        groups = head_dim // group_size
        self.k = torch.empty((n, num_kv_heads, width), dtype=torch.uint8, device=device)
        self.v = torch.empty_like(self.k)
        self.k_scale, self.k_zero, self.v_scale, self.v_zero = (
            torch.empty((n, num_kv_heads, groups), dtype=torch.float16, device=device) for _ in range(4))

    def write(self, rows, k, v, bits, group_size):
        self.k[rows], self.k_scale[rows], self.k_zero[rows] = quantize(k, bits, group_size)
        self.v[rows], self.v_scale[rows], self.v_zero[rows] = quantize(v, bits, group_size)

    def read(self, rows, bits, group_size, dtype):
        def take(x):
            return x.index_select(0, rows)
        k = dequantize(take(self.k), take(self.k_scale), take(self.k_zero), bits, group_size, dtype)
        v = dequantize(take(self.v), take(self.v_scale), take(self.v_zero), bits, group_size, dtype)
        return k, v


class TieredKVPool(KVPool):
    drops_tokens = True
    layout = "tiered"

    def __init__(self, size: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: str, plan: TierStorePlan, group_size: int = 32):
        super().__init__(plan.total, num_layers, num_kv_heads, head_dim, dtype, device)
        if head_dim % group_size:
            raise ValueError(f"head_dim {head_dim} must be a multiple of kv_quant_group_size {group_size}")
        self.memory_tokens = size  # fp16 tokens whose memory the stores share
        self.group_size = group_size
        self.plan = plan
        shape = (plan.n16 + 1, num_kv_heads, head_dim)
        self.k16 = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v16 = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        for buf in self.k16 + self.v16:
            buf[0].zero_()
        self._alloc_int_stores(plan)
        self._occupancy: Callable[[], dict[int, int]] | None = None

    def _alloc_int_stores(self, plan: TierStorePlan) -> None:
        self.plan = plan
        self.size = plan.total
        counts = {TIER_INT8: plan.n8, TIER_INT4: plan.n4}
        self.stores = {t: [_IntStore(t, counts[t], self.num_kv_heads, self.head_dim, self.group_size, self.device)
                           for _ in range(self.num_layers)] for t in INT_TIERS}

    def int_store_sizes(self, f8: float, f4: float) -> tuple[int, int]:
        """(n8, n4) for an int mix f8 : f4 in the memory the fp16 store leaves over."""
        left = self.memory_tokens * self.full_bytes_per_token() - (self.plan.n16 + 1) * self.token_bytes(TIER_FP16)
        return split_int_stores(left, f8, f4, self.token_bytes(TIER_INT8), self.token_bytes(TIER_INT4))

    def resize_int_stores(self, n8: int, n4: int) -> None:
        """Re-divide the int stores (int4 probe changed the mix). Only while they hold nothing."""
        self.stores = {}
        self._alloc_int_stores(TierStorePlan(self.plan.n16, n8, n4))

    # ------------------------------------------------------------------ slot id ranges
    def num_slots(self, tier: int) -> int:
        return {TIER_FP16: self.plan.n16, TIER_INT8: self.plan.n8, TIER_INT4: self.plan.n4}[tier]

    def base(self, tier: int) -> int:
        """First global id of a store (fp16: 0, the padding row)."""
        return {TIER_FP16: 0, TIER_INT8: self.plan.n16 + 1, TIER_INT4: self.plan.n16 + self.plan.n8 + 1}[tier]

    def tier_of(self, slots: torch.Tensor) -> torch.Tensor:
        """int8 tier id of every slot id (0 -> TIER_DROP)."""
        tiers = torch.full(slots.shape, TIER_FP16, dtype=torch.int8, device=slots.device)
        tiers[slots >= self.base(TIER_INT8)] = TIER_INT8
        tiers[slots >= self.base(TIER_INT4)] = TIER_INT4
        tiers[slots == 0] = TIER_DROP
        return tiers

    def _split(self, flat: torch.Tensor):
        """Yield (tier, positions in flat, store rows) for each store that `flat` touches."""
        b8, b4 = self.base(TIER_INT8), self.base(TIER_INT4)
        is16 = flat < b8
        if bool(is16.all()):
            yield TIER_FP16, None, flat
            return
        for tier, mask in ((TIER_FP16, is16), (TIER_INT8, (flat >= b8) & (flat < b4)), (TIER_INT4, flat >= b4)):
            pos = mask.nonzero().squeeze(1)
            if pos.numel():
                yield tier, pos, flat[pos] - self.base(tier)

    # ------------------------------------------------------------------ KVPool
    def set_kv(self, layer_id, slots, k, v):
        for tier, pos, rows in self._split(slots.reshape(-1)):
            kk, vv = (k, v) if pos is None else (k[pos], v[pos])
            if tier == TIER_FP16:
                self.k16[layer_id][rows] = kk.to(self.dtype)
                self.v16[layer_id][rows] = vv.to(self.dtype)
            else:
                self.stores[tier][layer_id].write(rows, kk, vv, _BITS[tier], self.group_size)

    def get_kv(self, layer_id, slots):
        flat = slots.reshape(-1)
        out_shape = (*slots.shape, self.num_kv_heads, self.head_dim)
        k = torch.empty((flat.numel(), self.num_kv_heads, self.head_dim), dtype=self.dtype, device=self.device)
        v = torch.empty_like(k)
        for tier, pos, rows in self._split(flat):
            if tier == TIER_FP16:
                kk, vv = self.k16[layer_id].index_select(0, rows), self.v16[layer_id].index_select(0, rows)
            else:
                kk, vv = self.stores[tier][layer_id].read(rows, _BITS[tier], self.group_size, self.dtype)
            if pos is None:
                return kk.view(out_shape), vv.view(out_shape)
            k.index_copy_(0, pos, kk)
            v.index_copy_(0, pos, vv)
        return k.view(out_shape), v.view(out_shape)

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy tokens src -> dst in every layer, quantizing into dst's store."""
        for layer_id in range(self.num_layers):
            k, v = self.get_kv(layer_id, src)
            self.set_kv(layer_id, dst, k, v)

    # ------------------------------------------------------------------ bytes
    def token_bytes(self, tier: int, with_scales: bool = True) -> int:
        """Bytes one token takes in a store, all layers, K and V (fp16 store: model dtype)."""
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
        slot and are not counted). Before any token is resident: the planned store mix."""
        used = self._occupancy() if self._occupancy is not None else {}
        if sum(used.values()) == 0:
            used = {TIER_FP16: self.plan.n16, TIER_INT8: self.plan.n8, TIER_INT4: self.plan.n4}
        total = sum(used.values())
        return sum(c * self.token_bytes(t, with_scales) for t, c in used.items()) / max(total, 1)
