"""Triton attention over SpectrumKV's TieredKVPool (`--attention-backend triton`, budget < 1).

The tier stores are slot-granular (one token per row, PAGE = 1), so the paged kernels cannot
read them. Decode runs the token-gather kernel (kernels/gather_decode_attention.py) on the
stores in place:

    prepare_metadata (once per batch)   req_to_token rows [B, max(seq_lens)] -> per-tier store-row
                                        tables + counts (mem_cache/tiered_rows.py), on device
    forward (per layer)                 pool.set_kv(new token) -> gather kernel over that layer's
                                        store views (the new token is an fp16 row of the tables)

Extend (prefill, chunked prefill, radix hits) delegates to the torch reference backend:
dequantize the prefix through `get_kv`, then SDPA. It also feeds `attn_observer`, the hook
SpectrumKV's importance scoring reads at prefill end. The fused extend kernel
(kernels/extend_attention.py) walks pages of >= 16 tokens, so it needs page-aligned tier stores
(the next step, mem_cache/README.md section 8).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from sgl_kvxfer.engine.forward_batch import ForwardBatch, ForwardMode
from sgl_kvxfer.layers.attention.base import AttentionBackend
from sgl_kvxfer.layers.attention.torch_backend import TorchAttentionBackend
from sgl_kvxfer.mem_cache.tiered_pool import TieredKVPool
from sgl_kvxfer.mem_cache.tiered_rows import tier_row_tables, tier_store_views
from sgl_kvxfer.utils.triton_cpu import use_interpreter_on_cpu


@dataclass
class _GatherPlan:
    tables: object  # kernels.paged_layout.TieredBlockTables of store rows (PAGE = 1)
    max_tokens: int  # host bound on any request's keys: max(seq_lens_cpu)


class TritonTieredAttentionBackend(AttentionBackend):
    def __init__(self, kv_pool, num_q_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__(kv_pool, num_q_heads, num_kv_heads, head_dim)
        if not isinstance(kv_pool, TieredKVPool):
            raise ValueError(f"TritonTieredAttentionBackend reads a TieredKVPool, got {type(kv_pool).__name__}")
        if kv_pool.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"--attention-backend triton needs a float16 or bfloat16 model, got {kv_pool.dtype}; "
                             f"pass --dtype float16 or --dtype bfloat16 (or use --attention-backend torch)")
        group = kv_pool.group_size
        if head_dim < 16 or head_dim & (head_dim - 1) or group & (group - 1):
            raise ValueError(f"--attention-backend triton over tiered KV needs a power-of-two head_dim >= 16 "
                             f"and --kv-quant-group-size, got {head_dim} and {group}")
        use_interpreter_on_cpu(str(kv_pool.device))  # normally on already (Engine / scheduler process)
        from sgl_kvxfer.kernels.gather_decode_attention import decode_attention_gather

        self._decode = decode_attention_gather
        self._extend = TorchAttentionBackend(kv_pool, num_q_heads, num_kv_heads, head_dim)
        self._views, self._views_of = [], None

    def _layer_views(self):
        # The int4 probe may re-divide the int stores (pool.stores is then a new dict).
        if self._views_of is not self.kv_pool.stores:
            pool = self.kv_pool
            self._views = [tier_store_views(pool, layer) for layer in range(pool.num_layers)]
            self._views_of = pool.stores
        return self._views

    def prepare_metadata(self, batch: ForwardBatch) -> None:
        if batch.mode != ForwardMode.DECODE:
            self._extend.prepare_metadata(batch)
            return
        lmax = max(batch.seq_lens_cpu)
        slots = batch.req_to_token[batch.req_pool_indices, :lmax]
        tables = tier_row_tables(self.kv_pool, slots, batch.seq_lens)
        batch.attn_metadata = _GatherPlan(tables, lmax)
        self._layer_views()

    def forward(self, q, k, v, layer_id, batch):
        if batch.mode != ForwardMode.DECODE:
            return self._extend.forward(q, k, v, layer_id, batch)
        self.kv_pool.set_kv(layer_id, batch.out_cache_loc, k, v)
        plan = batch.attn_metadata
        return self._decode(q.contiguous(), self._views[layer_id], plan.tables, sm_scale=self.scale,
                            max_tokens=plan.max_tokens)
