"""Attention backend interface: plan once per batch, run once per layer.

Invariants: `prepare_metadata(batch)` runs before any layer's `forward`; `forward` stores the
new k/v into the KV pool at `batch.out_cache_loc` *before* attending, so a request's new
tokens see themselves (causal). Backends never change slot ownership.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from sgl_kvxfer.engine.forward_batch import ForwardBatch
from sgl_kvxfer.mem_cache.kv_pool import KVPool


class AttentionBackend(ABC):
    # True when `prepare_graph_metadata` is implemented (engine/cuda_graph_runner.py).
    supports_cuda_graph = False

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

    def prepare_graph_metadata(self, batch: ForwardBatch, max_seq_len: int) -> None:
        """CUDA-graph decode plan: like `prepare_metadata` for a DECODE batch, but from device
        tensors alone (no host sync, `seq_lens_cpu` unused) and with every shape a function of
        the batch size and `max_seq_len` (>= every seq_len), so one capture serves all replays."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")
