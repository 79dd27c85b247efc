"""OpenAI request bodies -> typed requests, every field read through `tokenizer/validation.py`
(the same rules and messages as /generate; errors become 400 ErrorResponse objects). Unknown
top-level keys are ignored, as in SGLang; fields we cannot honour are refused, never ignored
(`response_format` other than text, tools, `suffix`, `best_of` other than n, grammars)."""
from __future__ import annotations

from dataclasses import dataclass, field

from sgl_kvxfer.sampling.params import SamplingParams
from sgl_kvxfer.tokenizer.validation import (LIMITS, RequestError, check_token_ids, read_bool, read_int, read_ints,
                                             read_str, sampling_params, type_error)

# OpenAI (and SGLang-extra) body field -> SGLang sampling knob; max_tokens is read per route
SAMPLING_FIELDS = {
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "n": "n",
    "frequency_penalty": "frequency_penalty", "presence_penalty": "presence_penalty",
    "repetition_penalty": "repetition_penalty", "stop": "stop", "stop_token_ids": "stop_token_ids",
    "ignore_eos": "ignore_eos", "skip_special_tokens": "skip_special_tokens", "no_stop_trim": "no_stop_trim",
    "spaces_between_special_tokens": "spaces_between_special_tokens", "logit_bias": "logit_bias",
    "seed": "sampling_seed", "min_tokens": "min_new_tokens", "regex": "regex", "json_schema": "json_schema",
    "ebnf": "ebnf",
}
_LABEL = {knob: name for name, knob in SAMPLING_FIELDS.items()} | {"max_new_tokens": "max_tokens"}
CHAT_ROLES = ("system", "user", "assistant", "tool", "developer", "function")


@dataclass
class OpenAIRequest:
    model: str
    sampling: SamplingParams  # n == the request's n (expanded by the route)
    stream: bool
    include_usage: bool
    extra: dict = field(default_factory=dict)  # the body (PD bootstrap fields live at top level)

    @property
    def n(self) -> int:
        return self.sampling.n


@dataclass
class CompletionRequest(OpenAIRequest):
    prompts: list = field(default_factory=list)  # str or list[int] each
    logprobs: int | None = None
    echo: bool = False


@dataclass
class ChatCompletionRequest(OpenAIRequest):
    messages: list[dict] = field(default_factory=list)  # [{"role", "content": str}]
    max_new_given: bool = False
    logprobs: bool = False
    top_logprobs: int = 0


def _opt(body: dict, key: str, read, *args, at: str = ""):
    value = body.get(key)
    return None if value is None else read(value, at + key, *args)


def _common(body, vocab_size: int | None, max_tokens: int | None, max_name: str) -> dict:
    if not isinstance(body, dict):
        raise type_error(body, "an object", "$")
    raw = {knob: body.get(name) for name, knob in SAMPLING_FIELDS.items()}
    raw["max_new_tokens"] = max_tokens
    label = (lambda k: max_name if k == "max_new_tokens" else _LABEL.get(k, k))
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise type_error(opts, "struct StreamOptions", "stream_options")
    include_usage = bool(opts is not None and _opt(opts, "include_usage", read_bool, at="stream_options."))
    if opts is not None:
        _opt(opts, "continuous_usage_stats", read_bool, at="stream_options.")
    _opt(body, "user", read_str, 256)
    return {"model": _opt(body, "model", read_str, 256) or "default",
            "sampling": sampling_params(raw, vocab_size, label), "stream": bool(_opt(body, "stream", read_bool)),
            "include_usage": include_usage, "extra": body}


def _max_tokens(body: dict, name: str, default: int | None) -> int | None:
    value = _opt(body, name, read_int)
    if value is not None and value < 1:
        raise RequestError(f"`{name}` must be >= 1, got {value}")
    return default if value is None else value


def _prompts(prompt, vocab_size: int | None) -> list:
    """str | list[str] | list[int] | list[list[int]] -> a list of str or id lists."""
    if isinstance(prompt, str):
        return [read_str(prompt, "prompt")]
    if not isinstance(prompt, list) or not prompt:
        if isinstance(prompt, list):
            raise RequestError("`prompt` must not be empty")
        raise type_error(prompt, "a string, a list of strings or token ids", "prompt")
    if all(type(p) is int for p in prompt):  # noqa: E721 (one prompt of ids; bool is refused)
        prompts = [read_ints(prompt, "prompt")]
    elif all(isinstance(p, str) for p in prompt):
        return [read_str(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
    elif all(isinstance(p, list) for p in prompt):
        prompts = [read_ints(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
    else:
        bad = next((i for i, p in enumerate(prompt) if not isinstance(p, (str, int, list)) or isinstance(p, bool)),
                   None)
        if bad is not None:
            raise type_error(prompt[bad], "a string, a token id or a list of token ids", f"prompt[{bad}]")
        bad = next(i for i, p in enumerate(prompt) if type(p) is not type(prompt[0]))
        raise type_error(prompt[bad], f"the type of prompt[0] ({type(prompt[0]).__name__})", f"prompt[{bad}]")
    for i, ids in enumerate(prompts):
        if not ids:
            raise RequestError(f"`prompt[{i}]` must not be empty")
        check_token_ids(ids, vocab_size, f"prompt[{i}]" if len(prompts) > 1 else "prompt")
    return prompts


def parse_completion(body, vocab_size: int | None) -> CompletionRequest:
    if not isinstance(body, dict):
        raise type_error(body, "an object", "$")
    if "prompt" not in body:
        raise RequestError("`prompt` is required")
    req = CompletionRequest(**_common(body, vocab_size, _max_tokens(body, "max_tokens", 16), "max_tokens"),
                            prompts=_prompts(body["prompt"], vocab_size))
    req.logprobs = _opt(body, "logprobs", read_int)
    if req.logprobs is not None and not 0 <= req.logprobs <= LIMITS.max_openai_logprobs:
        raise RequestError(f"`logprobs` must be in [0, {LIMITS.max_openai_logprobs}], got {req.logprobs}")
    req.echo = bool(_opt(body, "echo", read_bool))
    if _opt(body, "suffix", read_str):
        raise RequestError("`suffix` is not supported by sgl_kvxfer (no insertion mode)")
    best_of = _opt(body, "best_of", read_int)
    if best_of is not None and best_of != req.n:
        raise RequestError(f"`best_of` ({best_of}) other than n ({req.n}) is not supported by sgl_kvxfer")
    return req


def _message(m, i: int) -> dict:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise type_error(m, "struct ChatMessage", where)
    role = m.get("role")
    if role is None:
        raise RequestError(f"`{where}.role` is required")
    if read_str(role, f"{where}.role") not in CHAT_ROLES:
        raise RequestError(f"`{where}.role` must be one of {', '.join(CHAT_ROLES)}, got {role!r}")
    _opt(m, "name", read_str, 256, at=f"{where}.")
    content = m.get("content")
    if content is None:
        raise RequestError(f"`{where}.content` is required (a string or a list of text parts)")
    if isinstance(content, str):
        return {"role": role, "content": read_str(content, f"{where}.content")}
    if not isinstance(content, list):
        raise type_error(content, "a string or a list of content parts", f"{where}.content")
    parts = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        if not isinstance(part, dict):
            raise type_error(part, "struct ContentPart", at)
        kind = part.get("type")
        if kind != "text":
            raise RequestError(f"`{at}.type` {kind!r} is not supported by this text-only model")
        if part.get("text") is None:
            raise RequestError(f"`{at}.text` is required")
        parts.append(read_str(part["text"], f"{at}.text"))
    return {"role": role, "content": "".join(parts)}


def parse_chat(body, vocab_size: int | None) -> ChatCompletionRequest:
    if not isinstance(body, dict):
        raise type_error(body, "an object", "$")
    messages = body.get("messages")
    if messages is None:
        raise RequestError("`messages` is required")
    if not isinstance(messages, list):
        raise type_error(messages, "a sequence of messages", "messages")
    if not messages:
        raise RequestError("`messages` must hold at least one message")
    parsed = [_message(m, i) for i, m in enumerate(messages)]
    given = _max_tokens(body, "max_completion_tokens", None)
    name = "max_completion_tokens"
    if given is None:
        given, name = _max_tokens(body, "max_tokens", None), "max_tokens"
    req = ChatCompletionRequest(**_common(body, vocab_size, given, name), messages=parsed,
                                max_new_given=given is not None)
    req.logprobs = bool(_opt(body, "logprobs", read_bool))
    top = _opt(body, "top_logprobs", read_int)
    if top is not None:
        if not 0 <= top <= LIMITS.max_openai_logprobs:
            raise RequestError(f"`top_logprobs` must be in [0, {LIMITS.max_openai_logprobs}], got {top}")
        if not req.logprobs:
            raise RequestError("`top_logprobs` needs `logprobs` set to true")
        req.top_logprobs = top
    _refuse_unenforced(body)
    return req


def _refuse_unenforced(body: dict) -> None:
    """Chat fields that would change the output's form: refused unless they ask for nothing."""
    fmt = body.get("response_format")
    if fmt is not None:
        if not isinstance(fmt, dict):
            raise type_error(fmt, "struct ResponseFormat", "response_format")
        if fmt.get("type") != "text":
            raise RequestError(f"`response_format` of type {fmt.get('type')!r} is not supported by sgl_kvxfer "
                               "(it would not be enforced); only {\"type\": \"text\"} is")
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise type_error(tools, "a sequence of tools", "tools")
    if tools:
        raise RequestError("`tools` are not supported by sgl_kvxfer (no tool-call parser)")
    choice = body.get("tool_choice")
    if choice not in (None, "none", "auto"):
        raise RequestError(f"`tool_choice` {choice!r} is not supported by sgl_kvxfer (no tools)")
