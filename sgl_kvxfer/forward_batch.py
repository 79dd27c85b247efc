"""ForwardBatch: the tensor boundary between the scheduler (ids, lists) and the model runner.

A batch is a flattened ragged set of token runs, one run per request:

    request i:  [ prefix (cached, extend_prefix_lens[i]) | new tokens (extend_seq_lens[i]) ]
                 ^ position 0                             ^ positions of input_ids' run i
    seq_lens[i] = extend_prefix_lens[i] + extend_seq_lens[i]

DECODE is the special case extend_seq_lens == 1 for every request.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch


class ForwardMode(enum.Enum):
    EXTEND = "extend"
    DECODE = "decode"


@dataclass
class ForwardBatch:
    mode: ForwardMode
    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    out_cache_loc: torch.Tensor  # int64 [T]: KV slot of each new token
    req_pool_indices: torch.Tensor  # int64 [B]
    seq_lens: torch.Tensor  # int64 [B]
    extend_prefix_lens: list[int]
    extend_seq_lens: list[int]
    seq_lens_cpu: list[int]
    logits_positions: torch.Tensor  # int64 [N]: rows of the hidden states that need logits
    req_to_token: torch.Tensor  # [max_reqs, max_context] (shared table, read only here)
    attn_backend: Any = None  # set by the model runner
    attn_metadata: Any = None  # filled by attn_backend.prepare_metadata
    extras: dict = field(default_factory=dict)  # per-feature hooks (importance capture, ...)
    # EXTEND, host: per request (position of its first logits row, row count), its rows being
    # consecutive positions; None = not recorded or not consecutive (FusedKV reads the rows back)
    logits_spans: list[tuple[int, int]] | None = None

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())
