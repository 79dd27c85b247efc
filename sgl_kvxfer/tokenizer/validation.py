"""Every check on what a client sends, in one place, with one set of messages.

/generate (tokenizer/generate_input.py), /v1/completions and /v1/chat/completions
(server/openai_protocol.py), the offline Engine and the scheduler's last check all read client
values through this module, so a field has one rule and one message wherever it comes from:

    load_json(raw)              the body: strict JSON (no NaN / Infinity, finite numbers, no lone
                                UTF-16 surrogates, nesting <= LIMITS.max_json_depth, size bounded)
    read_int / read_float / ... one field's JSON type, with serde-style messages naming its path
    sampling_params(raw, ...)   the sampling knobs (types, ranges, vocabulary) -> SamplingParams
    check_prompt_ids, check_logprob_args, check_lengths
                                prompt ids, logprob arguments, lengths against the model

Two error kinds, because SGLang's /generate answers in two envelopes (server/errors.py):
ContractError (a JSON type, an unknown sampling key: 400 {"error": "<string>"}) and
RequestError (everything else: {"error": {"message"}} on /generate; OpenAI routes and the
offline Engine show both the same way). Every size a client controls is bounded by `LIMITS`.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any, Callable

from sgl_kvxfer.sampling.params import TOP_K_ALL, SamplingParams

I64 = (-(1 << 63), (1 << 63) - 1)
U64_MAX = (1 << 64) - 1
_SURROGATE = re.compile("[\ud800-\udfff]")
_DEFAULT_MAX_NEW = SamplingParams().max_new_tokens


@dataclass(frozen=True)
class RequestLimits:
    """Bounds on every size a client controls (docs/http_api.md, "Limits")."""
    max_body_bytes: int = 32 << 20
    max_json_depth: int = 32
    max_n: int = 128  # samples per prompt (OpenAI's bound)
    max_items: int = 4096  # prompts x n in one HTTP call
    max_top_logprobs: int = 256  # /generate top_logprobs_num (OpenAI routes: 20)
    max_openai_logprobs: int = 20
    max_token_ids_logprob: int = 1024
    max_stop_strings: int = 64
    max_stop_chars: int = 1024
    max_stop_token_ids: int = 1024
    max_logit_bias: int = 1024
    logit_bias_range: float = 100.0
    max_rid_chars: int = 256


LIMITS = RequestLimits()

# Keys SGLang 0.5.23 accepts inside `sampling_params`; anything else is a ContractError.
ALLOWED_KEYS = (
    "max_new_tokens", "min_new_tokens", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "n", "stop", "stop_token_ids",
    "stop_regex", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
    "no_stop_trim", "stream_interval", "json_schema", "regex", "ebnf", "structural_tag",
    "logit_bias", "sampling_seed", "custom_params", "beam_width", "watermark", "choice",
)
# Accepted for wire compatibility but not enforced here: a non-empty value is refused, never ignored.
UNSUPPORTED_KEYS = ("json_schema", "regex", "ebnf", "structural_tag", "stop_regex", "beam_width", "watermark",
                    "choice", "custom_params")


class RequestError(ValueError):
    """A client error (status 4xx unless set otherwise), rendered in the route's envelope."""

    def __init__(self, message: str, status_code: int = 400):
        super().__init__(message)
        self.status_code = status_code


class ContractError(RequestError):
    """A JSON type or schema violation; /generate renders it as a bare string."""


# ---------------------------------------------------------------- the body
def _no_constant(name: str):
    raise ValueError(f"{name} is not valid JSON (numbers must be finite)")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text} is out of range (numbers must be finite)")
    return value


def load_json(raw: bytes, limits: RequestLimits = LIMITS) -> Any:
    """Parse a request body strictly; RequestError (413 for size, else 400) on anything else."""
    if len(raw) > limits.max_body_bytes:
        raise RequestError(f"The request body ({len(raw)} bytes) exceeds the limit of {limits.max_body_bytes} "
                           "bytes.", 413)
    try:
        value = json.loads(raw or b"null", parse_constant=_no_constant, parse_float=_finite_float)
    except RecursionError:
        raise RequestError(f"JSON decode error: nested deeper than {limits.max_json_depth} levels") from None
    except ValueError as e:  # JSONDecodeError, invalid UTF-8, NaN, 1e400, > 4300-digit integers
        reason = "an integer has more than 4300 digits" if "integer string conversion" in str(e) else e
        raise RequestError(f"JSON decode error: {reason}") from None
    check_json_tree(value, limits)
    return value


def check_json_tree(value: Any, limits: RequestLimits = LIMITS) -> None:
    """Nesting depth and lone surrogates in every key and string (iterative: no recursion)."""
    stack = [(value, 1, "$")]
    while stack:
        node, depth, path = stack.pop()
        if depth > limits.max_json_depth:
            raise RequestError(f"JSON nested deeper than {limits.max_json_depth} levels at `{path}`")
        if isinstance(node, dict):
            for key, child in node.items():
                check_text(key, f"{path} key")
                if isinstance(child, (dict, list, str)):
                    stack.append((child, depth + 1, f"{path}.{key}"))
        elif isinstance(node, list):
            for i, child in enumerate(node):
                if isinstance(child, (dict, list, str)):
                    stack.append((child, depth + 1, f"{path}[{i}]"))
        elif isinstance(node, str):
            check_text(node, path)


def check_text(text: str, where: str) -> str:
    m = _SURROGATE.search(text)
    if m is not None:
        raise RequestError(f"the string at `{where}` holds a lone UTF-16 surrogate (U+{ord(m.group()):04X}); "
                           "send valid Unicode")
    return text


# ---------------------------------------------------------------- field types (serde-style)
def describe(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"boolean `{str(value).lower()}`"
    if isinstance(value, int):
        return f"integer `{value}`"
    if isinstance(value, float):
        return f"floating point `{value}`"
    if isinstance(value, str):
        return f'string "{value[:40]}{"..." if len(value) > 40 else ""}"'
    return "sequence" if isinstance(value, list) else "map"


def type_error(value, expected: str, where: str) -> ContractError:
    return ContractError(f"invalid type: {describe(value)}, expected {expected} at `{where}`")


def read_int(value, where: str, lo: int = I64[0], hi: int = I64[1]) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise type_error(value, "i64" if hi <= I64[1] else "u64", where)
    if not lo <= value <= hi:
        kind = "i64" if (lo, hi) == I64 else f"an integer in [{lo}, {hi}]"
        raise ContractError(f"invalid value: integer `{value}`, expected {kind} at `{where}`")
    return value


def read_float(value, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise type_error(value, "f64", where)
    value = float(value)
    if not math.isfinite(value):
        raise ContractError(f"invalid value: {value}, expected a finite f64 at `{where}`")
    return value


def read_bool(value, where: str) -> bool:
    if not isinstance(value, bool):
        raise type_error(value, "a boolean", where)
    return value


def read_str(value, where: str, max_chars: int | None = None) -> str:
    if not isinstance(value, str):
        raise type_error(value, "a string", where)
    if max_chars is not None and len(value) > max_chars:
        raise RequestError(f"`{where}` is {len(value)} characters long; the limit is {max_chars}")
    return check_text(value, where)


def read_ints(value, where: str, max_len: int | None = None) -> list[int]:
    if not isinstance(value, list):
        raise type_error(value, "a sequence of integers", where)
    if max_len is not None and len(value) > max_len:
        raise RequestError(f"`{where}` has {len(value)} entries; the limit is {max_len}")
    for i, v in enumerate(value):
        if type(v) is not int:  # noqa: E721 (bool is a subclass of int and is refused)
            raise type_error(v, "i64", f"{where}[{i}]")
    if value and not I64[0] <= min(value) <= max(value) <= I64[1]:
        bad = next(v for v in value if not I64[0] <= v <= I64[1])
        raise ContractError(f"invalid value: integer `{bad}`, expected i64 at `{where}`")
    return value


def check_token_ids(ids: list[int], vocab_size: int | None, where: str) -> None:
    """Every id in [0, vocab_size) (C loops: prompts are long)."""
    if ids and vocab_size and (min(ids) < 0 or max(ids) >= vocab_size):
        bad = next(t for t in ids if not 0 <= t < vocab_size)
        raise RequestError(f"`{where}` holds token id {bad}, outside the vocabulary [0, {vocab_size})")


# ---------------------------------------------------------------- sampling knobs
_INTS = ("max_new_tokens", "min_new_tokens", "top_k", "n", "stream_interval")
_FLOATS = ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty")
_BOOLS = ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim")


def _generate_label(key: str) -> str:
    return f"sampling_params.{key}"


def sampling_params(raw, vocab_size: int | None, label: Callable[[str], str] = _generate_label,
                    limits: RequestLimits = LIMITS) -> SamplingParams:
    """The sampling knobs of one request (SGLang names; null = default) -> SamplingParams.

    `label(key)` is how the client spelled the field (`sampling_params.top_p`, `max_tokens`, ...):
    every message names it."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise type_error(raw, "struct SamplingParams", "sampling_params")
    for key in raw:
        if key not in ALLOWED_KEYS:
            raise ContractError(f"unknown field `{key}`, expected one of " + ", ".join(f"`{k}`" for k in ALLOWED_KEYS))
    values: dict[str, Any] = {}
    for key, value in raw.items():
        if value is None:
            continue  # explicit null: the default
        where = label(key)
        if key in UNSUPPORTED_KEYS:
            if value not in ("", [], {}):
                raise RequestError(f"`{where}` is not supported by sgl_kvxfer (it would not be enforced)")
        elif key in _INTS:
            values[key] = read_int(value, where)
        elif key == "sampling_seed":
            values[key] = read_int(value, where, I64[0], U64_MAX)
        elif key in _FLOATS:
            values[key] = read_float(value, where)
        elif key in _BOOLS:
            values[key] = read_bool(value, where)
        elif key == "stop":
            values[key] = _read_stop(value, where, limits)
        elif key == "stop_token_ids":
            ids = read_ints(value, where, limits.max_stop_token_ids)
            check_token_ids(ids, vocab_size, where)
            values[key] = tuple(ids)
        elif key == "logit_bias":
            values[key] = _read_logit_bias(value, where, vocab_size, limits)
    _check_ranges(values, label, limits)
    return SamplingParams.from_dict(values)


def _read_stop(value, where: str, limits: RequestLimits) -> tuple[str, ...]:
    stops = value if isinstance(value, list) else [value]
    if len(stops) > limits.max_stop_strings:
        raise RequestError(f"`{where}` has {len(stops)} strings; the limit is {limits.max_stop_strings}")
    for i, s in enumerate(stops):
        at = f"{where}[{i}]" if isinstance(value, list) else where
        if not isinstance(s, str):
            raise type_error(s, "a string", at)
        read_str(s, at, limits.max_stop_chars)
        if not s:
            raise RequestError(f"`{at}` is an empty stop string (it would stop every request at once)")
    return tuple(stops)


def _read_logit_bias(value, where: str, vocab_size: int | None, limits: RequestLimits) -> dict[str, float]:
    if not isinstance(value, dict):
        raise type_error(value, "a map", where)
    if len(value) > limits.max_logit_bias:
        raise RequestError(f"`{where}` has {len(value)} entries; the limit is {limits.max_logit_bias}")
    bound = limits.logit_bias_range
    out = {}
    for token, bias in value.items():
        at = f"{where}.{token}"
        if not (token.isascii() and token.isdigit() and len(token) <= 12) or (vocab_size and int(token) >= vocab_size):
            below = f" below {vocab_size}" if vocab_size else ""
            raise RequestError(f"`{where}` key {token[:40]!r} is not a token id{below}")
        bias = read_float(bias, at)
        if not -bound <= bias <= bound:
            raise RequestError(f"`{at}` must be in [-{bound:g}, {bound:g}], got {bias}")
        out[str(int(token))] = bias
    return out


def _check_ranges(v: dict, label: Callable[[str], str], limits: RequestLimits) -> None:
    def bad(key: str, rule: str):
        raise RequestError(f"`{label(key)}` must be {rule}, got {v[key]}")

    if v.get("temperature", 0.0) < 0:
        bad("temperature", ">= 0")
    if not 0.0 < v.get("top_p", 1.0) <= 1.0:
        bad("top_p", "in (0, 1]")
    if not 0.0 <= v.get("min_p", 0.0) <= 1.0:
        bad("min_p", "in [0, 1]")
    top_k = v.get("top_k", 1)
    if top_k != -1 and not 1 <= top_k <= TOP_K_ALL:
        bad("top_k", f"-1 (all) or in [1, {TOP_K_ALL}]")
    for key in ("frequency_penalty", "presence_penalty"):
        if not -2.0 <= v.get(key, 0.0) <= 2.0:
            bad(key, "in [-2, 2]")
    if not 0.0 < v.get("repetition_penalty", 1.0) <= 2.0:
        bad("repetition_penalty", "in (0, 2]")
    if v.get("max_new_tokens", 0) < 0:
        bad("max_new_tokens", ">= 0")
    max_new = v.get("max_new_tokens", _DEFAULT_MAX_NEW)
    if not 0 <= v.get("min_new_tokens", 0) <= max_new:
        bad("min_new_tokens", f"in [0, max_new_tokens={max_new}]")
    if not 1 <= v.get("n", 1) <= limits.max_n:
        bad("n", f"in [1, {limits.max_n}]")
    if v.get("stream_interval", 1) < 1:
        bad("stream_interval", ">= 1")


# ---------------------------------------------------------------- logprobs, prompt, lengths
def check_logprob_args(top_logprobs_num: int, token_ids_logprob: list[int] | None, logprob_start_len: int,
                       vocab_size: int | None, limits: RequestLimits = LIMITS, top_name: str = "top_logprobs_num",
                       max_top: int | None = None) -> None:
    """Types are the caller's (read_int / read_ints); ranges and the vocabulary here."""
    top_max = min(max_top or limits.max_top_logprobs, vocab_size or TOP_K_ALL)
    if not 0 <= top_logprobs_num <= top_max:
        raise RequestError(f"`{top_name}` must be in [0, {top_max}], got {top_logprobs_num}")
    if token_ids_logprob is not None:
        if len(token_ids_logprob) > limits.max_token_ids_logprob:
            raise RequestError(f"`token_ids_logprob` has {len(token_ids_logprob)} ids; the limit is "
                               f"{limits.max_token_ids_logprob}")
        check_token_ids(token_ids_logprob, vocab_size, "token_ids_logprob")
    if logprob_start_len < -1:
        raise RequestError(f"`logprob_start_len` must be -1 (no prompt logprobs) or >= 0, got {logprob_start_len}")


def check_prompt_ids(ids: list[int], vocab_size: int | None, where: str = "input_ids") -> None:
    if not ids:
        raise RequestError(f"`{where}` cannot be empty.")
    check_token_ids(ids, vocab_size, where)


def check_lengths(prompt_len: int, max_new_tokens: int, max_new_given: bool, context_len: int,
                  max_req_input_len: int = 0, pool_tokens: int = 0, logprob_start_len: int = -1,
                  return_logprob: bool = False) -> None:
    """A prompt of `prompt_len` tokens asking for `max_new_tokens` against the model (context) and
    the server (input limit, KV pool). `max_new_given`: the client set max_new_tokens (a default
    that overflows is clipped by the context instead)."""
    n = prompt_len
    if n == 0:
        raise RequestError("The input is empty: provide a non-empty text or input_ids.")
    if context_len and n >= context_len:
        raise RequestError(f"The input ({n} tokens) is longer than the model's context length ({context_len} tokens).")
    if max_req_input_len and n > max_req_input_len:
        raise RequestError(f"The input ({n} tokens) is longer than the server's limit of {max_req_input_len} tokens.")
    if max_new_given and context_len and max_new_tokens + n > context_len:
        raise RequestError(
            f"Requested token count exceeds the model's maximum context length of {context_len} tokens. "
            f"You requested a total of {max_new_tokens + n} tokens: {n} tokens from the input messages and "
            f"{max_new_tokens} tokens for the completion. Please reduce the number of tokens in the input "
            f"messages or the completion to fit within the limit.")
    total = n + max_new_tokens
    if pool_tokens and total > pool_tokens:
        raise RequestError(f"The request needs {total} KV slots but the KV pool holds only {pool_tokens}.")
    if return_logprob and logprob_start_len >= n:
        raise RequestError(f"`logprob_start_len` ({logprob_start_len}) is not below the prompt length ({n}).")


def check_item_count(prompts: int, n: int, limits: RequestLimits = LIMITS) -> None:
    if prompts * n > limits.max_items:
        raise RequestError(f"{prompts} prompts x n={n} make {prompts * n} requests in one call; the limit is "
                           f"{limits.max_items}")


def check_tokenized(msg, vocab_size: int, context_len: int, pool_tokens: int) -> str | None:
    """The scheduler's (and the offline Engine's) last check of one tokenized request
    (message.TokenizedGenerateReq): every id against the vocabulary (prompt, stop ids, logit
    bias keys, logprob ids), logprob sizes, and the lengths against the context and the KV pool
    (max_new_tokens counts as given). The message, or None when the request may run."""
    p = msg.sampling
    try:
        check_prompt_ids(msg.input_ids, vocab_size)
        check_token_ids(list(p.stop_token_ids), vocab_size, "stop_token_ids")
        if p.logit_bias:
            check_token_ids([int(t) for t in p.logit_bias], vocab_size, "logit_bias")
        check_logprob_args(msg.top_logprobs_num, msg.token_ids_logprob, msg.logprob_start_len, vocab_size)
        check_lengths(len(msg.input_ids), p.max_new_tokens, True, context_len, 0, pool_tokens,
                      msg.logprob_start_len, msg.return_logprob)
    except (RequestError, ValueError) as e:
        return str(e)
    return None
