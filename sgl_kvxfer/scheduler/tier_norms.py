"""KV-norm importance of pool rows (a mixin of `EngineTiering`, scheduler/tiering.py).

Used where no queries were observed: decode runs (no queries exist yet for their tokens), norm
mode, and backends that feed no observer. Takes host ids; the totals come back to the host in one
copy, which is the one wait. `_stacked_norms` reads only fp16 ids of a pool that keeps every
layer's rows in one tensor, and bounds each gather's transient memory (`_NORM_CHUNK_BYTES`).
"""
from __future__ import annotations

import torch

from sgl_kvxfer.spectrum.importance import KVNormAccumulator, normalize_importance
from sgl_kvxfer.spectrum.tiers import TIER_INT8
from sgl_kvxfer.utils.host_copy import to_device


class KVNormImportanceMixin:
    """`EngineTiering`'s KV-norm importance; reads `self.pool`."""

    def _norm_importance(self, slots: torch.Tensor) -> torch.Tensor:
        """KV-norm importance of host ids `slots`, accumulated on the pool's device (one copy
        back). Where every id is an fp16 row of a pool that keeps every layer's rows in one
        tensor, the layers are read in a few gathers (_stacked_norms); else one read per layer."""
        total = self._stacked_norms(slots)
        if total is None:
            acc = KVNormAccumulator(slots.numel(), device=self.pool.device)
            route = self.pool.route(slots)
            for layer_id in range(self.pool.num_layers):
                if not self.pool.stores_layer(layer_id):  # FusedKV reconstruction layer: nothing stored
                    continue
                acc.add_layer(*self.pool.get_kv_routed(layer_id, route))
            total = acc.totals()
        return normalize_importance(total.cpu())  # on the host: the copy is the one wait

    # one _stacked_norms gather's K rows in float32 bytes at most (its transient peak is about
    # three times this: K and V gathered, each upcast): a decode run's 32 layers of a few hundred
    # tokens fit in one gather, a 16k-token prompt takes one layer per gather as the loop did
    _NORM_CHUNK_BYTES = 64 << 20

    def _stacked_norms(self, slots: torch.Tensor) -> torch.Tensor | None:
        """KVNormAccumulator's summed per-layer norms of fp16 ids `slots`, from the pool's
        [L, rows, Hkv, D] tensors: each gather takes several layers (all of them for a decode
        run), so a step runs a handful of launches instead of ~10 per layer. Each layer's norm
        is the per-layer path's; their sum over layers is one reduction instead of L running adds
        (equal to float32 rounding). None: a pool without stacked rows, or ids outside the fp16
        store."""
        from sgl_kvxfer.mem_cache.tiered_pool import TieredKVPool

        pool = self.pool
        flat = slots.reshape(-1)
        if not isinstance(pool, TieredKVPool) or not flat.numel() or bool((flat >= pool.base(TIER_INT8)).any()):
            return None
        k_all, v_all = pool.stacked_rows()
        L, _, H, D = k_all.shape
        rows = to_device(flat.to(torch.int64), k_all.device)
        total = torch.zeros(flat.numel(), dtype=torch.float32, device=k_all.device)
        step = max(1, self._NORM_CHUNK_BYTES // max(1, flat.numel() * H * D * 4))
        for l0 in range(0, L, step):
            k = k_all[l0:l0 + step].index_select(1, rows)  # [l, n, Hkv, D]
            v = v_all[l0:l0 + step].index_select(1, rows)
            norm = 0.5 * (k.float().norm(dim=-1).mean(dim=-1) + v.float().norm(dim=-1).mean(dim=-1))
            total += norm.sum(0)
        return total
