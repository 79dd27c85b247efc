"""`/generate` request parsing: SGLang's schema contract, then batch and `n` expansion.

Two error kinds, because SGLang clients see two envelopes (spec 1.1):
  ContractError -> 400 {"error": "<string>"}          wrong JSON type, unknown sampling key
  RequestError  -> 4xx {"error": {"message": ...}}     semantic problems (ranges, lengths, ...)

Unknown top-level keys are ignored; `null` means unset. Output order is prompt-major, then
sample: [p0s0, p0s1, ..., p1s0, ...].
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass

import msgspec

from sgl_kvxfer.message.disagg import BootstrapInfo
from sgl_kvxfer.sampling.params import ALLOWED_KEYS, SamplingParams, SamplingParamsError

I64 = (-(1 << 63), (1 << 63) - 1)


class ContractError(ValueError):
    """Schema violation; rendered as a bare string (serde-style message)."""


class RequestError(ValueError):
    def __init__(self, message: str, status_code: int = 400):
        super().__init__(message)
        self.status_code = status_code


@dataclass
class GenerateItem:
    rid: str
    text: str | None
    input_ids: list[int] | None
    sampling: SamplingParams
    max_new_tokens_given: bool
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    token_ids_logprob: list[int] | None = None
    return_text_in_logprobs: bool = False
    bootstrap: BootstrapInfo | None = None  # PD: the router's bootstrap_host / port / room


@dataclass
class GenerateRequest:
    items: list[GenerateItem]
    is_batch: bool  # reply is a JSON list (stream chunks carry "index")
    stream: bool
    return_prompt_token_ids: bool


# ---------------------------------------------------------------- serde-style type checks
def _describe(value) -> str:
    if isinstance(value, bool):
        return f"boolean `{str(value).lower()}`"
    if isinstance(value, int):
        return f"integer `{value}`"
    if isinstance(value, float):
        return f"floating point `{value}`"
    if isinstance(value, str):
        return f'string "{value}"'
    return "sequence" if isinstance(value, list) else "map"


def _bad(value, expected: str, where: str):
    return ContractError(f"invalid type: {_describe(value)}, expected {expected} at `{where}`")


def _int(value, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(value, "i64", where)
    if not I64[0] <= value <= I64[1]:
        raise ContractError(f"invalid value: integer `{value}`, expected i64 at `{where}`")
    return value


def _float(value, where: str):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad(value, "f64", where)
    return value


def _bool(value, where: str) -> bool:
    if not isinstance(value, bool):
        raise _bad(value, "a boolean", where)
    return value


def _str(value, where: str) -> str:
    if not isinstance(value, str):
        raise _bad(value, "a string", where)
    return value


def _str_or_strs(value, where: str):
    if isinstance(value, list):
        return [_str(v, where) for v in value]
    return _str(value, where)


def _ints(value, where: str) -> list[int]:
    if not isinstance(value, list):
        raise _bad(value, "a sequence of integers", where)
    return [_int(v, where) for v in value]


_SAMPLING_TYPES = {
    **{k: _int for k in ("max_new_tokens", "min_new_tokens", "top_k", "n", "stream_interval", "sampling_seed", "beam_width")},
    **{k: _float for k in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty")},
    **{k: _bool for k in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim")},
    "stop": _str_or_strs, "stop_regex": _str_or_strs, "stop_token_ids": _ints,
    "json_schema": _str, "regex": _str, "ebnf": _str,
}


def _check_sampling(raw) -> dict:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise _bad(raw, "struct SamplingParams", "sampling_params")
    for key, value in raw.items():
        if key not in ALLOWED_KEYS:
            expected = ", ".join(f"`{k}`" for k in ALLOWED_KEYS)
            raise ContractError(f"unknown field `{key}`, expected one of {expected}")
        if value is not None and key in _SAMPLING_TYPES:
            _SAMPLING_TYPES[key](value, f"sampling_params.{key}")
        if key == "logit_bias" and value is not None:
            if not isinstance(value, dict):
                raise _bad(value, "a map", "sampling_params.logit_bias")
            for v in value.values():
                _float(v, "sampling_params.logit_bias")
    return raw


def _per_item(body: dict, key: str, count: int, check, default):
    """Scalar broadcast or per-item list (len == count)."""
    value = body.get(key)
    if value is None:
        return [default] * count
    if isinstance(value, list) and key != "token_ids_logprob":
        if len(value) != count:
            raise RequestError(f"`{key}` has {len(value)} entries for a batch of {count}")
        return [default if v is None else check(v, key) for v in value]
    return [check(value, key)] * count


def parse_bootstrap(body: dict, count: int) -> list[BootstrapInfo | None]:
    """The router's PD fields for `count` items: each scalar or a per-item list; a scalar room
    for several items expands to room + i (SGLang). No host and no room: not a PD request."""
    def per_item(key, check):
        value = body.get(key)
        if isinstance(value, list):
            if len(value) != count:
                raise RequestError(f"`{key}` has {len(value)} entries for a batch of {count}")
            return [None if v is None else check(v, key) for v in value]
        if value is None:
            return [None] * count
        value = check(value, key)
        return [value + i for i in range(count)] if key == "bootstrap_room" else [value] * count

    hosts, ports, rooms = (per_item("bootstrap_host", _str), per_item("bootstrap_port", _int),
                           per_item("bootstrap_room", _int))
    return [None if h is None and r is None else BootstrapInfo(h or "", p, r)
            for h, p, r in zip(hosts, ports, rooms)]


def make_sampling_params(raw: dict | None, vocab_size: int | None) -> SamplingParams:
    """SamplingParams.from_dict plus the range checks that must see the raw values (a negative
    temperature would otherwise be normalized to greedy)."""
    temperature = (raw or {}).get("temperature")
    if isinstance(temperature, (int, float)) and not temperature >= 0:
        raise RequestError(f"temperature must be finite and >= 0, got {temperature}")
    try:
        return SamplingParams.from_dict(raw, vocab_size)
    except SamplingParamsError as e:
        raise RequestError(str(e)) from None


def parse_generate_request(body, vocab_size: int | None = None) -> GenerateRequest:
    if not isinstance(body, dict):
        raise _bad(body, "struct GenerateRequest", "$")
    text, input_ids = body.get("text"), body.get("input_ids")
    if body.get("input_embeds") is not None and text is None and input_ids is None:
        raise RequestError("input_embeds is not supported by sgl_kvxfer")
    if text is not None:
        prompts = [_str(t, "text") for t in text] if isinstance(text, list) else [_str(text, "text")]
        batch, as_ids = isinstance(text, list), False
    elif input_ids is not None:
        if not isinstance(input_ids, list):
            raise _bad(input_ids, "a sequence", "input_ids")
        batch = bool(input_ids) and isinstance(input_ids[0], list)
        prompts = [_ints(p, "input_ids") for p in input_ids] if batch else [_ints(input_ids, "input_ids")]
        as_ids = True
    else:
        raise RequestError("Either text, input_ids or input_embeds should be provided.")
    if not prompts:
        raise RequestError("The batch is empty: give at least one prompt.")
    if as_ids and any(not p for p in prompts):
        raise RequestError("input_ids cannot be empty.")
    count = len(prompts)

    raw_sampling = body.get("sampling_params")
    if isinstance(raw_sampling, list):
        if len(raw_sampling) != count:
            raise RequestError(f"sampling_params has {len(raw_sampling)} entries for a batch of {count}")
        raws = [_check_sampling(s) for s in raw_sampling]
    else:
        raws = [_check_sampling(raw_sampling)] * count
    params = [make_sampling_params(r, vocab_size) for r in raws]
    n = params[0].n
    if any(p.n != n for p in params):
        raise RequestError("All sampling_params in a batch must have the same n.")
    if n > 1:  # the expansion happens here; the scheduler sees n independent requests
        params = [msgspec.structs.replace(p, n=1) for p in params]

    rids = body.get("rid")
    if rids is None:
        rids = [None] * count
    elif isinstance(rids, list):
        rids = [_str(r, "rid") for r in rids]
        if len(rids) != count:
            raise RequestError(f"rid has {len(rids)} entries for a batch of {count}")
        if len(set(rids)) != len(rids):
            raise RequestError("Duplicate request ids in one batch.")
    else:
        rids = [_str(rids, "rid")] + [None] * (count - 1) if count == 1 else None
        if rids is None:
            raise RequestError("A batch needs rid to be a list with one id per prompt.")

    return_logprob = _per_item(body, "return_logprob", count, _bool, False)
    start_len = _per_item(body, "logprob_start_len", count, _int, -1)
    top_num = _per_item(body, "top_logprobs_num", count, _int, 0)
    tid = body.get("token_ids_logprob")
    if tid is None:
        tids = [None] * count
    elif tid and isinstance(tid[0], list):
        tids = [_ints(t, "token_ids_logprob") for t in tid]
        if len(tids) != count:
            raise RequestError(f"token_ids_logprob has {len(tids)} entries for a batch of {count}")
    else:
        tids = [_ints(tid, "token_ids_logprob")] * count
    with_text = body.get("return_text_in_logprobs")
    with_text = False if with_text is None else _bool(with_text, "return_text_in_logprobs")
    stream = body.get("stream")
    stream = False if stream is None else _bool(stream, "stream")
    prompt_ids = body.get("return_prompt_token_ids")
    prompt_ids = False if prompt_ids is None else _bool(prompt_ids, "return_prompt_token_ids")

    boot = parse_bootstrap(body, count * n)
    items = []
    for i, prompt in enumerate(prompts):
        if top_num[i] < 0:
            raise RequestError(f"top_logprobs_num must be >= 0, got {top_num[i]}")
        for j in range(n):
            rid = rids[i] if (n == 1 and rids[i] is not None) else uuid.uuid4().hex
            items.append(GenerateItem(
                rid=rid, text=None if as_ids else prompt, input_ids=prompt if as_ids else None,
                sampling=params[i], max_new_tokens_given=(raws[i] or {}).get("max_new_tokens") is not None,
                return_logprob=return_logprob[i], logprob_start_len=start_len[i], top_logprobs_num=top_num[i],
                token_ids_logprob=tids[i], return_text_in_logprobs=with_text, bootstrap=boot[i * n + j],
            ))
    return GenerateRequest(items=items, is_batch=batch or n > 1, stream=stream, return_prompt_token_ids=prompt_ids)
