"""Batched sampling: logit processors, then greedy or temperature/top-k/top-p/min-p draws.

Greedy rows (top_k == 1) never touch the RNG, so they are reproducible and batch-invariant.
A row with a `sampling_seed` draws from its own torch.Generator.
"""
from __future__ import annotations

import torch

from sgl_kvxfer.sampling.params import SamplingParams


def apply_logit_processors(logits: torch.Tensor, params: list[SamplingParams], histories: list[list[int]],
                           banned: list[list[int]]) -> torch.Tensor:
    """logits [B, V] fp32 (modified copy). `histories[i]`: generated ids so far; `banned[i]`:
    ids masked out (EOS before min_new_tokens)."""
    logits = logits.clone()
    for i, p in enumerate(params):
        if p.logit_bias:
            ids = torch.tensor([int(t) for t in p.logit_bias], dtype=torch.int64, device=logits.device)
            logits[i, ids] += torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype, device=logits.device)
        hist = histories[i]
        if hist and (p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty):
            ids, counts = torch.tensor(hist, device=logits.device).unique(return_counts=True)
            row = logits[i]
            if p.repetition_penalty != 1.0:
                vals = row[ids]
                row[ids] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
            row[ids] -= p.frequency_penalty * counts.to(row.dtype) + p.presence_penalty
        if banned[i]:
            logits[i, banned[i]] = float("-inf")
    return logits


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """logits [B, V] fp32 -> one token id per row."""
    out = _greedy(logits).tolist()
    for i, p in enumerate(params):
        if p.is_greedy:
            continue
        row = logits[i] / p.temperature
        if p.top_k < row.numel():
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            cum = sorted_probs.cumsum(0)
            drop = (cum - sorted_probs) > p.top_p  # keep the smallest set reaching top_p
            probs[order[drop]] = 0.0
        if p.min_p > 0.0:
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        gen = generators[i]
        cpu_probs = probs.float().cpu()
        out[i] = int(torch.multinomial(cpu_probs / cpu_probs.sum(), 1, generator=gen).item())
    return out


def _greedy(logits: torch.Tensor) -> torch.Tensor:
    """Row argmax (first maximal index). On CPU the native parallel kernel: torch's reduction
    runs single-threaded, ~9 ms for a 256 x 49152 decode batch."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2 and logits.shape[1]:
        from sgl_kvxfer.kernels import cpu_ops

        if cpu_ops.enabled():
            return cpu_ops.argmax_rows(logits)
    return logits.argmax(dim=-1)
