"""FusedKV attention: any backend for the storage layers, plus K/V reconstruction for the top ones.

`create_attention_backend` builds this over a LayerMappedKVPool (mem_cache/layer_mapped_pool.py):
the named backend (torch, cpu, triton, ...) is built over the pool's inner family and serves the
storage layers unchanged (`forward_qkv` / `forward`); a reconstruction layer calls
`forward_reconstruct(q, layer_id, batch, recon)` with its queries only and attends over K/V
rebuilt from the stored caches of its source layers (models/fusedkv_llama.py: KVReconstruction).

Plans (once per batch):
    prepare_metadata / prepare_graph_metadata   the inner backend's plan, plus for DECODE the
                                                reconstruction plan of the torch path (padded
                                                slots [B, W] + key mask; W = the graph bound
                                                under CUDA graphs)
    prepare_reconstruct(batch, rows)            called by the model between the halves: the
                                                EXTEND query rows (None = every token)

An EXTEND query at position p of a request attends keys [0, p] of that request, which the
storage layers have stored by then (prefix + this batch's tokens):

    request i:  [ prefix .............. | new tokens ......... ]    keys 0 .. seq_i - 1
    query row:                                  ^ p               keys 0 .. p   (a decode of length p + 1)

Paths: the Triton kernels of kernels/fusedkv_attention.py (fusion in registers) where they
apply, else the torch path: gather both sources with pool.get_kv, fuse (fusedkv_math.fuse_kv),
SDPA. `self.path` says which one runs; the choice is logged once.
"""
from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sgl_kvxfer.engine.forward_batch import ForwardBatch, ForwardMode
from sgl_kvxfer.layers.attention.base import AttentionBackend

logger = logging.getLogger(__name__)


@dataclass
class _DecodeSlots:
    slots: torch.Tensor  # int64 [B, W] (0 past seq_len and for dropped tokens)
    key_mask: torch.Tensor  # bool [B, 1, 1, W]


@dataclass
class _ExtendRows:
    """Torch-path EXTEND plan: the N query rows grouped by request (rows of one request are
    contiguous and ascending, as logits_positions are)."""
    groups: list[tuple[int, int, torch.Tensor, torch.Tensor]]  # (row_lo, row_hi, slots [S], mask [n, S])


class FusedKVAttentionBackend(AttentionBackend):
    supports_prefill_graph = False  # the top half runs on a per-batch row count

    def __init__(self, inner: AttentionBackend, kv_pool, num_q_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__(kv_pool, num_q_heads, num_kv_heads, head_dim)
        self.inner = inner
        self.supports_cuda_graph = inner.supports_cuda_graph
        hook = getattr(inner, "before_graph_replay", None)  # FlashInfer re-plans before replays
        if hook is not None:
            self.before_graph_replay = hook
        self.path = "torch"
        self._batch = self._decode = self._extend = None
        logger.info("FusedKV attention: storage layers on %s, reconstruction on the %s path",
                    type(inner).__name__, self.path)

    def kv_pool_resized(self) -> None:
        hook = getattr(self.inner, "kv_pool_resized", None)
        if hook is not None:
            hook()

    # ------------------------------------------------------------------ plans
    def prepare_metadata(self, batch: ForwardBatch) -> None:
        self.inner.prepare_metadata(batch)
        self._batch, self._extend = batch, None
        self._decode = self._decode_slots(batch, max(batch.seq_lens_cpu)) if batch.mode == ForwardMode.DECODE else None

    def prepare_graph_metadata(self, batch: ForwardBatch, max_seq_len: int) -> None:
        self.inner.prepare_graph_metadata(batch, max_seq_len)
        self._batch, self._extend = batch, None
        self._decode = self._decode_slots(batch, max_seq_len)

    def _decode_slots(self, batch: ForwardBatch, width: int) -> _DecodeSlots:
        """Device ops only (graph-safe): row slots past seq_len (and dropped ones) read slot 0, masked."""
        rows = batch.req_to_token[batch.req_pool_indices, :width]
        valid = torch.arange(width, device=rows.device)[None, :] < batch.seq_lens[:, None]
        if self.kv_pool.drops_tokens:
            valid &= rows != 0
        return _DecodeSlots(torch.where(valid, rows, 0), valid[:, None, None, :])

    def prepare_reconstruct(self, batch: ForwardBatch, rows: torch.Tensor | None) -> None:
        """EXTEND: plan the query rows `rows` (flat token indices, ascending; None = all tokens)."""
        if batch.mode == ForwardMode.DECODE:
            return
        if batch is not self._batch:
            raise RuntimeError("prepare_reconstruct before prepare_metadata of the same batch")
        table, dev = batch.req_to_token, batch.req_to_token.device
        ends, starts = [], []
        for n in batch.extend_seq_lens:
            starts.append(ends[-1] if ends else 0)
            ends.append(starts[-1] + n)
        flat = list(range(ends[-1] if ends else 0)) if rows is None else rows.tolist()
        groups, lo = [], 0
        while lo < len(flat):
            i = bisect.bisect_right(ends, flat[lo])  # request of this row
            hi = bisect.bisect_left(flat, ends[i], lo)
            seq = batch.seq_lens_cpu[i]
            pos = torch.tensor(flat[lo:hi], device=dev) - starts[i] + batch.extend_prefix_lens[i]
            slots = table[int(batch.req_pool_indices[i]), :seq]
            mask = torch.arange(seq, device=dev)[None, :] <= pos[:, None]
            if self.kv_pool.drops_tokens:
                mask &= (slots != 0)[None, :]
            groups.append((lo, hi, slots, mask))
            lo = hi
        self._extend = _ExtendRows(groups)

    # ------------------------------------------------------------------ storage layers
    def forward_qkv(self, qkv, cos, sin, layer_id, batch):
        return self.inner.forward_qkv(qkv, cos, sin, layer_id, batch)

    def forward(self, q, k, v, layer_id, batch):
        return self.inner.forward(q, k, v, layer_id, batch)

    # ------------------------------------------------------------------ reconstruction layers
    def forward_reconstruct(self, q: torch.Tensor, layer_id: int, batch: ForwardBatch, recon) -> torch.Tensor:
        """q [N, Hq, D] (rotated; the planned rows) -> attention output [N, Hq, D] over the K/V
        that `recon` rebuilds from its source layers' stored caches."""
        if batch.mode == ForwardMode.DECODE:
            plan = self._decode
            keys, values = self._rebuild(plan.slots, recon)  # [B, W, Hkv, D]
            out = F.scaled_dot_product_attention(
                q[:, :, None, :], keys.transpose(1, 2), values.transpose(1, 2),
                attn_mask=plan.key_mask, scale=self.scale, enable_gqa=True)
            return out[:, :, 0, :]
        if self._extend is None:
            raise RuntimeError("forward_reconstruct on an EXTEND batch without prepare_reconstruct")
        out = torch.empty_like(q)
        for lo, hi, slots, mask in self._extend.groups:
            keys, values = self._rebuild(slots, recon)  # [S, Hkv, D]
            oi = F.scaled_dot_product_attention(
                q[lo:hi].transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
                attn_mask=mask, scale=self.scale, enable_gqa=True)
            out[lo:hi] = oi[0].transpose(0, 1)
        return out

    def _rebuild(self, slots: torch.Tensor, recon) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [*slots.shape, Hkv, D] of a reconstruction layer at `slots`."""
        from sgl_kvxfer.models.fusedkv_math import fuse_kv

        s0, s1 = recon.sources
        k1, v1 = self.kv_pool.get_kv(s1, slots)
        if s0 == s1:
            k0, v0 = k1, v1
        else:
            k0, v0 = self.kv_pool.get_kv(s0, slots)
        if recon.lite:
            return k1, v0
        return fuse_kv(k0, k1, v0, v1, recon.key_weight, recon.value_weight)
