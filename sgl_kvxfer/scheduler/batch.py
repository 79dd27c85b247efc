"""ScheduleBatch (scheduler side, ids and lists) and `prepare_batch`, the one place where the
scheduler's integer state becomes tensors (a ForwardBatch)."""
from __future__ import annotations

from array import array
from dataclasses import dataclass, field

import torch

from sgl_kvxfer.forward_batch import ForwardBatch, ForwardMode
from sgl_kvxfer.scheduler.req import Req
from sgl_kvxfer.utils.host_copy import int64_to_device, to_device


@dataclass(slots=True)  # slots: one is built per request per decode step
class ReqSlice:
    """Tokens fill_ids[start : start + length] of `req` computed in this batch."""
    req: Req
    start: int
    length: int
    sample: bool  # the last token's logits draw the next token
    # Filled by prepare_batch: rows of the logits tensor that belong to this slice.
    logprob_rows: tuple[int, int] = (0, 0)  # [row_lo, row_hi) of prompt-logprob positions
    logprob_first_pos: int = 0  # token position whose logits sit at row_lo
    sample_row: int = -1


@dataclass
class ScheduleBatch:
    mode: ForwardMode
    slices: list[ReqSlice] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.length for s in self.slices)


def prepare_batch(batch: ScheduleBatch, out_cache_loc: torch.Tensor, req_to_token: torch.Tensor,
                  device: str) -> ForwardBatch:
    """Write the new slots into the req-to-token table and build the ForwardBatch.

    Prompt-logprob positions of a slice: p in [logprob_start_len, prompt_len - 1) intersected
    with [start, start + length); the logits at position p score token p + 1.
    """
    if batch.mode == ForwardMode.DECODE and all(s.req.input_logprobs_done for s in batch.slices):
        return prepare_decode(batch, out_cache_loc, req_to_token, device)
    # Per-token lists cost ~30 ns per int to pack; only input_ids needs them. Positions and
    # table rows follow from the per-request (start, length, row) in a few vector ops.
    input_ids, logits_rows = array("q"), []
    prefix_lens, extend_lens, seq_lens, rows, spans = [], [], [], [], []
    flat, spans_ok = 0, True
    for s in batch.slices:
        req = s.req
        input_ids.extend(req.fill_slice(s.start, s.start + s.length))
        span = (s.start, 0)  # (first position, count) of this slice's logits rows
        if not req.input_logprobs_done:
            lo = max(req.logprob_start_len, s.start)
            hi = min(len(req.origin_input_ids) - 1, s.start + s.length)
            row_lo = len(logits_rows)
            if hi > lo:
                logits_rows.extend(range(flat + lo - s.start, flat + hi - s.start))
                span = (lo, hi - lo)
            s.logprob_rows, s.logprob_first_pos = (row_lo, len(logits_rows)), lo
        if s.sample:
            s.sample_row = len(logits_rows)
            logits_rows.append(flat + s.length - 1)
            last = s.start + s.length - 1
            span = (last, 1) if span[1] == 0 else (span[0], span[1] + 1) if last == sum(span) else None
        flat += s.length
        spans_ok = spans_ok and span is not None
        spans.append(span)
        prefix_lens.append(s.start)
        extend_lens.append(s.length)
        seq_lens.append(s.start + s.length)
        rows.append(req.req_pool_idx)

    T, B, N = len(input_ids), len(rows), len(logits_rows)
    small = torch.tensor((prefix_lens, extend_lens, rows), dtype=torch.int64)  # [3, B]
    ext = small[1]
    # position of flat token t = t - (first flat index of its request) + that request's start
    shift = torch.repeat_interleave(small[0] - (torch.cumsum(ext, 0) - ext), ext, output_size=T)
    positions = torch.arange(T, dtype=torch.int64) + shift
    token_rows = torch.repeat_interleave(small[2], ext, output_size=T)
    # One host->device copy for every index list (per-request copies or table writes cost a
    # launch each, which dominates a large decode batch on a GPU).
    host = torch.cat([torch.frombuffer(input_ids, dtype=torch.int64) if T else torch.empty(0, dtype=torch.int64),
                      positions, token_rows, small[2],
                      torch.tensor(seq_lens, dtype=torch.int64), torch.tensor(logits_rows, dtype=torch.int64)])
    packed = to_device(host, device)
    ids_t, pos_t, tok_rows_t, rows_t, lens_t, logits_t = packed.split([T, T, T, B, B, N])
    req_to_token[tok_rows_t, pos_t] = out_cache_loc.to(req_to_token.dtype)
    return ForwardBatch(
        mode=batch.mode, input_ids=ids_t, positions=pos_t, out_cache_loc=out_cache_loc,
        req_pool_indices=rows_t, seq_lens=lens_t, extend_prefix_lens=prefix_lens,
        extend_seq_lens=extend_lens, seq_lens_cpu=seq_lens, logits_positions=logits_t,
        req_to_token=req_to_token, logits_spans=spans if spans_ok else None)


def prepare_decode(batch: ScheduleBatch, out_cache_loc: torch.Tensor, req_to_token: torch.Tensor,
                   device: str, input_ids: torch.Tensor | None = None) -> ForwardBatch:
    """prepare_batch for a decode batch (one token per request, every row samples): the same
    ForwardBatch in one pass over the requests (host time per decode step is the GPU's bound).
    `input_ids` (device, [B]): the tokens to feed when they are not on the host yet (the
    overlap scheduler feeds the previous step's sampled tokens straight from the GPU)."""
    slices = batch.slices
    B = len(slices)
    positions = [s.start for s in slices]
    rows = [s.req.req_pool_idx for s in slices]
    seq_lens = [p + 1 for p in positions]
    for i, s in enumerate(slices):
        s.sample_row = i
    host_ids = [] if input_ids is not None else [s.req.fill_slice(s.start, s.start + 1)[0] for s in slices]
    packed = int64_to_device((host_ids, positions, rows, seq_lens), device)
    ids_t, pos_t, rows_t, lens_t = packed.split([len(host_ids), B, B, B])
    if input_ids is not None:
        ids_t = input_ids
    req_to_token[rows_t, pos_t] = out_cache_loc.to(req_to_token.dtype)
    return ForwardBatch(
        mode=batch.mode, input_ids=ids_t, positions=pos_t, out_cache_loc=out_cache_loc,
        req_pool_indices=rows_t, seq_lens=lens_t, extend_prefix_lens=positions,
        extend_seq_lens=[1] * B, seq_lens_cpu=seq_lens, logits_positions=_arange(B, device),
        req_to_token=req_to_token)


_ARANGE: dict = {}


def _arange(n: int, device: str) -> torch.Tensor:
    """int64 [0, n) on `device`, cached (decode logits rows are always all rows)."""
    key = (str(device), n)
    if key not in _ARANGE:
        _ARANGE[key] = torch.arange(n, dtype=torch.int64, device=device)
    return _ARANGE[key]
