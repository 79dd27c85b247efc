"""PagedFp16KVPool: the fp16 family in the paged, head-major layout the Triton kernels read.

Layout per layer (kernels/README.md section 2, the fp16 tier):

    k_buffer[layer], v_buffer[layer]: [num_pages + 2, Hkv, PAGE, D]
    page:   0 (padding, zeroed) | 1 .. num_pages (allocator's) | num_pages + 1 (scratch)
    slot s  ->  page s // PAGE, offset s % PAGE   (slots from PagedTokenSlotAllocator)

Page 0 must read as zeros (masked rows of the kernels read it). The scratch page is never
handed out and never read as KV: writes that must land nowhere (the padding rows of a
CUDA-graph decode batch) go to `scratch_slot`.

Head-major inside a page: one (page, kv-head) tile is one contiguous PAGE * D block.
`set_kv` / `get_kv` take token slots like every KVPool, so the torch backend runs on it too.
"""
from __future__ import annotations

import torch

from sgl_kvxfer.mem_cache.fp16_pool import Fp16KVPool
from sgl_kvxfer.mem_cache.kv_pool import KVPool
from sgl_kvxfer.utils.host_copy import int64_to_device


class PagedFp16KVPool(KVPool):
    layout = "paged"
    stores_exact = True

    def __init__(self, size: int, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: str, page_size: int = 64):
        self.page_size = page_size
        self.num_pages = size // page_size
        super().__init__(self.num_pages * page_size, num_layers, num_kv_heads, head_dim, dtype, device)
        shape = (self.num_pages + 2, num_kv_heads, page_size, head_dim)
        self.scratch_slot = (self.num_pages + 1) * page_size
        # empty(): lazy on CPU; only the padding page must read as zeros (masked rows * 0).
        # One allocation per K / V with a view per layer: write_layers stores many layers in one
        # index_put (an SCD segment's rebuilt layers).
        self.k_all = torch.empty((num_layers, *shape), dtype=dtype, device=device)
        self.v_all = torch.empty((num_layers, *shape), dtype=dtype, device=device)
        self.k_buffer, self.v_buffer = list(self.k_all.unbind(0)), list(self.v_all.unbind(0))
        self._layer_ids: dict[tuple[int, ...], torch.Tensor] = {}  # write_layers' index tensors
        for buf in self.k_buffer + self.v_buffer:
            buf[0].zero_()

    @property
    def id_end(self) -> int:
        """Pages 1 .. num_pages hand out slots up to (num_pages + 1) * PAGE - 1, past `size`;
        the scratch page is covered too."""
        return (self.num_pages + 2) * self.page_size

    def set_kv(self, layer_id, slots, k, v):
        page, off = slots // self.page_size, slots % self.page_size
        # Advanced indices split by a slice: the indexed view is [n, Hkv, D], like k and v.
        self.k_buffer[layer_id][page, :, off] = k.to(self.dtype)
        self.v_buffer[layer_id][page, :, off] = v.to(self.dtype)

    def write_external(self, slots, layers_kv):
        """set_kv for every layer, with the slots' (page, offset) computed once, not per layer."""
        page, off = slots // self.page_size, slots % self.page_size
        for layer_id, (k, v) in enumerate(layers_kv):
            self.k_buffer[layer_id][page, :, off] = k.to(self.dtype)
            self.v_buffer[layer_id][page, :, off] = v.to(self.dtype)

    def write_layers(self, slots, layer_ids, k, v):
        """k, v [len(layer_ids), n, Hkv, D] at `slots` [n] of those layers: one index_put each.

            k_all[layer, page, :, off]  <-  indices [L', n] broadcast (layer x slot), then Hkv, D
        """
        ids = self._layer_ids.get(layer_ids)
        if ids is None:
            ids = self._layer_ids[layer_ids] = int64_to_device((layer_ids,), self.device)  # no host wait
        page, off = (slots // self.page_size)[None, :], (slots % self.page_size)[None, :]
        self.k_all[ids[:, None], page, :, off] = k.to(self.dtype)
        self.v_all[ids[:, None], page, :, off] = v.to(self.dtype)

    def get_kv(self, layer_id, slots):
        page, off = slots // self.page_size, slots % self.page_size
        return self.k_buffer[layer_id][page, :, off], self.v_buffer[layer_id][page, :, off]

    def bytes_per_token(self, with_scales: bool = True) -> float:
        return Fp16KVPool.bytes_per_token_for(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype)
