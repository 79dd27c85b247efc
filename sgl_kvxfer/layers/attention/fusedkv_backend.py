"""FusedKV attention: any backend for the storage layers, plus K/V reconstruction for the top ones.

`create_attention_backend` builds this over a LayerMappedKVPool (mem_cache/layer_mapped_pool.py):
the named backend (torch, cpu, triton, flashinfer) is built over the pool's inner family and
serves the storage layers unchanged (`forward_qkv` / `forward`); a reconstruction layer calls
`forward_reconstruct(q, layer_id, batch, recon)` with its queries only and attends over K/V
rebuilt from the stored caches of its source layers (models/fusedkv_llama.py: KVReconstruction).

Plans (once per batch):
    prepare_metadata / prepare_graph_metadata   the inner backend's plan, plus the DECODE
                                                reconstruction plan (graph: width = the bound)
    prepare_reconstruct(batch, rows)            called by the model between the halves: the
                                                EXTEND query rows (None = every token)

The EXTEND query rows of a request are consecutive positions p .. p + c - 1 of its run
(ForwardBatch.logits_spans: prompt-logprob rows, then the sampled last token if it samples; a
request that does not sample stops one short of its last token), and the storage layers stored
every key by then. Each such run is one pseudo-request whose keys end at its last query, so its
queries are the last c of its p + c keys, query j attending keys [0, p + j]:

    request i:  [ prefix ............... | new tokens ............... ]   keys 0 .. seq - 1
    query run:                           | p ...... p + c - 1 | (rest)   pseudo-request: keys 0 .. p + c - 1

Paths (`self.path`, logged once):
    triton-tiered  a tiered pool under the Triton tiered backend (fp16 / bf16, uniform store
            formats): DECODE and an EXTEND with one row per request (prefill-skip) through
            kernels/fusedkv_tiered_decode.py (each key's sources read from the store its id is
            in, dequantized and fused in registers); other EXTENDs on the torch path
    triton  inner pool paged fp16 (triton / flashinfer backends): kernels/fusedkv_attention.py
            reads both sources through the block tables and fuses in registers; DECODE and an
            EXTEND with at most one row per request run its split-K decode kernel (prefill-skip
            is a decode of each prompt's last token), other EXTENDs its extend kernel
    torch   anything else (fp32 / CPU, tiered pools under the torch backend, the kernels
            missing): pool.get_kv of both sources (get_kv_no_sync in DECODE),
            kernels/reference.fuse_kv, SDPA
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sgl_kvxfer.forward_batch import ForwardBatch, ForwardMode
from sgl_kvxfer.layers.attention.base import AttentionBackend

logger = logging.getLogger(__name__)


@dataclass
class _TorchDecode:
    slots: torch.Tensor  # int64 [B, W] (0 past seq_len and for dropped tokens)
    key_mask: torch.Tensor  # bool [B, 1, 1, W]


@dataclass
class _TorchExtend:
    groups: list  # per request with rows: (row_lo, row_hi, slots [S], mask [n, S])


@dataclass
class _TieredDecode:
    """Tiered-kernel path, DECODE: each request's req-to-token row (its slots' tier ids)."""
    slots: torch.Tensor  # int64 [B, W]
    seq_lens: torch.Tensor  # int32 [B]
    split_plan: tuple
    even_splits: bool


@dataclass
class _KernelPlan:
    """Kernel path: decode over `block_table` rows (the whole DECODE batch, or the requests of
    an EXTEND with one row each) or extend with `qo_indptr` (EXTEND, several rows)."""
    block_table: torch.Tensor  # int32 [B', W]
    kv_lens: torch.Tensor  # int32 [B']
    split_plan: tuple | None = None  # decode
    even_splits: bool = False
    qo_indptr: torch.Tensor | None = None  # extend: int32 [B + 1]
    max_q_len: int = 0


def _tiered_kernel_module():
    try:
        from sgl_kvxfer.kernels import fusedkv_tiered_decode
    except ImportError as exc:
        logger.info("FusedKV tiered kernel unavailable (%s)", exc)
        return None
    return fusedkv_tiered_decode


def _kernel_module():
    try:
        from sgl_kvxfer.kernels import fusedkv_attention
    except ImportError as exc:  # kernels not built / not merged: the torch path runs
        logger.info("FusedKV kernels unavailable (%s)", exc)
        return None
    return fusedkv_attention


class FusedKVAttentionBackend(AttentionBackend):
    supports_prefill_graph = False  # the top half runs on a per-batch row count

    def __init__(self, inner: AttentionBackend, kv_pool, num_q_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__(kv_pool, num_q_heads, num_kv_heads, head_dim)
        self.inner = inner
        hook = getattr(inner, "before_graph_replay", None)  # FlashInfer re-plans before replays
        if hook is not None:
            self.before_graph_replay = hook
        self._kernels, why = None, self._kernel_unsupported_reason(kv_pool)
        if why is None:
            self._kernels = _kernel_module()
            why = None if self._kernels is not None else "kernels/fusedkv_attention.py not importable"
        # over a tiered pool served by the Triton tiered backend: DECODE through
        # kernels/fusedkv_tiered_decode.py (sources fused in registers), EXTEND on the torch path
        self._tiered, self._tiered_stores = None, None
        if self._kernels is None and kv_pool.layout == "tiered":
            why = self._tiered_unsupported_reason(inner, kv_pool)
            if why is None:
                self._tiered = _tiered_kernel_module()
                why = None if self._tiered is not None else "kernels/fusedkv_tiered_decode.py not importable"
            if self._tiered is not None:
                self._tiered_stores = self._stacked_stores(kv_pool)
        self.path = "triton" if self._kernels is not None else ("triton-tiered" if self._tiered is not None else "torch")
        # the torch path's decode plan is graph-safe too (slow, but exact): its decode reads the
        # pool through get_kv_no_sync (a tiered pool's get_kv syncs; capturing it fails)
        self.supports_cuda_graph = inner.supports_cuda_graph
        self.page_size = getattr(kv_pool, "page_size", 1)
        # NOTE: the reconstruction plan of the batch being run lives here (the inner backend owns
        # batch.attn_metadata): a batch's prepare_* and its forward run back to back on the
        # scheduler thread, and a captured graph holds its plan's tensors itself.
        self._batch, self._plan = None, None
        logger.info("FusedKV attention: storage layers on %s, reconstruction on the %s path%s",
                    type(inner).__name__, self.path, f" ({why})" if why else "")

    @staticmethod
    def _kernel_unsupported_reason(pool) -> str | None:
        if pool.layout != "paged":
            return f"{type(pool.inner).__name__} is not the paged fp16 pool"
        if pool.dtype not in (torch.float16, torch.bfloat16):
            return f"dtype {pool.dtype}"
        if pool.head_dim < 16 or pool.head_dim & (pool.head_dim - 1):
            return f"head_dim {pool.head_dim} is not a power of two >= 16"
        return None

    @staticmethod
    def _tiered_unsupported_reason(inner, pool) -> str | None:
        from sgl_kvxfer.layers.attention.triton_tiered_backend import TritonTieredAttentionBackend

        if not isinstance(inner, TritonTieredAttentionBackend):
            return f"the tiered pool is read by {type(inner).__name__}, not the Triton tiered backend"
        if pool.dtype not in (torch.float16, torch.bfloat16):
            return f"dtype {pool.dtype}"
        if pool.head_dim < 16 or pool.head_dim & (pool.head_dim - 1):
            return f"head_dim {pool.head_dim} is not a power of two >= 16"
        if not pool.inner.formats.is_uniform:
            return "per-layer store formats (no stacked stores)"
        return None

    @staticmethod
    def _stacked_stores(pool):
        """The inner tiered pool's stacked stores (allocated once, never moved: graph-safe)."""
        from sgl_kvxfer.kernels.fusedkv_tiered_decode import TieredStores
        from sgl_kvxfer.spectrum.tiers import TIER_INT4, TIER_INT8

        tiered = pool.inner
        rows_k, rows_v = tiered.stacked_rows()
        p8, p4 = tiered.num_pages(TIER_INT8), tiered.num_pages(TIER_INT4)
        return TieredStores(rows_k, rows_v, tiered.stacked_store(TIER_INT8) if p8 else None,
                            tiered.stacked_store(TIER_INT4) if p4 else None, p8, p4,
                            tiered.base(TIER_INT8), tiered.base(TIER_INT4), tiered.group_size)

    # ------------------------------------------------------------------ plans
    def prepare_metadata(self, batch: ForwardBatch) -> None:
        self.inner.prepare_metadata(batch)
        self._batch, self._plan = batch, None
        if batch.mode == ForwardMode.DECODE:
            self._plan = self._decode_plan(batch, max(batch.seq_lens_cpu), graph=False)

    def prepare_graph_metadata(self, batch: ForwardBatch, max_seq_len: int) -> None:
        self.inner.prepare_graph_metadata(batch, max_seq_len)
        self._batch, self._plan = batch, self._decode_plan(batch, max_seq_len, graph=True)

    def _decode_plan(self, batch: ForwardBatch, width: int, graph: bool):
        """Device ops only (graph-safe); `width` bounds every seq_len."""
        if self._tiered is not None:
            slots = batch.req_to_token[batch.req_pool_indices, :width].to(torch.int64)
            plan = self._tiered.plan_tiered_splits(slots.shape[1], slots.shape[0], self.num_kv_heads, slots.device)
            return _TieredDecode(slots, batch.seq_lens.to(torch.int32), plan, even_splits=graph)
        if self._kernels is not None:
            table = self._block_table(batch.req_to_token, batch.req_pool_indices, width)
            plan = self._kernels.plan_fusedkv_splits(table.shape[1], table.shape[0], self.num_kv_heads, table.device)
            return _KernelPlan(table, batch.seq_lens.to(torch.int32), plan, even_splits=graph)
        rows = batch.req_to_token[batch.req_pool_indices, :width]
        valid = torch.arange(width, device=rows.device)[None, :] < batch.seq_lens[:, None]
        if self.kv_pool.drops_tokens:
            valid &= rows != 0
        return _TorchDecode(torch.where(valid, rows, 0), valid[:, None, None, :])

    def _block_table(self, req_to_token, rows, width: int) -> torch.Tensor:
        """int32 [len(rows), cdiv(width, P)]: page ids at each request's page starts."""
        P = self.page_size
        pages = -(-max(width, 1) // P)
        assert (pages - 1) * P < req_to_token.shape[1], "block-table width past the req-to-token row"
        return (req_to_token[rows, : pages * P : P] // P).to(torch.int32)

    def prepare_reconstruct(self, batch: ForwardBatch, rows: torch.Tensor | None) -> None:
        """EXTEND: plan the query rows (flat token indices, ascending; None = every token).
        DECODE: planned already."""
        if batch.mode == ForwardMode.DECODE:
            return
        if batch is not self._batch:
            raise RuntimeError("prepare_reconstruct before prepare_metadata of the same batch")
        if rows is None:
            runs = [(i, p, n) for i, (p, n) in enumerate(zip(batch.extend_prefix_lens, batch.extend_seq_lens))]
        elif batch.logits_spans is not None:
            runs = [(i, p, c) for i, (p, c) in enumerate(batch.logits_spans) if c]
        else:
            runs = self._runs_from_rows(batch, rows)  # host sync
        runs = [r for r in runs if r[2]]
        if self._tiered is not None and runs and all(c == 1 for _, _, c in runs):
            self._plan = self._tiered_extend_plan(batch, runs)  # prefill-skip: a decode of each last token
            return
        plan = self._kernel_extend_plan if self._kernels is not None else self._torch_extend_plan
        self._plan = plan(batch, runs)

    def _tiered_extend_plan(self, batch: ForwardBatch, runs) -> _TieredDecode:
        """One query per run (the row at position p of request i, seeing keys [0, p]): the tiered
        decode kernel over each request's row, cut at p + 1 keys."""
        dev = batch.req_to_token.device
        req = torch.tensor([i for i, _, _ in runs], dtype=torch.int64, device=dev)
        lens = [p + 1 for _, p, _ in runs]
        slots = batch.req_to_token[batch.req_pool_indices[req], :max(lens)].to(torch.int64)
        plan = self._tiered.plan_tiered_splits(slots.shape[1], len(runs), self.num_kv_heads, dev)
        return _TieredDecode(slots, torch.tensor(lens, dtype=torch.int32, device=dev), plan, even_splits=False)

    @staticmethod
    def _runs_from_rows(batch: ForwardBatch, rows: torch.Tensor) -> list[tuple[int, int, int]]:
        """(request, first position, count) of each run of consecutive positions among `rows`."""
        runs, start, i = [], 0, 0
        ends = []
        for n in batch.extend_seq_lens:
            start += n
            ends.append(start)
        for r in rows.tolist():
            while r >= ends[i]:
                i += 1
            pos = batch.extend_prefix_lens[i] + r - (ends[i] - batch.extend_seq_lens[i])
            if runs and runs[-1][0] == i and sum(runs[-1][1:]) == pos:
                runs[-1] = (i, runs[-1][1], runs[-1][2] + 1)
            else:
                runs.append((i, pos, 1))
        return runs

    def _torch_extend_plan(self, batch: ForwardBatch, runs) -> _TorchExtend:
        table, dev = batch.req_to_token, batch.req_to_token.device
        groups, lo = [], 0
        for i, p, c in runs:
            keys = p + c  # a run's queries see keys [0, p + c) at most
            pos = torch.arange(p, keys, device=dev)
            slots = table[int(batch.req_pool_indices[i]), :keys]
            mask = torch.arange(keys, device=dev)[None, :] <= pos[:, None]
            if self.kv_pool.drops_tokens:
                mask &= (slots != 0)[None, :]
            groups.append((lo, lo + c, slots, mask))
            lo += c
        return _TorchExtend(groups)

    def _kernel_extend_plan(self, batch: ForwardBatch, runs) -> _KernelPlan:
        """Each run is a pseudo-request whose keys end at its last query: its queries are the
        last c of p + c keys, the kernels' layout (decode: c = 1)."""
        dev = batch.req_to_token.device
        req = torch.tensor([i for i, _, _ in runs], dtype=torch.int64, device=dev)
        lens = [p + c for _, p, c in runs]
        table = self._block_table(batch.req_to_token, batch.req_pool_indices[req], max(lens))
        kv_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
        if all(c == 1 for _, _, c in runs):  # prefill-skip's usual case: one query per sampling request
            plan = self._kernels.plan_fusedkv_splits(table.shape[1], len(runs), self.num_kv_heads, dev)
            return _KernelPlan(table, kv_lens, plan)
        indptr = [0]
        for _, _, c in runs:
            indptr.append(indptr[-1] + c)
        return _KernelPlan(table, kv_lens, qo_indptr=torch.tensor(indptr, dtype=torch.int32, device=dev),
                           max_q_len=max(c for _, _, c in runs))

    # ------------------------------------------------------------------ storage layers
    def forward_qkv(self, qkv, cos, sin, layer_id, batch):
        return self.inner.forward_qkv(qkv, cos, sin, layer_id, batch)

    def forward(self, q, k, v, layer_id, batch):
        return self.inner.forward(q, k, v, layer_id, batch)

    # ------------------------------------------------------------------ reconstruction layers
    def forward_reconstruct(self, q: torch.Tensor, layer_id: int, batch: ForwardBatch, recon) -> torch.Tensor:
        """q [N, Hq, D] (rotated; the planned rows) -> attention output [N, Hq, D] over the K/V
        that `recon` rebuilds from its source layers' stored caches."""
        plan = self._plan
        if plan is None:
            raise RuntimeError("forward_reconstruct on an EXTEND batch without prepare_reconstruct")
        if isinstance(plan, _KernelPlan):
            return self._forward_kernel(q.contiguous(), plan, recon)
        if isinstance(plan, _TieredDecode):
            s0, s1 = recon.sources
            k_layers, v_layers, weights = ((s1,), (s0,), None) if recon.lite else ((s0, s1), (s0, s1), recon.packed)
            return self._tiered.fusedkv_tiered_decode(q.contiguous(), self._tiered_stores, k_layers, v_layers,
                                                      plan.slots, plan.seq_lens, weights, sm_scale=self.scale,
                                                      split_plan=plan.split_plan, even_splits=plan.even_splits)
        if isinstance(plan, _TorchDecode):
            keys, values = self._rebuild(plan.slots, recon, no_sync=True)  # [B, W, Hkv, D]
            out = F.scaled_dot_product_attention(
                q[:, :, None, :], keys.transpose(1, 2), values.transpose(1, 2),
                attn_mask=plan.key_mask, scale=self.scale, enable_gqa=True)
            return out[:, :, 0, :]
        out = torch.empty_like(q)
        for lo, hi, slots, mask in plan.groups:
            keys, values = self._rebuild(slots, recon)  # [S, Hkv, D]
            oi = F.scaled_dot_product_attention(
                q[lo:hi].transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
                attn_mask=mask, scale=self.scale, enable_gqa=True)
            out[lo:hi] = oi[0].transpose(0, 1)
        return out

    def _forward_kernel(self, q: torch.Tensor, plan: _KernelPlan, recon) -> torch.Tensor:
        pool, (s0, s1) = self.kv_pool, recon.sources
        if recon.lite:
            k_pages, v_pages, weights = (pool.k_buffer[s1],), (pool.v_buffer[s0],), None
        else:
            k_pages = (pool.k_buffer[s0], pool.k_buffer[s1])
            v_pages = (pool.v_buffer[s0], pool.v_buffer[s1])
            weights = recon.packed
        if plan.qo_indptr is not None:
            return self._kernels.fusedkv_extend_attention(q, plan.qo_indptr, k_pages, v_pages, plan.block_table,
                                                          plan.kv_lens, weights, sm_scale=self.scale,
                                                          max_q_len=plan.max_q_len)
        return self._kernels.fusedkv_decode_attention(q, k_pages, v_pages, plan.block_table, plan.kv_lens, weights,
                                                      sm_scale=self.scale, split_plan=plan.split_plan,
                                                      even_splits=plan.even_splits)

    def _rebuild(self, slots: torch.Tensor, recon, no_sync: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [*slots.shape, Hkv, D] of a reconstruction layer at `slots` (torch path);
        no_sync: read with get_kv_no_sync (decode, which a CUDA graph may capture)."""
        from sgl_kvxfer.kernels.reference import fuse_kv

        s0, s1 = recon.sources
        read = self.kv_pool.get_kv_no_sync if no_sync else self.kv_pool.get_kv
        k1, v1 = read(s1, slots)
        k0, v0 = (k1, v1) if s0 == s1 else read(s0, slots)
        if recon.lite:
            return k1, v0
        return fuse_kv(k0, k1, v0, v1, recon.key_weight, recon.value_weight)
