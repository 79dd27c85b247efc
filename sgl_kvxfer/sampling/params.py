"""Sampling parameters: SGLang's knobs with their defaults, as one immutable struct.

`SamplingParams` is a msgspec Struct so it crosses process boundaries as-is (see `message/`).
It trusts its values: what a client sends is checked first by `tokenizer/validation.py`
(`sampling_params`), which builds it through `from_dict`. Internal callers (the int4 probe,
benchmarks, tests) call `from_dict` directly with values they control.
"""
from __future__ import annotations

from typing import Any

import msgspec

TOP_K_ALL = 1 << 30


class SamplingParams(msgspec.Struct, frozen=True):
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = TOP_K_ALL
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    n: int = 1
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    stream_interval: int | None = None
    logit_bias: dict[str, float] | None = None
    sampling_seed: int | None = None

    @property
    def is_greedy(self) -> bool:
        return self.top_k == 1

    @property
    def has_logit_processors(self) -> bool:
        """True when logits need more than a plain sample (penalties or bias)."""
        return bool(self.logit_bias or self.repetition_penalty != 1.0 or self.frequency_penalty
                    or self.presence_penalty)

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None) -> "SamplingParams":
        """Build from checked values (null = default), normalized as SGLang does: a stop string
        becomes a one-element tuple, top_k -1 means all, temperature ~0 means greedy (top_k 1)."""
        values = {k: v for k, v in (raw or {}).items() if v is not None}
        if isinstance(values.get("stop"), str):
            values["stop"] = (values["stop"],)
        for key in ("stop", "stop_token_ids"):
            if key in values:
                values[key] = tuple(values[key])
        if values.get("top_k") == -1:
            values["top_k"] = TOP_K_ALL
        params = cls(**values)
        if params.temperature < 1e-6:  # greedy: SGLang pins top_k to 1
            return msgspec.structs.replace(params, temperature=1.0, top_k=1)
        return params
