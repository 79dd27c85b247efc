"""FlashInfer attention backend (`--attention-backend flashinfer`): FlashInfer's paged kernels
over PagedFp16KVPool, on CUDA only.

The pool's per-layer buffers [num_pages + 2, Hkv, PAGE, D] are FlashInfer's "HND" paged layout
as they stand (page-major, then head, then token, then dim), so each layer's KV is passed as the
(k_buffer, v_buffer) pair with no copy. Page ids come straight from the req-to-token rows, which
the paged allocator keeps page-consistent (slot // PAGE at each page start), like the Triton
backend's block tables:

    request i:  pages  row[0] // P, row[P] // P, ...   (n_i = cdiv(len_i, P) of them)
    CSR:        indptr[i + 1] = indptr[i] + n_i,  indices = the pages,  last_page_len = len_i - (n_i - 1) P

Decode: BatchDecodeWithPagedKVCacheWrapper, planned once per batch (host work), run once per
layer. Tensor cores (FlashInfer's prefill kernel in decode form) from a GQA group of 4 up,
CUDA cores below (SGLang's rule).
Extend: the new tokens' K/V are stored first (AttentionBackend's invariant), then
BatchPrefillWithPagedKVCacheWrapper attends causally over prefix + new tokens, all paged
(FlashInfer aligns the causal mask bottom-right: query j of an n-token run sits at kv position
len - n + j).
CUDA graphs (decode): one wrapper per batch-size bucket with use_cuda_graph=True over fixed
index buffers. FlashInfer's plan is host work that cannot be captured, so the graph runner calls
`before_graph_replay` with the live rows before each replay, which re-plans into the same fixed
buffers (FlashInfer always splits KV under graphs, so the captured launch serves any lengths).
Padding rows (seq_len 0) read one token of page 0, the pool's zero page.
Not supported: prefill CUDA graphs, the tiered pool, fp32 models (FlashInfer runs fp16 / bf16).

NOTE: plan() stages its schedule in a pinned host buffer and copies it with non_blocking=True, as
SGLang does; the copy is ordered before the batch's kernels on the stream.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from sgl_kvxfer.forward_batch import ForwardBatch, ForwardMode
from sgl_kvxfer.layers import fused_ops
from sgl_kvxfer.layers.attention.base import AttentionBackend

WORKSPACE_BYTES = 128 << 20  # FlashInfer's recommended float workspace (split-KV partials)
KERNEL_BACKEND = "fa2"  # FlashInfer's FA2 kernels: one JIT build per (dtype, head_dim), Hopper included


def flashinfer_import_error() -> str | None:
    """Why `import flashinfer` fails here, or None when it imports."""
    try:
        import flashinfer  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - ImportError, or a broken install's RuntimeError
        return f"{type(exc).__name__}: {exc}"
    return None


def use_tensor_cores(num_q_heads: int, num_kv_heads: int) -> bool:
    """Decode on tensor cores from a GQA group of 4 up (SGLang's rule for fp16 / bf16 KV)."""
    return num_q_heads // num_kv_heads >= 4


def paged_csr(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, lens: torch.Tensor,
              lens_cpu: list[int], page_size: int):
    """FlashInfer's paged-KV CSR for rows `req_pool_indices` of `req_to_token` holding `lens`
    tokens each (device int tensor, with the same values on the host as `lens_cpu`).

    Returns (indptr_cpu int32 [B + 1], indptr int32 [B + 1], indices int32 [total pages],
    last_page_len int32 [B]), all on the table's device but indptr_cpu, with no host sync. A row
    of length 0 (a CUDA-graph padding row) gets one token of its first page (page 0 for the
    runner's padding row, the pool's zero page)."""
    P, dev = page_size, req_to_token.device
    n_pages = [max(-(-n // P), 1) for n in lens_cpu]
    indptr_cpu = torch.zeros(len(n_pages) + 1, dtype=torch.int32)
    torch.cumsum(torch.tensor(n_pages, dtype=torch.int32), 0, out=indptr_cpu[1:])
    total, width = int(indptr_cpu[-1]), max(n_pages)
    assert (width - 1) * P < req_to_token.shape[1], "page count past the req-to-token row"
    pages = (req_to_token[req_pool_indices, : width * P : P] // P).to(torch.int32)  # [B, width]
    indptr = indptr_cpu.to(dev, non_blocking=True)
    counts = indptr[1:] - indptr[:-1]
    row = torch.repeat_interleave(torch.arange(len(n_pages), device=dev), counts, output_size=total)
    col = torch.arange(total, device=dev, dtype=torch.int32) - indptr[row]
    indices = pages[row, col]
    lens = lens.to(torch.int32)
    last = torch.clamp(lens - (counts - 1) * P, min=1)
    return indptr_cpu, indptr, indices, last


@dataclass
class _FlashInferPlan:
    wrapper: object  # the planned decode or prefill wrapper
    decode: bool


class FlashInferAttentionBackend(AttentionBackend):
    supports_cuda_graph = True
    supports_prefill_graph = False

    def __init__(self, kv_pool, num_q_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__(kv_pool, num_q_heads, num_kv_heads, head_dim)
        device = torch.device(kv_pool.device)
        if device.type != "cuda":
            raise ValueError(f"--attention-backend flashinfer runs on CUDA only, got device {device}; "
                             f"use --attention-backend triton or torch")
        if getattr(kv_pool, "layout", None) != "paged":
            raise ValueError(f"--attention-backend flashinfer needs the paged fp16 KV pool (--page-size >= 16, "
                             f"no --kv-tier-budget < 1), got {type(kv_pool).__name__} (layout "
                             f"{getattr(kv_pool, 'layout', None)!r})")
        if kv_pool.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"--attention-backend flashinfer needs a float16 or bfloat16 model, got "
                             f"{kv_pool.dtype}; pass --dtype float16 or --dtype bfloat16")
        err = flashinfer_import_error()
        if err is not None:
            raise ValueError(f"--attention-backend flashinfer: flashinfer is not importable ({err}); install "
                             f"flashinfer-python (scripts/gpu/README.md, 'FlashInfer') or use --attention-backend triton")
        import flashinfer

        self._fi = flashinfer
        self.page_size = kv_pool.page_size
        self.device = device
        self.tensor_cores = use_tensor_cores(num_q_heads, num_kv_heads)
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "HND", use_tensor_cores=self.tensor_cores, backend=KERNEL_BACKEND)
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "HND", backend=KERNEL_BACKEND)
        self._graph_wrappers: dict[int, object] = {}  # batch-size bucket -> CUDA-graph decode wrapper
        self.kv = list(zip(kv_pool.k_buffer, kv_pool.v_buffer))

    # ---- planning -------------------------------------------------------------------------
    def _plan_decode(self, wrapper, batch_rows, lens, lens_cpu, req_to_token) -> None:
        indptr_cpu, indptr, indices, last = paged_csr(req_to_token, batch_rows, lens, lens_cpu, self.page_size)
        dtype = self.kv_pool.dtype
        wrapper.plan(indptr, indices, last, self.num_q_heads, self.num_kv_heads, self.head_dim, self.page_size,
                     q_data_type=dtype, kv_data_type=dtype, sm_scale=self.scale)

    def prepare_metadata(self, batch: ForwardBatch) -> None:
        if batch.mode == ForwardMode.DECODE:
            self._plan_decode(self._decode, batch.req_pool_indices, batch.seq_lens, batch.seq_lens_cpu,
                              batch.req_to_token)
            batch.attn_metadata = _FlashInferPlan(self._decode, True)
            return
        lens_cpu = [p + n for p, n in zip(batch.extend_prefix_lens, batch.extend_seq_lens)]
        lens = torch.tensor(lens_cpu, dtype=torch.int32).to(self.device, non_blocking=True)
        indptr_cpu, indptr, indices, last = paged_csr(batch.req_to_token, batch.req_pool_indices, lens, lens_cpu,
                                                      self.page_size)
        qo = torch.zeros(len(lens_cpu) + 1, dtype=torch.int32)
        torch.cumsum(torch.tensor(batch.extend_seq_lens, dtype=torch.int32), 0, out=qo[1:])
        dtype = self.kv_pool.dtype
        self._prefill.plan(qo.to(self.device, non_blocking=True), indptr, indices, last, self.num_q_heads,
                           self.num_kv_heads, self.head_dim, self.page_size, causal=True, sm_scale=self.scale,
                           q_data_type=dtype, kv_data_type=dtype)
        batch.attn_metadata = _FlashInferPlan(self._prefill, False)

    def _graph_wrapper(self, bs: int, max_seq_len: int):
        w = self._graph_wrappers.get(bs)
        if w is None:
            max_pages = bs * max(-(-max_seq_len // self.page_size), 1)
            dev = self.device
            w = self._fi.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "HND", use_cuda_graph=True, use_tensor_cores=self.tensor_cores,
                paged_kv_indptr_buffer=torch.zeros(bs + 1, dtype=torch.int32, device=dev),
                paged_kv_indices_buffer=torch.zeros(max_pages, dtype=torch.int32, device=dev),
                paged_kv_last_page_len_buffer=torch.ones(bs, dtype=torch.int32, device=dev),
                backend=KERNEL_BACKEND)
            self._graph_wrappers[bs] = w
        return w

    def prepare_graph_metadata(self, batch: ForwardBatch, max_seq_len: int) -> None:
        """The graph runner's capture target calls this eagerly (warm-up) and under capture. The
        eager calls plan the bucket's wrapper from the static rows (host lengths read from the
        device: warm-up only); under capture the plan is left as it is (plan is host work) and
        `before_graph_replay` re-plans before every replay."""
        assert batch.mode == ForwardMode.DECODE
        bs = batch.batch_size
        w = self._graph_wrapper(bs, max_seq_len)
        if not torch.cuda.is_current_stream_capturing():
            lens_cpu = batch.seq_lens.tolist()
            self._plan_decode(w, batch.req_pool_indices, batch.seq_lens, lens_cpu, batch.req_to_token)
        batch.attn_metadata = _FlashInferPlan(w, True)

    def before_graph_replay(self, bs: int, live: ForwardBatch, req_pool_indices: torch.Tensor,
                            seq_lens: torch.Tensor) -> None:
        """Re-plan bucket `bs`'s wrapper for the live batch: rows [0, B) are `live`'s, rows [B, bs)
        padding (seq_len 0); req_pool_indices / seq_lens are the graph's static rows [0, bs),
        already filled."""
        lens_cpu = list(live.seq_lens_cpu) + [0] * (bs - live.batch_size)
        self._plan_decode(self._graph_wrappers[bs], req_pool_indices, seq_lens, lens_cpu, live.req_to_token)

    # ---- per layer ------------------------------------------------------------------------
    def forward_qkv(self, qkv, cos, sin, layer_id, batch):
        """With the fused elementwise kernels on: RoPE and the K/V store in one launch
        (kernels/rope_store.py), then FlashInfer over the pool."""
        if not (fused_ops.wants_fused(qkv.device.type, qkv.dtype) and cos.dtype == qkv.dtype):
            return super().forward_qkv(qkv, cos, sin, layer_id, batch)
        from sgl_kvxfer.kernels.rope_store import rope_store_kv

        pool = self.kv_pool
        q, _, _ = rope_store_kv(qkv, cos, sin, batch.out_cache_loc, pool.k_buffer[layer_id],
                                pool.v_buffer[layer_id], self.num_q_heads, self.num_kv_heads, return_kv=False)
        return self._attend(q, layer_id, batch)

    def forward(self, q, k, v, layer_id, batch):
        self.kv_pool.set_kv(layer_id, batch.out_cache_loc, k, v)
        return self._attend(q, layer_id, batch)

    def _attend(self, q, layer_id, batch):
        """Attention over the pool, the batch's new K/V already stored: q [T, Hq, D] -> [T, Hq, D]."""
        return batch.attn_metadata.wrapper.run(q.contiguous(), self.kv[layer_id])
