"""Per-request accumulation of scheduler deltas into SGLang's reply shape.

Pure Python (no asyncio, no zmq): the HTTP tokenizer manager and the offline `Engine` both use it.

`ReqOutput` carries deltas (new ids, new logprob entries); this class owns the cumulative view
that SGLang clients expect in every reply and stream chunk:

    {"text", "output_ids", "meta_info": {id, finish_reason, prompt_tokens, completion_tokens,
     cached_tokens, reasoning_tokens, weight_version, num_retractions, [logprob fields],
     [e2e_latency once finished]}}

Logprob entries arrive as [logprob|None, token_id] and leave as [logprob|None, token_id, text|None].
"""
from __future__ import annotations

from sgl_kvxfer.message import ReqOutput


class RequestOutputState:
    def __init__(self, rid: str, tokenizer, return_logprob: bool, return_text_in_logprobs: bool,
                 top_logprobs_num: int, token_ids_logprob):
        self.rid = rid
        self._tokenizer = tokenizer
        self.return_logprob = return_logprob
        self._with_text = bool(return_text_in_logprobs) and tokenizer is not None
        self.top_logprobs_num = top_logprobs_num or 0
        self.token_ids_logprob = token_ids_logprob
        self._token_text: dict[int, str] = {}

        self.text = ""
        self.output_ids: list[int] = []
        self.finish_reason: dict | None = None
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.num_retractions = 0
        self.extra_meta: dict = {}
        self.logprobs: dict[str, list] = {
            "input_token_logprobs": [], "output_token_logprobs": [],
            "input_top_logprobs": [], "output_top_logprobs": [],
            "input_token_ids_logprobs": [], "output_token_ids_logprobs": [],
        }

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, out: ReqOutput, text: str) -> None:
        """Fold one delta in. `text` is the detokenizer's cumulative text for this rid."""
        self.text = text
        self.output_ids.extend(out.new_output_ids)
        if out.finish_reason is not None:
            self.finish_reason = out.finish_reason
        self.prompt_tokens = out.prompt_tokens
        self.completion_tokens = out.completion_tokens
        self.cached_tokens = out.cached_tokens
        self.num_retractions = out.num_retractions
        if out.extra_meta:
            self.extra_meta.update(out.extra_meta)
        if not self.return_logprob:
            return
        for key in ("input_token_logprobs", "output_token_logprobs"):
            delta = getattr(out, key)
            if delta:
                self.logprobs[key].extend(self._entry(e) for e in delta)
        for key in ("input_top_logprobs", "output_top_logprobs", "input_token_ids_logprobs", "output_token_ids_logprobs"):
            delta = getattr(out, key)
            if delta:
                self.logprobs[key].extend(self._position(p) for p in delta)

    def _text_of(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id])
            self._token_text[token_id] = text
        return text

    def _entry(self, entry) -> list:
        logprob, token_id = entry[0], entry[1]
        return [logprob, token_id, self._text_of(token_id) if self._with_text else None]

    def _position(self, pos):
        return None if pos is None else [self._entry(e) for e in pos]

    def to_dict(self, e2e_latency: float | None = None) -> dict:
        """A fresh dict (lists copied), safe to keep after further `add` calls."""
        meta = {
            "id": self.rid,
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens,
            "weight_version": "default",
            "num_retractions": self.num_retractions,
        }
        if self.return_logprob:
            lp = self.logprobs
            meta["input_token_logprobs"] = list(lp["input_token_logprobs"])
            meta["output_token_logprobs"] = list(lp["output_token_logprobs"])
            meta["output_token_logprobs_length"] = len(lp["output_token_logprobs"])
            if self.top_logprobs_num > 0:
                meta["input_top_logprobs"] = list(lp["input_top_logprobs"])
                meta["output_top_logprobs"] = list(lp["output_top_logprobs"])
            if self.token_ids_logprob is not None:
                meta["input_token_ids_logprobs"] = list(lp["input_token_ids_logprobs"])
                meta["output_token_ids_logprobs"] = list(lp["output_token_ids_logprobs"])
        meta["reasoning_tokens"] = 0
        meta["completion_tokens"] = self.completion_tokens
        meta["cached_tokens"] = self.cached_tokens
        meta.update(self.extra_meta)
        if self.finished and e2e_latency is not None:
            meta["e2e_latency"] = e2e_latency
        return {"text": self.text, "output_ids": list(self.output_ids), "meta_info": meta}
