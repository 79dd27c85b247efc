"""Logprob extraction with SGLang's entry format: [logprob, token_id] (text added later)."""
from __future__ import annotations

import torch


def token_logprobs(logprobs: torch.Tensor, token_ids: list[int]) -> list[float]:
    """logprobs [N, V] (log_softmax) -> logprob of token_ids[n] at row n."""
    idx = torch.tensor(token_ids, dtype=torch.int64, device=logprobs.device)[:, None]
    return logprobs.gather(1, idx)[:, 0].tolist()


def top_logprobs(logprobs: torch.Tensor, k: int) -> list[list[list]]:
    """Per row, the k best [logprob, token_id] pairs."""
    vals, ids = logprobs.topk(k, dim=-1)
    return [[[v, t] for v, t in zip(vr, ir)] for vr, ir in zip(vals.tolist(), ids.tolist())]


def ids_logprobs(logprobs: torch.Tensor, token_ids: list[int]) -> list[list[list]]:
    """Per row, [logprob, token_id] for each requested id."""
    idx = torch.tensor(token_ids, dtype=torch.int64, device=logprobs.device)
    vals = logprobs[:, idx].tolist()
    return [[[v, t] for v, t in zip(row, token_ids)] for row in vals]
