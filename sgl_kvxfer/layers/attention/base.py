"""Attention backend interface: plan once per batch, run once per layer.

Invariants: `prepare_metadata(batch)` runs before any layer's `forward`; `forward` stores the
new k/v into the KV pool at `batch.out_cache_loc` *before* attending, so a request's new
tokens see themselves (causal). Backends never change slot ownership.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from sgl_kvxfer.forward_batch import ForwardBatch
from sgl_kvxfer.mem_cache.kv_pool import KVPool


class AttentionBackend(ABC):
    # True when `prepare_graph_metadata` is implemented (engine/cuda_graph_runner.py).
    supports_cuda_graph = False
    # True when `prepare_extend_graph_metadata` is implemented (engine/prefill_graph_runner.py).
    supports_prefill_graph = False

    def __init__(self, kv_pool: KVPool, num_q_heads: int, num_kv_heads: int, head_dim: int):
        self.kv_pool = kv_pool
        self.num_q_heads = num_q_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5

    @abstractmethod
    def prepare_metadata(self, batch: ForwardBatch) -> None:
        """Plan index/mask tensors for this batch into `batch.attn_metadata`."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: ForwardBatch) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] (rotated) -> attention output [T, Hq, D]."""

    def forward_qkv(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer_id: int,
                    batch: ForwardBatch) -> torch.Tensor:
        """The model's entry point: qkv [T, (Hq + 2 Hkv) D] (the fused projection's output),
        cos/sin [T, 1, D/2] -> attention output [T, Hq, D]. Rotates q and k, then `forward`.
        A backend may override it to fuse RoPE with the KV store (triton_backend.py)."""
        return rotate_and_attend(self, qkv, cos, sin, layer_id, batch)

    def prepare_graph_metadata(self, batch: ForwardBatch, max_seq_len: int) -> None:
        """CUDA-graph decode plan: like `prepare_metadata` for a DECODE batch, but from device
        tensors alone (no host sync, `seq_lens_cpu` unused) and with every shape a function of
        the batch size and `max_seq_len` (>= every seq_len), so one capture serves all replays."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def prepare_extend_graph_metadata(self, batch: ForwardBatch, prefix_lens: torch.Tensor,
                                      qo_indptr: torch.Tensor, tiles: tuple, max_seq_len: int) -> None:
        """CUDA-graph prefill plan for an EXTEND batch over fixed request rows, from device
        tensors alone: prefix_lens int32 [R], qo_indptr int32 [R + 1] (rows without new tokens
        included), tiles (tile_req, tile_blk) from kernels.extend_attention.build_tiles. Every
        shape is a function of the static buffers' sizes and `max_seq_len`."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA-graph prefill")


def rotate_and_attend(backend, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer_id: int,
                      batch) -> torch.Tensor:
    """The unfused forward_qkv, for any object with num_q_heads / num_kv_heads / head_dim and
    `forward` (test fakes assign it as their forward_qkv)."""
    from sgl_kvxfer.layers import fused_ops

    T, Hq, Hkv, D = qkv.shape[0], backend.num_q_heads, backend.num_kv_heads, backend.head_dim
    q, k, v = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
    # q, k are strided views into qkv; rope_qk returns new contiguous tensors
    q, k = fused_ops.rope_qk(q.view(T, Hq, D), k.view(T, Hkv, D), cos, sin)
    return backend.forward(q, k, v.reshape(T, Hkv, D).contiguous(), layer_id, batch)
