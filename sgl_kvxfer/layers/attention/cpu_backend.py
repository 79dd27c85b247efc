"""CPU attention backend: the torch backend's extend math, native in-place decode.

Decode on the torch backend gathers every request's K/V into a [B, Lmax, Hkv, D] copy padded
to the longest request and runs a masked SDPA over it: per layer it writes the whole batch's KV
once and reads it twice. Here decode calls `kernels.cpu_ops.decode_attention`, which walks each
request's req_to_token row and reads the pool's rows in place (fp32 softmax and accumulation),
one (request, kv-head) work item per thread. Extend (prefill, chunked prefill, radix hits) is
the torch backend's per-request SDPA.

Applies to token-layout pools that never drop tokens (Fp16KVPool) in bf16 / fp32; any other
pool, or a machine where the native extension cannot be built, runs the torch backend's decode.
"""
from __future__ import annotations

import logging

import torch

from sgl_kvxfer.forward_batch import ForwardMode
from sgl_kvxfer.layers.attention.torch_backend import TorchAttentionBackend

logger = logging.getLogger(__name__)


class CpuAttentionBackend(TorchAttentionBackend):
    def __init__(self, kv_pool, num_q_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__(kv_pool, num_q_heads, num_kv_heads, head_dim)
        self.native = None
        if (kv_pool.layout == "token" and not kv_pool.drops_tokens and head_dim % 8 == 0
                and kv_pool.dtype in (torch.bfloat16, torch.float32)):
            from sgl_kvxfer import env
            from sgl_kvxfer.kernels import cpu_ops

            if not env.CPU_KERNELS.get_bool():
                logger.info("SGL_KVXFER_CPU_KERNELS=0: the cpu attention backend decodes with the torch path")
            elif cpu_ops.available():
                self.native = cpu_ops
            else:
                logger.warning("native CPU kernels unavailable (%s); the cpu attention backend decodes "
                               "with the torch path", cpu_ops.load_error())

    def prepare_metadata(self, batch) -> None:
        if batch.mode == ForwardMode.DECODE and self.native is not None:
            batch.attn_metadata = None  # the kernel reads req_to_token rows directly
            return
        super().prepare_metadata(batch)

    def forward(self, q, k, v, layer_id, batch):
        if batch.mode != ForwardMode.DECODE or self.native is None:
            return super().forward(q, k, v, layer_id, batch)
        pool = self.kv_pool
        pool.set_kv(layer_id, batch.out_cache_loc, k, v)
        return self.native.decode_attention(q, pool.k_buffer[layer_id], pool.v_buffer[layer_id],
                                            batch.req_to_token, batch.req_pool_indices, batch.seq_lens,
                                            self.scale)
