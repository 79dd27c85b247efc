"""PrefillGraphRunner: extend (prefill) forwards replayed from CUDA graphs, one per token bucket.

A small model's prefill step is bound by the host: ~9 launches per layer at 20-85 us of host
time each (benchmarks/kernels/launch_overhead.py) against a few us of GPU work. Captured once per
token-count bucket over static buffers, the forward from the embedding to the final norm is one
graph launch; the logits rows are gathered and projected eagerly after it (their count varies).

    static token column:  0 ........ T-1 | T ......... Tb-1 | Tb .......... max_tokens-1
                          the live batch | padding tokens   | not read by this bucket's graph
    padding token:        input_id 0, position 0, out_cache_loc = kv_pool.scratch_slot
    static request row:   0 ... B-1 (live) | B ... R-1: no new tokens, no prefix
                          R = max_running_requests + 1, so row R - 1 is never live: spare
                          attention tiles name it and return at once

Invariants:
- Padding tokens never touch live state: their K/V store lands on the pool's scratch page, no
  request's qo_indptr range covers them (attention never reads them as keys) and their hidden
  rows are never gathered for logits. Rows are independent in every other op of the forward.
- Attention runs the extend kernel's tiled launch (kernels/extend_attention.py): its grid is
  max_tiles(Tb, R) tiles, a function of the bucket alone; the host lists the live tiles.
- Everything a graph reads sits at a fixed address: the static buffers, the weights, the KV
  buffers, the req-to-token table and the RoPE cos/sin cache (grown to the context first).
- One host->device copy per replay carries prefix_lens, qo_indptr and the tiles, from pinned
  memory the caching host allocator does not reuse before the copy has run (utils/host_copy.py),
  so the overlap scheduler may form the next batch while this one is queued.

`extend_step_static(Tb)` is the capture target. With use_graphs=False (CPU tests) `replay` runs
it eagerly, which exercises the same buffers, padding and tiled attention without CUDA.
"""
from __future__ import annotations

import bisect
import logging

import numpy as np
import torch

from sgl_kvxfer.engine.cuda_graph_runner import capture_graphs
from sgl_kvxfer.forward_batch import ForwardBatch, ForwardMode
from sgl_kvxfer.utils.host_copy import pinned

logger = logging.getLogger(__name__)

SMALL_BUCKETS = (256, 512, 1024, 2048, 4096)
BUCKET_STEP = 2048  # above the small buckets: a bucket wastes < 2048 padding tokens


def prefill_graph_buckets(max_tokens: int) -> list[int]:
    """Captured token counts: 256 to 4096 in powers of two, then every 2048, and max_tokens."""
    sizes = list(SMALL_BUCKETS) + list(range(SMALL_BUCKETS[-1] + BUCKET_STEP, max_tokens + 1, BUCKET_STEP))
    return sorted({t for t in sizes if t <= max_tokens} | {max_tokens})


def prefill_graph_unsupported_reason(runner) -> str | None:
    """Why this runner cannot replay prefill from graphs, or None when it can."""
    cfg = runner.config
    if not cfg.enable_prefill_cuda_graph:
        return "not enabled (--enable-prefill-cuda-graph)"
    if cfg.disable_cuda_graph:
        return "disabled by --disable-cuda-graph"
    if not str(runner.device).startswith("cuda"):
        return f"device {runner.device} is not CUDA"
    if not runner.attn_backend.supports_prefill_graph:
        return f"the {type(runner.attn_backend).__name__} has no graph-safe extend plan"
    if not hasattr(runner.kv_pool, "scratch_slot"):
        return f"{type(runner.kv_pool).__name__} has no scratch page for padding tokens"
    return None


def create_prefill_graph_runner(runner, max_prefill_tokens: int) -> "PrefillGraphRunner | None":
    reason = prefill_graph_unsupported_reason(runner)
    if reason is not None:
        logger.info("prefill CUDA graphs off: %s", reason)
        return None
    max_tokens = runner.config.prefill_cuda_graph_max_tokens or max_prefill_tokens
    return PrefillGraphRunner(runner, max_tokens)


class PrefillGraphRunner:
    def __init__(self, runner, max_tokens: int, use_graphs: bool = True):
        from sgl_kvxfer.kernels.extend_attention import graph_block_tokens, max_tiles

        self.runner = runner
        self.model, self.backend = runner.model, runner.attn_backend
        self.buckets = prefill_graph_buckets(max_tokens)
        self.max_tokens = self.buckets[-1]
        self.max_seq_len = min(runner.context_len, runner.max_total_tokens)
        self.use_graphs = use_graphs
        dev = runner.device
        self.num_rows = runner.max_running_requests + 1  # the last row is never live (module doc)
        arch = runner.arch
        self.block_tokens = graph_block_tokens(arch.num_attention_heads // arch.num_key_value_heads)
        self._tiles_of = {tb: max_tiles(tb, self.num_rows, self.block_tokens) for tb in self.buckets}
        n, R, nt = self.max_tokens, self.num_rows, self._tiles_of[self.max_tokens]

        pad = torch.tensor([0, 0, runner.kv_pool.scratch_slot], dtype=torch.int64, device=dev)
        self._padding = pad[:, None].expand(3, n).contiguous()
        self._tokens = self._padding.clone()  # [3, max_tokens]; row i is contiguous
        self.input_ids, self.positions, self.out_cache_loc = self._tokens.unbind(0)
        self.req_pool_indices = torch.full((R,), runner.padding_req_row, dtype=torch.int64, device=dev)
        # int32 metadata, one copy per replay: prefix_lens [R] | qo_indptr [R + 1] | tiles, where
        # bucket tb's tiles are tile_req [nt] then tile_blk [nt] (nt = its tile count). All zero
        # (no request has new tokens) until the first replay.
        self._meta = torch.zeros(R + R + 1 + 2 * nt, dtype=torch.int32, device=dev)
        self.prefix_lens, self.qo_indptr = self._meta[:R], self._meta[R : 2 * R + 1]
        self.hidden: dict[int, torch.Tensor] = {}  # bucket -> the forward's output (graph-owned)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.replays = 0
        self.model.rotary.ensure(self.max_seq_len, dev)
        if use_graphs:
            self._capture_all()

    def bucket_for(self, num_tokens: int) -> int:
        return self.buckets[bisect.bisect_left(self.buckets, num_tokens)]

    def can_run(self, batch: ForwardBatch) -> bool:
        # extras carry per-feature hooks (importance capture...) that only the eager path runs
        return (batch.mode == ForwardMode.EXTEND and 0 < batch.num_tokens <= self.max_tokens
                and batch.batch_size < self.num_rows and not batch.extras
                and self.runner.attn_backend is self.backend)

    @torch.inference_mode()
    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [len(batch.logits_positions), vocab] fp32 of an extend batch, as
        ModelRunner.forward returns them (a new tensor)."""
        T, B = batch.num_tokens, batch.batch_size
        tb = self.bucket_for(T)
        self._tokens[:, :T].copy_(torch.stack([batch.input_ids, batch.positions, batch.out_cache_loc]))
        if tb > T:  # columns a larger earlier batch left live must read as padding again
            self._tokens[:, T:tb].copy_(self._padding[:, T:tb])
        self.req_pool_indices[:B].copy_(batch.req_pool_indices)  # rows >= B: no token reads them
        self._write_meta(batch.extend_prefix_lens, batch.extend_seq_lens, T, tb)
        if self.use_graphs:
            self.graphs[tb].replay()
        else:
            self.extend_step_static(tb)
        self.replays += 1
        if batch.logits_positions.numel() == 0:
            return self.hidden[tb].new_empty((0, self.runner.arch.vocab_size), dtype=torch.float32)
        return self.model.compute_logits(self.hidden[tb][batch.logits_positions])

    def _write_meta(self, prefix_lens: list[int], extend_lens: list[int], num_tokens: int, tb: int) -> None:
        from sgl_kvxfer.kernels.extend_attention import build_tiles

        R, B, nt = self.num_rows, len(extend_lens), self._tiles_of[tb]
        meta = np.zeros(2 * R + 1 + 2 * nt, dtype=np.int32)
        meta[:B] = prefix_lens
        qo = meta[R : 2 * R + 1]
        np.cumsum(extend_lens, out=qo[1 : B + 1])
        qo[B + 1 :] = num_tokens  # rows past the batch: no new tokens
        meta[2 * R + 1 :].reshape(2, nt)[:] = build_tiles(extend_lens, self.block_tokens, nt, spare_req=R - 1)
        self._meta[: meta.size].copy_(pinned(torch.from_numpy(meta), self._meta.device), non_blocking=True)

    def _tiles(self, tb: int) -> tuple[torch.Tensor, torch.Tensor]:
        R, nt = self.num_rows, self._tiles_of[tb]
        return self._meta[2 * R + 1 : 2 * R + 1 + nt], self._meta[2 * R + 1 + nt : 2 * R + 1 + 2 * nt]

    def extend_step_static(self, tb: int) -> None:
        """The capture target: the extend forward of static token columns [0, tb) into
        hidden[tb]. Reads only static buffers and fixed-address state; no host sync."""
        batch = ForwardBatch(
            mode=ForwardMode.EXTEND, input_ids=self.input_ids[:tb], positions=self.positions[:tb],
            out_cache_loc=self.out_cache_loc[:tb], req_pool_indices=self.req_pool_indices,
            seq_lens=self.prefix_lens, extend_prefix_lens=[], extend_seq_lens=[],
            seq_lens_cpu=[self.max_seq_len],  # the RoPE bound, not live lengths
            logits_positions=self.input_ids[:0], req_to_token=self.runner.req_to_token.table,
            attn_backend=self.backend)
        self.backend.prepare_extend_graph_metadata(batch, self.prefix_lens, self.qo_indptr, self._tiles(tb),
                                                   self.max_seq_len)
        self.hidden[tb] = self.model(batch.input_ids, batch.positions, batch)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        """The static buffers are padding here (no request has new tokens), so warm-up and
        capture write only the scratch page."""
        self.graphs = capture_graphs(self.buckets, self.extend_step_static, "prefill", "tokens")
