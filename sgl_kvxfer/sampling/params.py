"""Sampling parameters: SGLang's closed schema, defaults and validation.

`SamplingParams` is a msgspec Struct so it crosses process boundaries as-is (see `message/`).
`from_dict` is the single entry point from user JSON; it raises `SamplingParamsError` whose
message names the offending key, and the HTTP layer turns it into a 400.
"""
from __future__ import annotations

import math
from typing import Any

import msgspec

TOP_K_ALL = 1 << 30

# Keys SGLang 0.5.23 accepts inside `sampling_params`; anything else is a 400.
ALLOWED_KEYS = (
    "max_new_tokens", "min_new_tokens", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "n", "stop", "stop_token_ids",
    "stop_regex", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
    "no_stop_trim", "stream_interval", "json_schema", "regex", "ebnf", "structural_tag",
    "logit_bias", "sampling_seed", "custom_params", "beam_width", "watermark", "choice",
)
# Accepted for wire compatibility, but not implemented: a non-empty value is rejected.
UNSUPPORTED_KEYS = ("json_schema", "regex", "ebnf", "structural_tag", "stop_regex", "beam_width", "watermark", "choice")


class SamplingParamsError(ValueError):
    """A sampling parameter is unknown, mistyped or out of range (HTTP 400)."""


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
    def from_dict(cls, raw: dict[str, Any] | None, vocab_size: int | None = None) -> "SamplingParams":
        raw = dict(raw or {})
        unknown = [k for k in raw if k not in ALLOWED_KEYS]
        if unknown:
            raise SamplingParamsError(
                f"unknown field `{unknown[0]}` in sampling_params, expected one of "
                + ", ".join(f"`{k}`" for k in ALLOWED_KEYS)
            )
        for key in UNSUPPORTED_KEYS:
            if raw.get(key) not in (None, "", [], {}):
                raise SamplingParamsError(f"sampling_params.{key} is not supported by sgl_kvxfer")
        values: dict[str, Any] = {}
        for key, value in raw.items():
            if value is None or key in UNSUPPORTED_KEYS or key == "custom_params":
                continue  # explicit null means "use the default"
            values[key] = value
        _check_types(values)
        if isinstance(values.get("stop"), str):
            values["stop"] = (values["stop"],)
        for key in ("stop", "stop_token_ids"):
            if key in values:
                values[key] = tuple(values[key])
        if values.get("top_k", 0) == -1:
            values["top_k"] = TOP_K_ALL
        params = cls(**values)
        return params._normalized()._validated(vocab_size)

    def _normalized(self) -> "SamplingParams":
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise SamplingParamsError(f"temperature must be finite and >= 0, got {self.temperature}")
        if self.temperature < 1e-6:  # greedy: SGLang pins top_k to 1
            return msgspec.structs.replace(self, temperature=1.0, top_k=1)
        return self

    def _validated(self, vocab_size: int | None) -> "SamplingParams":
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise SamplingParamsError(f"temperature must be finite and >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingParamsError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise SamplingParamsError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.top_k < 1:
            raise SamplingParamsError(f"top_k must be -1 or >= 1, got {self.top_k}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise SamplingParamsError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise SamplingParamsError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if self.max_new_tokens < 0:
            raise SamplingParamsError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.min_new_tokens < 0 or self.min_new_tokens > self.max_new_tokens:
            raise SamplingParamsError(
                f"min_new_tokens must be in [0, max_new_tokens={self.max_new_tokens}], got {self.min_new_tokens}"
            )
        if self.n < 1:
            raise SamplingParamsError(f"n must be >= 1, got {self.n}")
        if self.stream_interval is not None and self.stream_interval < 1:
            raise SamplingParamsError(f"stream_interval must be >= 1, got {self.stream_interval}")
        if self.logit_bias and vocab_size is not None:
            for token in self.logit_bias:
                if not str(token).lstrip("-").isdigit() or not 0 <= int(token) < vocab_size:
                    raise SamplingParamsError(f"logit_bias key {token!r} is not a token id below {vocab_size}")
        return self


_TYPES = {
    "max_new_tokens": int, "min_new_tokens": int, "temperature": (int, float), "top_p": (int, float),
    "top_k": int, "min_p": (int, float), "frequency_penalty": (int, float), "presence_penalty": (int, float),
    "repetition_penalty": (int, float), "n": int, "ignore_eos": bool, "skip_special_tokens": bool,
    "spaces_between_special_tokens": bool, "no_stop_trim": bool, "stream_interval": int,
    "sampling_seed": int, "logit_bias": dict,
}


def _check_types(values: dict[str, Any]) -> None:
    for key, value in values.items():
        expected = _TYPES.get(key)
        if expected is not None:
            bad_bool = isinstance(value, bool) and expected is not bool and bool not in _as_tuple(expected)
            if bad_bool or not isinstance(value, expected):
                raise SamplingParamsError(
                    f"invalid type for sampling_params.{key}: {type(value).__name__} {value!r}"
                )
    stop = values.get("stop")
    if stop is not None and not (isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(s, str) for s in stop))):
        raise SamplingParamsError(f"sampling_params.stop must be a string or a list of strings, got {stop!r}")
    ids = values.get("stop_token_ids")
    if ids is not None and not (isinstance(ids, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in ids)):
        raise SamplingParamsError(f"sampling_params.stop_token_ids must be a list of ints, got {ids!r}")


def _as_tuple(t):
    return t if isinstance(t, tuple) else (t,)
