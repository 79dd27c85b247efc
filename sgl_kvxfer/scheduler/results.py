"""Turning a forward pass's logits into request progress: prompt logprobs, sampling, finish
checks, and the ReqOutput deltas sent downstream."""
from __future__ import annotations

import torch

from sgl_kvxfer.message import ReqOutput
from sgl_kvxfer.sampling.logprobs import ids_logprobs, token_logprobs, top_logprobs
from sgl_kvxfer.sampling.sampler import apply_logit_processors, sample
from sgl_kvxfer.scheduler.batch import ScheduleBatch
from sgl_kvxfer.scheduler.req import Req


class FinishChecker:
    """SGLang's order: length, stop token ids, EOS, stop strings, context limit."""

    def __init__(self, eos_ids: set[int], tokenizer, context_len: int):
        self.eos_ids = eos_ids
        self.tokenizer = tokenizer
        self.context_len = context_len

    def banned_ids(self, req: Req) -> list[int]:
        if len(req.output_ids) >= req.sampling.min_new_tokens:  # always, at min_new_tokens 0
            return []
        return sorted(set(req.sampling.stop_token_ids) | (set() if req.sampling.ignore_eos else self.eos_ids))

    def check(self, req: Req) -> None:
        """Hot: runs for every request on every decode step."""
        p, out = req.sampling, req.output_ids
        n, token = len(out), out[-1]
        if n >= p.max_new_tokens:
            req.finish({"type": "length", "length": p.max_new_tokens})
        elif token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_ids):
            req.finish({"type": "stop", "matched": token})
        elif p.stop and self.tokenizer is not None:
            window = max(len(s) for s in p.stop) + 2  # a stop string spans at most this many tokens
            tail = self.tokenizer.decode(req.output_ids[-window:], skip_special_tokens=p.skip_special_tokens)
            for s in p.stop:
                if s in tail:
                    req.finish({"type": "stop", "matched": s})
                    break
        if req.finished_reason is None and req.prompt_len + n >= self.context_len:
            req.finish({"type": "length", "length": n})


def process_logits(batch: ScheduleBatch, logits: torch.Tensor, checker: FinishChecker) -> None:
    """Apply one forward's results to its requests (kv_len, logprobs, new tokens, finish)."""
    need_lp = any(s.req.return_logprob for s in batch.slices)
    logprobs = torch.log_softmax(logits, dim=-1) if need_lp and logits.numel() else None
    for s in batch.slices:
        req = s.req
        req.kv_len = s.start + s.length
        if not req.input_logprobs_done:
            _record_prompt_logprobs(req, s, logprobs)
    sampled = [s for s in batch.slices if s.sample]
    if sampled:
        sample_rows = [s.sample_row for s in sampled]
        if sample_rows == list(range(logits.shape[0])):  # decode: every row samples, in order
            picked = logits
        else:
            picked = logits[torch.tensor(sample_rows, device=logits.device)]
        reqs = [s.req for s in sampled]
        params = [r.sampling for r in reqs]
        banned = [checker.banned_ids(r) for r in reqs]
        if any(banned) or any(p.has_logit_processors for p in params):
            picked = apply_logit_processors(picked, params, [r.output_ids for r in reqs], banned)
        tokens = sample(picked, params, [r.generator for r in reqs])
        for s, req, token in zip(sampled, reqs, tokens):
            req.output_ids.append(token)
            if req.return_logprob:
                _record_output_logprob(req, logprobs[s.sample_row : s.sample_row + 1], token)
            checker.check(req)
    for s in batch.slices:
        req = s.req
        if not s.sample and req.kv_len == req.seq_len and req.sampling.max_new_tokens == 0:
            req.finish({"type": "length", "length": 0})


def _record_prompt_logprobs(req: Req, s, logprobs) -> None:
    lo, hi = s.logprob_rows
    prompt = req.origin_input_ids
    if s.start <= req.logprob_start_len < s.start + s.length:
        req.input_token_logprobs.append([None, prompt[req.logprob_start_len]])  # SGLang's shifted first entry
        if req.top_logprobs_num:
            req.input_top_logprobs.append(None)
        if req.token_ids_logprob:
            req.input_token_ids_logprobs.append(None)
    if hi > lo:
        first = s.logprob_first_pos
        targets = prompt[first + 1 : first + 1 + (hi - lo)]
        rows = logprobs[lo:hi]
        req.input_token_logprobs.extend([v, t] for v, t in zip(token_logprobs(rows, targets), targets))
        if req.top_logprobs_num:
            req.input_top_logprobs.extend(top_logprobs(rows, req.top_logprobs_num))
        if req.token_ids_logprob:
            req.input_token_ids_logprobs.extend(ids_logprobs(rows, req.token_ids_logprob))
    if s.start + s.length >= len(prompt):
        req.input_logprobs_done = True


def _record_output_logprob(req: Req, row: torch.Tensor, token: int) -> None:
    req.output_token_logprobs.append([token_logprobs(row, [token])[0], token])
    if req.top_logprobs_num:
        req.output_top_logprobs.extend(top_logprobs(row, req.top_logprobs_num))
    if req.token_ids_logprob:
        req.output_token_ids_logprobs.extend(ids_logprobs(row, req.token_ids_logprob))


def make_output(req: Req) -> ReqOutput:
    """The delta since the last output of `req`; advances its sent markers."""
    start = req.sent_output_len
    lp = req.return_logprob
    send_input = lp and req.input_logprobs_done and not req.input_logprobs_sent
    out = ReqOutput(
        rid=req.rid, new_output_ids=req.output_ids[start:], finish_reason=req.finished_reason,
        prompt_tokens=len(req.origin_input_ids), completion_tokens=len(req.output_ids),
        cached_tokens=req.cached_tokens, num_retractions=req.num_retractions,
        skip_special_tokens=req.sampling.skip_special_tokens,
        spaces_between_special_tokens=req.sampling.spaces_between_special_tokens,
        no_stop_trim=req.sampling.no_stop_trim,
        input_token_logprobs=req.input_token_logprobs if send_input else None,
        input_top_logprobs=req.input_top_logprobs if send_input and req.top_logprobs_num else None,
        input_token_ids_logprobs=req.input_token_ids_logprobs if send_input and req.token_ids_logprob else None,
        output_token_logprobs=req.output_token_logprobs[start:] if lp else None,
        output_top_logprobs=req.output_top_logprobs[start:] if lp and req.top_logprobs_num else None,
        output_token_ids_logprobs=req.output_token_ids_logprobs[start:] if lp and req.token_ids_logprob else None,
        extra_meta=req.extra_meta,
    )
    req.sent_output_len = len(req.output_ids)
    if send_input:
        req.input_logprobs_sent = True
    return out
