"""Fp16KVPool: every token's K and V held at the model dtype (fp16/bf16 on GPU; fp32 on CPU).

Layout per layer: k_buffer[layer] and v_buffer[layer], each [size + page_size, Hkv, D] indexed by
slot; the first page (row 0 at page_size 1) is padding.
"""
from __future__ import annotations

import torch

from sgl_kvxfer.mem_cache.host_pages import advise_hugepages
from sgl_kvxfer.mem_cache.kv_pool import KVPool


class Fp16KVPool(KVPool):
    stores_exact = True  # k/v are stored at the model dtype, unchanged

    def __init__(self, size: int, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: str, page_size: int = 1):
        super().__init__(size, num_layers, num_kv_heads, head_dim, dtype, device)
        # With a paged allocator (page_size P > 1; the cpu attention backend's default, so a
        # request's tokens sit in runs of P rows) slots go up to size + P - 1 and page 0
        # (rows 0..P-1) is the padding: P padding rows instead of one.
        self.page_size = page_size
        shape = (size + page_size, num_kv_heads, head_dim)
        # torch.zeros on a multi-GB CPU buffer would touch every page at start-up; empty() is lazy.
        self.k_buffer = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_buffer = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        for buf in self.k_buffer + self.v_buffer:
            advise_hugepages(buf)  # CPU: before the first touch (host_pages.py)
            buf[:page_size].zero_()

    @property
    def id_end(self) -> int:
        """A paged allocator's last page ends at slot size + P - 1: every buffer row."""
        return self.size + self.page_size

    def set_kv(self, layer_id, slots, k, v):
        self.k_buffer[layer_id][slots] = k.to(self.dtype)
        self.v_buffer[layer_id][slots] = v.to(self.dtype)

    def get_kv(self, layer_id, slots):
        # index_select over flat slots, not buf[slots]: the same rows, but on CPU advanced
        # indexing with a 2-D index runs ~6x slower (it was 40% of a bf16 decode step).
        flat = slots.reshape(-1)
        shape = (*slots.shape, self.num_kv_heads, self.head_dim)
        return (self.k_buffer[layer_id].index_select(0, flat).view(shape),
                self.v_buffer[layer_id].index_select(0, flat).view(shape))

    def bytes_per_token(self, with_scales: bool = True) -> float:
        elem = torch.finfo(self.dtype).bits // 8
        return float(2 * self.num_layers * self.num_kv_heads * self.head_dim * elem)

    @staticmethod
    def bytes_per_token_for(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> float:
        return float(2 * num_layers * num_kv_heads * head_dim * (torch.finfo(dtype).bits // 8))
