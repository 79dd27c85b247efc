"""`/generate` request parsing: SGLang's body shape, then batch and `n` expansion.

Every field's rule and message is in `validation.py`; this module knows where each field sits
in a /generate body and how a batch fans out. Unknown top-level keys are ignored; `null` means
unset. Output order is prompt-major, then sample: [p0s0, p0s1, ..., p1s0, ...].
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass

import msgspec

from sgl_kvxfer.message.disagg import BootstrapInfo
from sgl_kvxfer.sampling.params import SamplingParams
from sgl_kvxfer.tokenizer.validation import (LIMITS, ContractError, RequestError, check_item_count,  # noqa: F401
                                             check_logprob_args, check_prompt_ids, read_bool, read_int, read_ints,
                                             read_str, sampling_params, type_error)


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


def _per_item(body: dict, key: str, count: int, check, default):
    """Scalar broadcast or per-item list (len == count)."""
    value = body.get(key)
    if value is None:
        return [default] * count
    if isinstance(value, list):
        if len(value) != count:
            raise RequestError(f"`{key}` has {len(value)} entries for a batch of {count}")
        return [default if v is None else check(v, key) for v in value]
    return [check(value, key)] * count


def _flag(body: dict, key: str) -> bool:
    value = body.get(key)
    return False if value is None else read_bool(value, key)


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

    hosts = per_item("bootstrap_host", lambda v, k: read_str(v, k, 253))
    ports = per_item("bootstrap_port", lambda v, k: read_int(v, k, 1, 65535))
    rooms = per_item("bootstrap_room", lambda v, k: read_int(v, k, 0, (1 << 63) - 1 - count))
    return [None if h is None and r is None else BootstrapInfo(h or "", p, r)
            for h, p, r in zip(hosts, ports, rooms)]


def _prompts(body: dict, vocab_size: int | None) -> tuple[list, bool, bool]:
    """(prompts, is_batch, as_ids): `text` (str or list) or `input_ids` (ids or list of ids)."""
    text, input_ids = body.get("text"), body.get("input_ids")
    if text is not None and input_ids is not None:
        raise RequestError("Give either `text` or `input_ids`, not both.")
    if body.get("input_embeds") is not None:
        raise RequestError("input_embeds is not supported by sgl_kvxfer")
    if text is not None:
        if isinstance(text, list):
            return [read_str(t, f"text[{i}]") for i, t in enumerate(text)], True, False
        return [read_str(text, "text")], False, False
    if input_ids is None:
        raise RequestError("Either text, input_ids or input_embeds should be provided.")
    if not isinstance(input_ids, list):
        raise type_error(input_ids, "a sequence", "input_ids")
    batch = bool(input_ids) and isinstance(input_ids[0], list)
    prompts = [read_ints(p, f"input_ids[{i}]") for i, p in enumerate(input_ids)] if batch \
        else [read_ints(input_ids, "input_ids")]
    for i, p in enumerate(prompts):
        check_prompt_ids(p, vocab_size, f"input_ids[{i}]" if batch else "input_ids")
    return prompts, batch, True


def _rids(body: dict, count: int) -> list[str | None]:
    rids = body.get("rid")
    if rids is None:
        return [None] * count
    if isinstance(rids, list):
        rids = [read_str(r, f"rid[{i}]", LIMITS.max_rid_chars) for i, r in enumerate(rids)]
        if len(rids) != count:
            raise RequestError(f"rid has {len(rids)} entries for a batch of {count}")
        if len(set(rids)) != len(rids):
            raise RequestError("Duplicate request ids in one batch.")
        return rids
    if count != 1:
        raise RequestError("A batch needs rid to be a list with one id per prompt.")
    return [read_str(rids, "rid", LIMITS.max_rid_chars)]


def parse_generate_request(body, vocab_size: int | None = None) -> GenerateRequest:
    if not isinstance(body, dict):
        raise type_error(body, "struct GenerateRequest", "$")
    prompts, batch, as_ids = _prompts(body, vocab_size)
    if not prompts:
        raise RequestError("The batch is empty: give at least one prompt.")
    count = len(prompts)

    raw_sampling = body.get("sampling_params")
    if isinstance(raw_sampling, list):
        if len(raw_sampling) != count:
            raise RequestError(f"sampling_params has {len(raw_sampling)} entries for a batch of {count}")
        raws = raw_sampling
    else:
        raws = [raw_sampling] * count
    parsed: dict[int, SamplingParams] = {}  # one check per distinct dict (a batch often shares one)
    for r in raws:
        if id(r) not in parsed:
            parsed[id(r)] = sampling_params(r, vocab_size)
    params = [parsed[id(r)] for r in raws]
    n = params[0].n
    if any(p.n != n for p in params):
        raise RequestError("All sampling_params in a batch must have the same n.")
    check_item_count(count, n)
    if n > 1:  # the expansion happens here; the scheduler sees n independent requests
        params = [msgspec.structs.replace(p, n=1) for p in params]
    rids = _rids(body, count)

    return_logprob = _per_item(body, "return_logprob", count, read_bool, False)
    start_len = _per_item(body, "logprob_start_len", count, read_int, -1)
    top_num = _per_item(body, "top_logprobs_num", count, read_int, 0)
    tid = body.get("token_ids_logprob")
    if tid is None:
        tids = [None] * count
    elif isinstance(tid, list) and tid and isinstance(tid[0], list):
        tids = [read_ints(t, f"token_ids_logprob[{i}]") for i, t in enumerate(tid)]
        if len(tids) != count:
            raise RequestError(f"token_ids_logprob has {len(tids)} entries for a batch of {count}")
    else:
        tids = [read_ints(tid, "token_ids_logprob")] * count
    for i in range(count):
        check_logprob_args(top_num[i], tids[i], start_len[i], vocab_size)
    with_text = _flag(body, "return_text_in_logprobs")
    stream = _flag(body, "stream")
    prompt_ids = _flag(body, "return_prompt_token_ids")

    boot = parse_bootstrap(body, count * n)
    items = []
    for i, prompt in enumerate(prompts):
        given = isinstance(raws[i], dict) and raws[i].get("max_new_tokens") is not None
        for j in range(n):
            rid = rids[i] if (n == 1 and rids[i] is not None) else uuid.uuid4().hex
            items.append(GenerateItem(
                rid=rid, text=None if as_ids else prompt, input_ids=prompt if as_ids else None,
                sampling=params[i], max_new_tokens_given=given,
                return_logprob=return_logprob[i], logprob_start_len=start_len[i], top_logprobs_num=top_num[i],
                token_ids_logprob=tids[i], return_text_in_logprobs=with_text, bootstrap=boot[i * n + j],
            ))
    return GenerateRequest(items=items, is_batch=batch or n > 1, stream=stream, return_prompt_token_ids=prompt_ids)
