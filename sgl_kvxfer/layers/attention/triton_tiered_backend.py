"""Triton attention over SpectrumKV's TieredKVPool (`--attention-backend triton`, budget < 1).

The pool's int8 / int4 stores are head-major pages of PAGE tokens and its fp16 store is
slot-granular (pages of one token), so each layer is one kernels/paged_layout.TieredKVLayer
with per-tier page sizes, and each batch one set of FILLED block tables (mem_cache/tiered_rows.py):

    prepare_metadata (once per batch)   req_to_token rows [B, L] -> tier_block_tables, on device
                                        (decode: L = max(seq_lens); extend: the prefixes), and
                                        the decode split plan (host numbers only)
    prepare_graph_metadata (CUDA graph) the same with L = the context bound: every shape fixed,
                                        no host sync, so the engine replays it every step
    forward_qkv (per layer)             RoPE + the new tokens' store (fp16 ids) in one launch
                                        (fused elementwise kernels on) -> kernel over the layer view
    forward (per layer)                 store the new tokens (fp16 ids) -> kernel over the layer view

Kernels: decode is kernels.tiered_pool_decode (one split-K launch per tier store that has pages,
folded scales, int4 on split halves, the merge fused into the last split; CUDA-graph capturable),
extend is kernels.extend_attention.extend_attention_tiered; both read the tables as they are.
SpectrumKV's importance capture (`attn_observer`) is fed on every extend path.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from sgl_kvxfer.forward_batch import ForwardBatch, ForwardMode
from sgl_kvxfer.layers import fused_ops
from sgl_kvxfer.layers.attention.base import AttentionBackend
from sgl_kvxfer.mem_cache.tiered_pool import TieredKVPool
from sgl_kvxfer.mem_cache.tiered_rows import tier_block_tables, tier_layer_view
from sgl_kvxfer.spectrum.tiers import TIER_FP16, TIER_INT4, TIER_INT8
from sgl_kvxfer.utils.host_copy import int64_to_device
from sgl_kvxfer.utils.triton_cpu import use_interpreter_on_cpu

logger = logging.getLogger(__name__)


@dataclass
class _TieredPlan:
    tables: object  # kernels.paged_layout.TieredBlockTables (filled): decode keys / extend prefixes
    qo_indptr: torch.Tensor | None = None  # extend: int32 [B + 1]
    max_extend_len: int = 1
    max_prefix_len: int = 0  # extend: the longest cached prefix (the extend kernel's tuning bucket)
    decode_plan: object = None  # kernels.tiered_pool_decode.TieredDecodePlan (decode)


class TritonTieredAttentionBackend(AttentionBackend):
    supports_cuda_graph = True

    def __init__(self, kv_pool, num_q_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__(kv_pool, num_q_heads, num_kv_heads, head_dim)
        if not isinstance(kv_pool, TieredKVPool):
            raise ValueError(f"TritonTieredAttentionBackend reads a TieredKVPool, got {type(kv_pool).__name__}")
        if kv_pool.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"--attention-backend triton needs a float16 or bfloat16 model, got {kv_pool.dtype}; "
                             f"pass --dtype float16 or --dtype bfloat16 (or use --attention-backend torch)")
        group, page = kv_pool.group_size, kv_pool.page_size
        if head_dim < 16 or head_dim & (head_dim - 1) or group & (group - 1):
            raise ValueError(f"--attention-backend triton over tiered KV needs a power-of-two head_dim >= 16 "
                             f"and --kv-quant-group-size, got {head_dim} and {group}")
        if page < 16 or page & (page - 1):
            raise ValueError(f"--attention-backend triton over tiered KV needs --kv-tier-page-size a power of "
                             f"two >= 16, got {page}")
        if str(kv_pool.device).startswith("cuda") and head_dim < 32:
            # the int tiers' kernel feeds each int4 half (head_dim / 2 channels) to tl.dot, which
            # needs K >= 16 when compiled (the interpreter runs any K, so CPU serves head_dim 16)
            raise ValueError(f"--attention-backend triton over tiered KV needs head_dim >= 32 on a GPU, got "
                             f"{head_dim}; use --attention-backend torch")
        use_interpreter_on_cpu(str(kv_pool.device))  # normally on already (Engine / scheduler process)
        from sgl_kvxfer import env
        from sgl_kvxfer.kernels.tiered_pool_decode import served_config, tiered_pool_decode

        self._decode = tiered_pool_decode
        try:
            self._decode_config = served_config(head_dim, num_q_heads // num_kv_heads,
                                                env.TIERED_DECODE_CONFIG.get())
        except (TypeError, ValueError) as exc:  # a bad override names itself, not a traceback deep down
            raise ValueError(f"{env.TIERED_DECODE_CONFIG.name}: {exc}") from exc
        self._views, self._views_of, self._tiers = [], None, ()

    def _layers(self):
        # Built on first use, once: the pool's stores are allocated once (never resized).
        if self._views_of is not self.kv_pool.stores:
            pool = self.kv_pool
            if not pool.formats.is_uniform:
                raise ValueError("the Triton tiered kernels read the codec's int8 / int4 in every layer; per-layer "
                                 "budgets and KIVI store other formats: use --attention-backend torch")
            self._views = [tier_layer_view(pool, layer) for layer in range(pool.num_layers)]
            for view in self._views:  # checked once here: the launches below pass check=False
                view.check(uniform=False)
            self._views_of = pool.stores
            # decode launches only the stores that can hold a token (an empty one is a placeholder)
            self._tiers = tuple(t for t in (TIER_FP16, TIER_INT8, TIER_INT4) if pool.num_slots(t) > 0)
        return self._views

    # ------------------------------------------------------------------ plans
    def _tables(self, batch: ForwardBatch, lens: torch.Tensor, width: int):
        assert width <= batch.req_to_token.shape[1], "table width past the req-to-token row"
        slots = batch.req_to_token[batch.req_pool_indices, :max(width, 1)]
        return tier_block_tables(self.kv_pool, slots, lens)

    def prepare_metadata(self, batch: ForwardBatch) -> None:
        self._layers()
        if batch.mode == ForwardMode.DECODE:
            width = max(batch.seq_lens_cpu)
            batch.attn_metadata = _TieredPlan(self._tables(batch, batch.seq_lens, width),
                                              decode_plan=self._decode_plan(len(batch.seq_lens_cpu), width))
            return
        dev = batch.req_to_token.device
        indptr = [0]
        for n in batch.extend_seq_lens:
            indptr.append(indptr[-1] + n)
        prefix = int64_to_device([batch.extend_prefix_lens], dev)
        tables = self._tables(batch, prefix, max(batch.extend_prefix_lens))
        batch.attn_metadata = _TieredPlan(tables, int64_to_device([indptr], dev).to(torch.int32),
                                          max(batch.extend_seq_lens), max(batch.extend_prefix_lens))

    def prepare_graph_metadata(self, batch: ForwardBatch, max_seq_len: int) -> None:
        """Decode plan from device tensors only: tables of the fixed width max_seq_len built by
        device ops (sort, cumsum, scatter) the graph captures; padding rows (seq_len 0) hold no key."""
        assert batch.mode == ForwardMode.DECODE
        self._layers()
        batch.attn_metadata = _TieredPlan(self._tables(batch, batch.seq_lens, max_seq_len),
                                          decode_plan=self._decode_plan(batch.req_pool_indices.shape[0], max_seq_len))

    def _decode_plan(self, batch_size: int, max_tokens: int):
        from sgl_kvxfer.kernels.tiered_pool_decode import plan_tiered_pool_decode

        return plan_tiered_pool_decode(batch_size, self.num_kv_heads, max_tokens, self.kv_pool.device,
                                       self._decode_config)

    # ------------------------------------------------------------------ run
    def forward_qkv(self, qkv, cos, sin, layer_id, batch):
        """With the fused elementwise kernels on: RoPE, the new tokens' store into the fp16 rows
        and q's layout in one launch (kernels/rope_store.py), then the tier kernels. The fp16
        store's rows [R, Hkv, D] of a layer are its pages of one token ([R, Hkv, 1, D], the same
        bytes), and new tokens always hold fp16 ids, which index those rows. Extend also gets
        the new k/v back (its kernel reads them at full precision)."""
        pool = self.kv_pool
        if not (fused_ops.wants_fused(qkv.device.type, qkv.dtype) and cos.dtype == qkv.dtype
                and pool.dtype == qkv.dtype and pool.stores_layer(layer_id)):
            return super().forward_qkv(qkv, cos, sin, layer_id, batch)
        from sgl_kvxfer.kernels.rope_store import rope_store_kv

        k_rows, v_rows = pool.k16[layer_id], pool.v16[layer_id]
        rows = (k_rows.shape[0], self.num_kv_heads, 1, self.head_dim)
        q, k, v = rope_store_kv(qkv, cos, sin, batch.out_cache_loc, k_rows.view(rows), v_rows.view(rows),
                                self.num_q_heads, self.num_kv_heads, return_kv=batch.mode != ForwardMode.DECODE)
        return self._attend(q, k, v, layer_id, batch)

    def forward(self, q, k, v, layer_id, batch):
        self.kv_pool.set_kv_fp16(layer_id, batch.out_cache_loc, k, v)  # new tokens: fp16 ids
        return self._attend(q, k, v, layer_id, batch)

    def _attend(self, q, k, v, layer_id, batch):
        """Attention over the pool, the batch's new K/V already stored."""
        plan = batch.attn_metadata
        if batch.mode == ForwardMode.DECODE:
            self.tap_query(layer_id, q)
            return self._decode(q.contiguous(), self._views[layer_id], plan.tables, sm_scale=self.scale,
                                plan=plan.decode_plan, config=self._decode_config, tiers=self._tiers, check=False)
        return self._extend_kernel_path(q, k, v, layer_id, batch, plan)

    def _extend_kernel_path(self, q, k, v, layer_id, batch, plan):
        from sgl_kvxfer.kernels.extend_attention import extend_attention_tiered

        q, k, v = q.contiguous(), k.contiguous().to(q.dtype), v.contiguous().to(q.dtype)
        out = extend_attention_tiered(q, k, v, plan.qo_indptr, self._views[layer_id], plan.tables,
                                      sm_scale=self.scale, max_extend_len=plan.max_extend_len,
                                      max_prefix_len=plan.max_prefix_len, check=False,
                                      int_tiers=self._tiers != (TIER_FP16,))
        observer = batch.extras.get("attn_observer")
        if observer is not None:  # importance capture: (window queries, every key) of its requests
            start = 0
            wanted = getattr(observer, "requests", None)
            rows = getattr(observer, "rows", {})  # i -> (its req_to_token row, all its ids fp16)
            # each request's key route is worked out once per forward, so the per-layer key gathers
            # below run no host sync. NOTE: with overlapped chunks the previous chunk is still on
            # the stream here; a row known on the host and all fp16 (no cached prefix: its own
            # tokens, fp16 until the prompt's re-tier) is routed on the device and waits for
            # nothing; otherwise route() reads the row back, which waits for that chunk
            routes = batch.extras.setdefault("attn_observer_routes", {})
            for i, (prefix, n) in enumerate(zip(batch.extend_prefix_lens, batch.extend_seq_lens)):
                if wanted is None or i in wanted:
                    if i not in routes:
                        row_idx, own = rows.get(i, (None, False))
                        if row_idx is None:
                            row_idx = batch.req_pool_indices[i]
                        row = batch.req_to_token[row_idx, :prefix + n]
                        routes[i] = self.kv_pool.fp16_route(row) if own else self.kv_pool.route(row)
                    keys = self.kv_pool.get_k_routed(layer_id, routes[i])
                    observer(layer_id, i, q[start:start + n], keys)
                start += n
        return out
