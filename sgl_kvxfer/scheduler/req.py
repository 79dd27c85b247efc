"""Per-request scheduler state (plain Python; tensors only for slot ids and the RNG).

KV bookkeeping of a request in the req-to-token row `req_pool_idx`:

    fill_ids:  [ origin_input_ids ............ | output_ids ......... ]
    row:       [ prefix (cache-owned, locked) | private slots | (none) ]
               0                       prefix_len           kv_len
    Running invariant: kv_len == len(fill_ids) - 1 (the newest token's KV is computed by the
    next decode step).
"""
from __future__ import annotations

from typing import Any

import torch

from sgl_kvxfer.message import TokenizedGenerateReq
from sgl_kvxfer.sampling.params import SamplingParams


class Req:
    def __init__(self, msg: TokenizedGenerateReq, arrival: int):
        self.rid = msg.rid
        self.origin_input_ids: list[int] = list(msg.input_ids)
        self.sampling: SamplingParams = msg.sampling
        self.return_logprob = msg.return_logprob
        self.logprob_start_len = msg.logprob_start_len
        self.top_logprobs_num = msg.top_logprobs_num
        self.token_ids_logprob = msg.token_ids_logprob
        self.stream = msg.stream
        self.bootstrap = msg.bootstrap  # PD: where the prompt's KV goes (prefill) or comes from (decode)
        self.extra_meta: dict | None = None  # reply meta_info extras (PD transfer facts)
        self.arrival = arrival
        # Fixed per request, read by every decode step (scheduler/overlap.py): the prompt's
        # length, whether sampling needs nothing but a GPU argmax, and how many output tokens
        # must exist before EOS / stop ids stop being banned (min_new_tokens; 0: never banned).
        p = msg.sampling
        self.prompt_len = len(self.origin_input_ids)
        self.greedy_on_device = p.is_greedy and not msg.return_logprob and not p.has_logit_processors
        self.banned_until = p.min_new_tokens if (p.stop_token_ids or not p.ignore_eos) else 0
        self.output_ids: list[int] = []
        self.finished_reason: dict | None = None
        # KV state
        self.req_pool_idx: int | None = None
        self.prefix_len = 0
        self.kv_len = 0
        self.last_node: Any = None
        self.cached_tokens = 0
        self.num_retractions = 0
        # False: the request neither takes a cached prefix nor gives its KV to the prefix cache
        # (SCD: a producer needs every position's hidden states; a consumer's rebuilt KV is an
        # approximation no other request may reuse). Set by a PD role before admission.
        self.share_prefix = True
        # Output state: deltas not yet sent.
        self.sent_output_len = 0
        self.input_logprobs_done = not (msg.return_logprob and msg.logprob_start_len >= 0)
        self.input_logprobs_sent = self.input_logprobs_done
        self.input_token_logprobs: list[list] = []
        self.input_top_logprobs: list = []
        self.input_token_ids_logprobs: list = []
        self.output_token_logprobs: list[list] = []
        self.output_top_logprobs: list = []
        self.output_token_ids_logprobs: list = []
        seed = msg.sampling.sampling_seed
        self.generator = None if seed is None else torch.Generator().manual_seed(seed)

    @property
    def fill_ids(self) -> list[int]:
        """A new list (O(seq_len)): hot paths use `seq_len` / `fill_slice` instead."""
        return self.origin_input_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        """len(fill_ids), without building it."""
        return self.prompt_len + len(self.output_ids)

    def fill_slice(self, start: int, end: int) -> list[int]:
        """fill_ids[start:end], copying only those tokens (a decode step's one token is O(1))."""
        n = self.prompt_len
        if start >= n:
            return self.output_ids[start - n : end - n]
        if end <= n:
            return self.origin_input_ids[start:end]
        return self.origin_input_ids[start:] + self.output_ids[: end - n]

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    @property
    def remaining_new_tokens(self) -> int:
        return max(self.sampling.max_new_tokens - len(self.output_ids), 0)

    def prefix_match_limit(self) -> int:
        """Longest prefix the cache may serve: at least one token must be computed (its logits
        sample the next token), and prompt logprobs need logits from logprob_start_len on."""
        if not self.share_prefix:
            return 0
        limit = self.seq_len - 1
        if not self.input_logprobs_done:
            limit = min(limit, self.logprob_start_len)
        return max(limit, 0)

    def finish(self, reason: dict) -> None:
        if self.finished_reason is None:
            self.finished_reason = reason
