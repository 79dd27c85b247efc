"""CudaGraphRunner: decode steps replayed from CUDA graphs, one graph per batch-size bucket.

Decode is host-bound: ~25 torch ops and the attention launches per layer cost far more CPU time
than the GPU needs. The whole decode forward (embedding -> layers -> final norm -> logits) is
captured once per bucket over static buffers and replayed:

    static row:  0 ......... B-1 | B ......... bucket-1 | bucket ..... max_bs-1
                 the live batch  | padding rows         | not read by this bucket's graph
    padding row: input_id 0, position 0, seq_len 0, out_cache_loc = kv_pool.scratch_slot,
                 req_pool_index = runner.padding_req_row

Invariants:
- Padding rows never touch live state: their K/V store lands on the pool's scratch page (never
  allocated, never read as KV, so page 0 stays zero), their block-table row is the runner's
  reserved req-to-token row, and seq_len 0 makes attention read no page (the split-K merge
  writes 0 for a row without tokens). Their logits are garbage and are never returned.
- Everything a graph reads sits at a fixed address: the static buffers, the weights, the KV
  buffers, the req-to-token table and the RoPE cos/sin cache (grown to the whole context before
  capture; every later forward needs fewer positions, so it never regrows).
- Shapes inside a graph depend on the bucket alone (`AttentionBackend.prepare_graph_metadata`).
- A backend with `before_graph_replay` (FlashInfer: its plan is host work, outside the graph)
  re-plans its fixed-address buffers from the live batch right before each replay.

`decode_step_static(bs)` is the capture target. With use_graphs=False (CPU tests) `replay` runs
it eagerly, which exercises the same buffers, padding and fixed attention plan without CUDA.
"""
from __future__ import annotations

import bisect
import logging
import time

import torch

from sgl_kvxfer.forward_batch import ForwardBatch, ForwardMode

logger = logging.getLogger(__name__)

DEFAULT_MAX_BS = 256
WARMUP_RUNS = 2  # eager runs per bucket before capture: Triton autotune / JIT happen here


def cuda_graph_buckets(max_bs: int) -> list[int]:
    """Captured batch sizes: 1, 2, 4, 8, every 8 up to 64, every 16 after, and max_bs itself."""
    sizes = [1, 2, 4, 8] + list(range(16, 65, 8)) + list(range(80, max_bs + 1, 16))
    return sorted({b for b in sizes if b <= max_bs} | {max_bs})


def bucket_for(batch_size: int, buckets: list[int]) -> int:
    """Smallest bucket >= batch_size; buckets sorted, batch_size in [1, buckets[-1]]."""
    assert 1 <= batch_size <= buckets[-1], (batch_size, buckets[-1])
    return buckets[bisect.bisect_left(buckets, batch_size)]


def resolve_max_bs(configured: int | None, max_running_requests: int) -> int:
    """--cuda-graph-max-bs, default min(max_running_requests, 256); never above
    max_running_requests (no decode batch is larger)."""
    return min(configured or DEFAULT_MAX_BS, max_running_requests)


def graph_unsupported_reason(runner) -> str | None:
    """Why this runner cannot replay decode from graphs, or None when it can."""
    if runner.config.disable_cuda_graph:
        return "disabled by --disable-cuda-graph"
    if not str(runner.device).startswith("cuda"):
        return f"device {runner.device} is not CUDA"
    if not runner.attn_backend.supports_cuda_graph:
        return f"the {type(runner.attn_backend).__name__} has no graph-safe decode plan"
    if not hasattr(runner.kv_pool, "scratch_slot"):
        return f"{type(runner.kv_pool).__name__} has no scratch page for padding rows"
    return None


def capture_graphs(sizes: list[int], step, what: str, size_name: str) -> dict[int, "torch.cuda.CUDAGraph"]:
    """One CUDA graph of `step(size)` per size, largest first, all in one memory pool (smaller
    graphs reuse the largest one's blocks), each after WARMUP_RUNS eager runs on the capture
    stream (Triton JIT and autotune happen there). Shared by decode and prefill graphs."""
    torch.cuda.synchronize()
    free_before = torch.cuda.mem_get_info()[0]
    t0 = time.perf_counter()
    pool = torch.cuda.graph_pool_handle()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graphs = {}
    for size in sorted(sizes, reverse=True):
        with torch.cuda.stream(stream):
            for _ in range(WARMUP_RUNS):
                step(size)
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            step(size)
        graphs[size] = graph
    torch.cuda.synchronize()
    used = (free_before - torch.cuda.mem_get_info()[0]) / 2**30
    logger.info("captured %d %s CUDA graphs (%s %s) in %.1f s, %.2f GiB", len(graphs), what, size_name,
                sorted(sizes), time.perf_counter() - t0, used)
    return graphs


def create_cuda_graph_runner(runner) -> "CudaGraphRunner | None":
    """Capture at model-runner init (after the KV pool exists), or None where graphs do not apply."""
    reason = graph_unsupported_reason(runner)
    if reason is not None:
        logger.info("CUDA graphs off: %s", reason)
        return None
    max_bs = resolve_max_bs(runner.config.cuda_graph_max_bs, runner.max_running_requests)
    return CudaGraphRunner(runner, max_bs)


class CudaGraphRunner:
    # Rows of the packed int64 input buffer (one copy fills them all).
    INPUT_IDS, POSITIONS, OUT_CACHE_LOC, REQ_POOL_INDICES, SEQ_LENS = range(5)

    def __init__(self, runner, max_bs: int, use_graphs: bool = True):
        self.runner = runner
        self.model, self.backend = runner.model, runner.attn_backend
        self.buckets = cuda_graph_buckets(max_bs)
        self.max_bs = self.buckets[-1]
        # Every seq_len is <= this (the scheduler rejects longer requests): the fixed table width.
        self.max_seq_len = min(runner.context_len, runner.max_total_tokens)
        self.use_graphs = use_graphs
        # A backend whose plan is host work (FlashInfer) re-plans its fixed buffers before each
        # replay: before_graph_replay(bs, live_batch, static req_pool_indices[:bs], seq_lens[:bs]).
        self._before_replay = getattr(self.backend, "before_graph_replay", None)
        dev, n = runner.device, self.max_bs
        pad = [0, 0, runner.kv_pool.scratch_slot, runner.padding_req_row, 0]
        self._padding = torch.tensor(pad, dtype=torch.int64, device=dev)[:, None].expand(5, n).contiguous()
        self._inputs = self._padding.clone()  # [5, max_bs]; row i is contiguous
        (self.input_ids, self.positions, self.out_cache_loc, self.req_pool_indices,
         self.seq_lens) = self._inputs.unbind(0)
        self._rows = torch.arange(n, dtype=torch.int64, device=dev)
        self.logits = torch.zeros((n, runner.arch.vocab_size), dtype=torch.float32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.replays = 0
        self.model.rotary.ensure(self.max_seq_len, dev)  # before capture: see the module doc
        if use_graphs:
            self._capture_all()

    def can_run(self, batch: ForwardBatch) -> bool:
        # extras carry per-feature hooks (importance capture...) that only the eager path runs;
        # the backend check keeps benchmarks that swap runner.attn_backend on the eager path.
        return (batch.mode == ForwardMode.DECODE and batch.batch_size <= self.max_bs and not batch.extras
                and self.runner.attn_backend is self.backend)

    @torch.inference_mode()
    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [B, vocab] fp32 of a decode batch (B = batch.batch_size <= max_bs).

        NOTE: the result is a view of the static logits buffer: consume (or clone) it before
        the next replay, which overwrites it."""
        B = batch.batch_size
        bs = bucket_for(B, self.buckets)
        live = torch.stack([batch.input_ids, batch.positions, batch.out_cache_loc,
                            batch.req_pool_indices, batch.seq_lens])
        self._inputs[:, :B].copy_(live)
        if bs > B:  # rows a larger earlier batch left live must read as padding again
            self._inputs[:, B:bs].copy_(self._padding[:, B:bs])
        if self._before_replay is not None:  # host-side attention plans (flashinfer_backend.py)
            self._before_replay(bs, batch, self.req_pool_indices[:bs], self.seq_lens[:bs])
        if self.use_graphs:
            self.graphs[bs].replay()
        else:
            self.decode_step_static(bs)
        self.replays += 1
        return self.logits[:B]

    def decode_step_static(self, bs: int) -> None:
        """The capture target: decode forward of static rows [0, bs) into logits[:bs].

        Reads only the static buffers and fixed-address state; no host sync, no shape that
        depends on the live batch (seq_lens_cpu holds the static bound, not live lengths)."""
        batch = ForwardBatch(
            mode=ForwardMode.DECODE, input_ids=self.input_ids[:bs], positions=self.positions[:bs],
            out_cache_loc=self.out_cache_loc[:bs], req_pool_indices=self.req_pool_indices[:bs],
            seq_lens=self.seq_lens[:bs], extend_prefix_lens=[self.max_seq_len - 1] * bs,
            extend_seq_lens=[1] * bs, seq_lens_cpu=[self.max_seq_len] * bs,
            logits_positions=self._rows[:bs], req_to_token=self.runner.req_to_token.table,
            attn_backend=self.backend)
        self.backend.prepare_graph_metadata(batch, self.max_seq_len)
        hidden = self.model(batch.input_ids, batch.positions, batch)
        self.logits[:bs].copy_(self.model.compute_logits(hidden))

    @torch.inference_mode()
    def _capture_all(self) -> None:
        """Largest bucket first, all graphs in one memory pool (smaller ones reuse its blocks).
        Static rows are all padding here, so warm-up and capture write only the scratch page.

        NOTE: the decode kernel's Triton autotune runs in the first warm-up, whose rows are all
        empty, so its config pick is not informed by real lengths (the eager path tunes on the
        first decode batch, equally arbitrary). Graphs keep the pick until restart."""
        self._inputs.copy_(self._padding)
        self.graphs = capture_graphs(self.buckets, self.decode_step_static, "decode", "batch sizes")
