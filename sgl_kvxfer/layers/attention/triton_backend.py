"""Triton attention backend: the paged kernels of `sgl_kvxfer.kernels` over PagedFp16KVPool.

Decode runs kernels.paged_fp16_pool_decode on the pool's per-layer buffers. Extend runs
kernels.extend_attention over each layer's buffers viewed as the fp16 tier of a TieredKVLayer
(the int8 / int4 tiers one-page placeholders, every request's count 0). Block tables come
straight from the req-to-token rows, which the paged allocator keeps page-consistent:

    row r:   pos 0 | .. | PAGE | .. | 2*PAGE | ..        slot(pos) = page(pos // PAGE) * PAGE + pos % PAGE
    table:   row[0] // PAGE, row[PAGE] // PAGE, ...     (one column per page start)

Decode: tables cover the whole sequence (the new token is stored first), lens = seq_lens.
Extend: tables cover only the cached prefix (extend_prefix_lens); the new tokens are passed
to the kernel as k/v at full precision (and stored for later batches). No host syncs: table
widths and max_extend_len come from the batch's CPU-side lists.
Graph decode (`prepare_graph_metadata`, CUDA-graph capture): the width is fixed at the
context's page count and the split counts are fixed per batch size, so every shape is a function
of B alone. The kernel runs with even_splits: each request divides its own pages (from lens, on
device) over those splits, so a short request in a wide table still spreads its work; a request
with seq_len 0 (a padding row) reads no page.
Per-layer host work is hoisted: layer layouts are checked once here, tables and the split
plan once per batch, so each layer's forward is two kernel launches plus the KV store. With the
fused elementwise kernels on, `forward_qkv` does RoPE and the KV store in one launch
(kernels/rope_store.py), so a decode layer's attention is three launches in all.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from sgl_kvxfer.forward_batch import ForwardBatch, ForwardMode
from sgl_kvxfer.layers import fused_ops
from sgl_kvxfer.layers.attention.base import AttentionBackend
from sgl_kvxfer.mem_cache.paged_fp16_pool import PagedFp16KVPool
from sgl_kvxfer.utils.triton_cpu import use_interpreter_on_cpu


@dataclass
class _TritonPlan:
    tables: object  # kernels.paged_layout.TieredBlockTables
    qo_indptr: torch.Tensor | None  # extend: int32 [B + 1] offsets of each request's new tokens
    max_extend_len: int
    split_plan: tuple | None = None  # decode: kernels.paged_fp16_pool_decode.plan_fp16_splits for `tables`
    even_splits: bool = False  # decode: each request spreads its own pages over the splits
    request_order: torch.Tensor | None = None  # decode: int32 [B], longest request first
    tiles: tuple | None = None  # graph extend: (tile_req, tile_blk), the kernel's tiled launch
    max_prefix_len: int = 0  # extend: the longest cached prefix (the extend kernel's tuning bucket)


class TritonAttentionBackend(AttentionBackend):
    supports_cuda_graph = True
    supports_prefill_graph = True

    def __init__(self, kv_pool, num_q_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__(kv_pool, num_q_heads, num_kv_heads, head_dim)
        if kv_pool.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"--attention-backend triton needs a float16 or bfloat16 model, got {kv_pool.dtype}; "
                             f"pass --dtype float16 or --dtype bfloat16 (or use --attention-backend torch)")
        if head_dim < 16 or head_dim & (head_dim - 1):
            raise ValueError(f"--attention-backend triton needs a power-of-two head_dim >= 16, got {head_dim}")
        self.page_size = getattr(kv_pool, "page_size", 1)
        if not isinstance(kv_pool, PagedFp16KVPool) or self.page_size < 16 or self.page_size & (self.page_size - 1):
            raise ValueError(f"--attention-backend triton needs the paged fp16 KV pool with a power-of-two "
                             f"page size >= 16, got {type(kv_pool).__name__} with page size {self.page_size}")
        use_interpreter_on_cpu(str(kv_pool.device))  # normally on already (Engine / scheduler process)
        from sgl_kvxfer.kernels.extend_attention import extend_attention_tiered
        from sgl_kvxfer.kernels.paged_fp16_pool_decode import paged_fp16_pool_decode, plan_fp16_splits
        from sgl_kvxfer.kernels.paged_layout import TierPages, TieredKVLayer, allocate_tiered_layer
        from sgl_kvxfer.kernels.tier_codec import DEFAULT_GROUP_SIZE, TIER_FP16

        self._decode, self._extend = paged_fp16_pool_decode, extend_attention_tiered
        self._plan_splits = plan_fp16_splits
        group = min(DEFAULT_GROUP_SIZE, head_dim)
        empty = allocate_tiered_layer((1, 1, 1), self.page_size, num_kv_heads, head_dim, group,
                                      kv_pool.dtype, kv_pool.device, fill=0.0)
        self.layers = [
            TieredKVLayer((TierPages(TIER_FP16, kb, vb), empty[1], empty[2]), head_dim, group)
            for kb, vb in zip(kv_pool.k_buffer, kv_pool.v_buffer)
        ]
        for layer in self.layers:  # once: forward passes check=False to the kernels
            layer.check()

    def prepare_metadata(self, batch: ForwardBatch) -> None:
        P, dev = self.page_size, batch.req_to_token.device
        if batch.mode == ForwardMode.DECODE:
            lens_cpu, lens = batch.seq_lens_cpu, batch.seq_lens.to(torch.int32)
            qo_indptr, max_extend = None, 1
        else:
            lens_cpu = batch.extend_prefix_lens
            lens = torch.tensor(lens_cpu, dtype=torch.int32, device=dev)
            indptr = [0]
            for n in batch.extend_seq_lens:
                indptr.append(indptr[-1] + n)
            qo_indptr = torch.tensor(indptr, dtype=torch.int32, device=dev)
            max_extend = max(batch.extend_seq_lens)
        tables = self._tables(batch, lens, max(-(-max(lens_cpu) // P), 1))
        tables.check(P)
        decode = batch.mode == ForwardMode.DECODE
        plan = self._split_plan(tables) if decode else None
        batch.attn_metadata = _TritonPlan(tables, qo_indptr, max_extend, plan,
                                          request_order=self._request_order(tables) if decode else None,
                                          max_prefix_len=0 if decode else max(lens_cpu))

    def prepare_graph_metadata(self, batch: ForwardBatch, max_seq_len: int) -> None:
        """Decode plan from device tensors only (no host sync, no seq_lens_cpu): block tables
        of the fixed width cdiv(max_seq_len, PAGE) and split counts fixed by (B, width).
        Padding rows (seq_len 0) read nothing and merge to 0."""
        assert batch.mode == ForwardMode.DECODE
        tables = self._tables(batch, batch.seq_lens.to(torch.int32), -(-max_seq_len // self.page_size))
        tables.check(self.page_size)
        batch.attn_metadata = _TritonPlan(tables, None, 1, self._split_plan(tables), even_splits=True,
                                          request_order=self._request_order(tables))

    def prepare_extend_graph_metadata(self, batch, prefix_lens, qo_indptr, tiles, max_seq_len) -> None:
        """Graph prefill: prefix tables of the fixed width cdiv(max_seq_len, PAGE) over the static
        request rows, and the extend kernel's tiled launch (no host value of the live batch)."""
        assert batch.mode == ForwardMode.EXTEND
        tables = self._tables(batch, prefix_lens, -(-max_seq_len // self.page_size))
        tables.check(self.page_size)
        batch.attn_metadata = _TritonPlan(tables, qo_indptr, 0, tiles=tiles)

    def _request_order(self, tables):
        """Longest request first (env DECODE_LONGEST_FIRST): one device argsort per batch, no sync."""
        from sgl_kvxfer import env

        if not env.DECODE_LONGEST_FIRST.get_bool() or tables.batch_size < 2:
            return None
        from sgl_kvxfer.kernels.paged_fp16_pool_decode import longest_first_order

        return longest_first_order(tables.lens[0])

    def _tables(self, batch: ForwardBatch, lens: torch.Tensor, width: int):
        from sgl_kvxfer.kernels.paged_layout import TieredBlockTables

        P, table = self.page_size, batch.req_to_token
        assert (width - 1) * P < table.shape[1], "block-table width past the req-to-token row"
        # Slots at page starts -> page ids. Columns past a request's length hold stale slots,
        # which are still valid page ids (the kernels never read past lens).
        pages = (table[batch.req_pool_indices, : width * P : P] // P).to(torch.int32)
        B = pages.shape[0]
        none_pages = torch.zeros((B, 1), dtype=torch.int32, device=table.device)
        none_lens = torch.zeros(B, dtype=torch.int32, device=table.device)
        return TieredBlockTables((pages, none_pages, none_pages), (lens, none_lens, none_lens))

    def _split_plan(self, tables) -> tuple:
        """(pages per split, splits) from the table width (with one split the kernel writes the
        output itself and skips the merge)."""
        return self._plan_splits(tables.tables[0].shape[1], tables.batch_size, self.num_kv_heads,
                                 torch.device(self.kv_pool.device))

    def forward_qkv(self, qkv, cos, sin, layer_id, batch):
        """With the fused elementwise kernels on: RoPE, the K/V store into the paged pool and
        q's layout in one launch (kernels/rope_store.py), then the attention kernels. Extend
        also gets the new k/v back (its kernel reads them at full precision)."""
        if not (fused_ops.wants_fused(qkv.device.type, qkv.dtype) and cos.dtype == qkv.dtype):
            return super().forward_qkv(qkv, cos, sin, layer_id, batch)
        from sgl_kvxfer.kernels.rope_store import rope_store_kv

        pool = self.kv_pool
        q, k, v = rope_store_kv(qkv, cos, sin, batch.out_cache_loc, pool.k_buffer[layer_id],
                                pool.v_buffer[layer_id], self.num_q_heads, self.num_kv_heads,
                                return_kv=batch.mode != ForwardMode.DECODE)
        return self._attend(q, k, v, layer_id, batch)

    def forward(self, q, k, v, layer_id, batch):
        self.kv_pool.set_kv(layer_id, batch.out_cache_loc, k, v)
        return self._attend(q, k, v, layer_id, batch)

    def _attend(self, q, k, v, layer_id, batch):
        """Attention over the pool, the batch's new K/V already stored."""
        plan = batch.attn_metadata
        q = q.contiguous()
        if batch.mode == ForwardMode.DECODE:
            pool = self.kv_pool
            return self._decode(q, pool.k_buffer[layer_id], pool.v_buffer[layer_id], plan.tables.tables[0],
                                plan.tables.lens[0], sm_scale=self.scale, split_plan=plan.split_plan, check=False,
                                even_splits=plan.even_splits, request_order=plan.request_order)
        return self._extend(q, k.contiguous(), v.contiguous(), plan.qo_indptr, self.layers[layer_id],
                            plan.tables, sm_scale=self.scale, max_extend_len=plan.max_extend_len, check=False,
                            tiles=plan.tiles, max_prefix_len=plan.max_prefix_len,
                            int_tiers=False)  # the int tiers are placeholders here
