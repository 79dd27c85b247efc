"""Hostile requests for the three generation routes, generated field by field.

Each `Case` is one HTTP request a client controls end to end (route, raw body bytes, headers)
and the status the server must answer with. Bodies are built from a valid base body per route
with one field replaced by a bad value of each kind: wrong JSON type, out of range, beyond 64
bits, non-finite, lone UTF-16 surrogate, too large, too deep. `crasher` marks the kinds that
once stopped or hung a real server: the live-server test sends those.

    cases()            every hostile case (each route, streaming and not where it applies)
    valid_edge_cases() requests at the edge of every rule that must still succeed (200)
"""
from __future__ import annotations

import json
from dataclasses import dataclass

VOCAB = 49152  # SmolLM2 (the fake scheduler reports the same)
GEN, CMPL, CHAT = "/generate", "/v1/completions", "/v1/chat/completions"
BASE = {
    GEN: {"text": "Hello there", "sampling_params": {"max_new_tokens": 2, "temperature": 0}},
    CMPL: {"model": "m", "prompt": "Hello there", "max_tokens": 2, "temperature": 0},
    CHAT: {"model": "m", "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 2, "temperature": 0},
}
NAN, INF, NINF = "__NaN__", "__Infinity__", "__-Infinity__"  # raw JSON tokens, spliced into the bytes
SURROGATE = "bad\ud800text"
BIG = (2**63, 2**64, 2**70, -(2**63) - 1, -(2**70))
NOT_INT = ("5", 1.5, True, [], {})
NOT_FLOAT = ("0.5", True, [], {})
NOT_BOOL = ("yes", 1, [], {})
NOT_FINITE = (NAN, INF, NINF, "1e400")


@dataclass(frozen=True)
class Case:
    id: str
    route: str
    body: bytes
    expect: int = 400
    crasher: bool = False
    content_type: str = "application/json"


def dumps(obj) -> bytes:
    """JSON with the NaN / Infinity tokens Python's json would write, and raw number text."""
    text = json.dumps(obj)  # ensure_ascii: lone surrogates become \\udXXX escapes
    for token, raw in ((NAN, "NaN"), (INF, "Infinity"), (NINF, "-Infinity"), ("1e400", "1e400")):
        text = text.replace(json.dumps(token), raw)
    return text.encode()


def _with(route: str, *settings) -> dict:
    """The route's base body with each (path, value) of `settings` set (path: tuple of keys)."""
    body = json.loads(json.dumps(BASE[route]))
    for path, value in settings:
        node = body
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return body


def _spath(route: str, name: str) -> tuple:
    """Where sampling knob `name` (its /generate name) lives in a route's body."""
    openai = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "sampling_seed": "seed"}
    return ("sampling_params", name) if route == GEN else (openai.get(name, name),)


def _name(value) -> str:
    text = repr(value)
    return text if len(text) <= 24 else text[:21] + "..."


ALL, OPENAI = (GEN, CMPL, CHAT), (CMPL, CHAT)
# sampling knob (its /generate name) -> (routes that have it, bad values)
SAMPLING_FIELDS = {
    "max_new_tokens": (ALL, (-1, 10**12, *BIG, *NOT_INT)),
    "max_completion_tokens": ((CHAT,), (0, -1, 10**12, *BIG, *NOT_INT)),
    "min_new_tokens": (ALL, (-1, 3, *BIG, *NOT_INT)),
    "temperature": (ALL, (-0.1, *NOT_FINITE, *NOT_FLOAT)),
    "top_p": (ALL, (0, -0.5, 1.5, *NOT_FINITE, *NOT_FLOAT)),
    "top_k": (ALL, (0, -2, 2**31, *BIG, *NOT_INT)),
    "min_p": (ALL, (-0.1, 1.1, *NOT_FINITE, *NOT_FLOAT)),
    "frequency_penalty": (ALL, (-2.1, 2.1, *NOT_FINITE, *NOT_FLOAT)),
    "presence_penalty": (ALL, (-2.1, 2.1, *NOT_FINITE, "x")),
    "repetition_penalty": (ALL, (0, -1, 2.5, *NOT_FINITE, "x")),
    "n": (ALL, (0, -1, 129, 100_000, *BIG, *NOT_INT)),
    "stop": (ALL, (5, [5], [""], ["x"] * 65, "x" * 1025, {"a": 1}, SURROGATE, [SURROGATE], [["x"]])),
    "stop_token_ids": (ALL, ([-1], [VOCAB], [2**63], [2**70], "5", [1.5], [True], [0] * 1025, 5)),
    "logit_bias": (ALL, ({"1": NAN}, {"1": INF}, {"1": NINF}, {"1": "1e400"}, {"1": "x"}, {"1": True}, {"x": 1},
                         {"-1": 1}, {str(VOCAB): 1}, {str(2**70): 1}, {"1": 101}, {"1": -101}, 5, [1],
                         {str(i): 1 for i in range(1025)}, {SURROGATE: 1})),
    "sampling_seed": (ALL, (2**64, 2**70, -(2**63) - 1, *NOT_INT)),
    "ignore_eos": (ALL, NOT_BOOL),
    "skip_special_tokens": (ALL, NOT_BOOL),
    "no_stop_trim": (ALL, NOT_BOOL),
    "stream_interval": ((GEN,), (0, -1, *BIG, *NOT_INT)),
    "regex": (ALL, ("a+", 5)),
    "json_schema": (ALL, ('{"type": "object"}', 5)),
    "ebnf": (ALL, ('root ::= "a"',)),
}
# (knob, index of the bad value) kinds that stopped or hung a real server before every field
# was validated at one place
CRASHERS = {("logit_bias", 0), ("logit_bias", 1), ("logit_bias", 9), ("stop_token_ids", 1), ("stop_token_ids", 3),
            ("n", 3), ("sampling_seed", 1), ("top_k", 4), ("stop", 4)}


def _streams(k: int, crash: bool) -> tuple:
    """Plain always; streaming too for a field's first two bad values and every crasher (the
    checks run before a stream starts, the same code either way: enough to prove that)."""
    return (False, True) if k < 2 or crash else (False,)


def _sampling_cases() -> list[Case]:
    out = []
    for field, (routes, bad) in SAMPLING_FIELDS.items():
        for route in routes:
            for k, value in enumerate(bad):
                settings = [(_spath(route, field), value)]
                if field == "stop_token_ids":  # an out-of-vocab id is banned (indexed) before min tokens
                    settings.append((_spath(route, "min_new_tokens"), 1))
                body = _with(route, *settings)
                crash = (field, k) in CRASHERS
                for stream in _streams(k, crash):
                    out.append(Case(f"{route}:{field}={_name(value)}:{'stream' if stream else 'plain'}", route,
                                    dumps({**body, "stream": stream}), crasher=crash))
    return out


def _generate_cases() -> list[Case]:
    """/generate fields outside sampling_params."""
    bad = {
        "text": (5, [5], [], SURROGATE, [SURROGATE], ["a", 5], {"a": 1}, True),
        "input_ids": ([], [-1], [VOCAB], [2**63], [2**70], "abc", [[1], []], [[1], 2], [1.5], [True], [[2**70]],
                      [[-5]]),
        "rid": (5, [1], SURROGATE, "x" * 1000, ["a", "a"]),
        "return_logprob": NOT_BOOL,
        "logprob_start_len": (-2, 2**63, *NOT_INT, 10_000),
        "top_logprobs_num": (-1, 10**6, 257, *BIG, *NOT_INT),
        "token_ids_logprob": ([-1], [VOCAB], [2**70], "x", [0] * 1025, [1.5]),
        "return_text_in_logprobs": NOT_BOOL,
        "stream": NOT_BOOL,
        "return_prompt_token_ids": NOT_BOOL,
        "bootstrap_port": ("x", -1, 70000, 2**70),
        "bootstrap_room": ("x", -1, 2**70, 1.5),
        "bootstrap_host": (5, SURROGATE),
        "sampling_params": (5, "x", [], [{}, {}], {"bogus": 1}, {"n": None, "bogus_null": None}),
        "input_embeds": ([[0.1]],),
    }
    crashers = {("top_logprobs_num", 1), ("token_ids_logprob", 1), ("token_ids_logprob", 2), ("input_ids", 3),
                ("input_ids", 4), ("text", 3)}
    out = []
    for field, values in bad.items():
        for k, value in enumerate(values):
            body = {**BASE[GEN], field: value}
            if field in ("input_ids", "input_embeds"):
                body.pop("text")
            if field in ("logprob_start_len", "top_logprobs_num", "token_ids_logprob"):
                body["return_logprob"] = True
            if field == "rid" and isinstance(value, list):
                body["text"] = ["a", "b"]
            crash = (field, k) in crashers
            for stream in (False,) if field == "stream" else _streams(k, crash):
                b = body if field == "stream" else {**body, "stream": stream}
                out.append(Case(f"{GEN}:{field}={_name(value)}:{'stream' if stream else 'plain'}", GEN, dumps(b),
                                crasher=crash))
    both = {**BASE[GEN], "input_ids": [1, 2, 3]}
    out.append(Case(f"{GEN}:text+input_ids", GEN, dumps(both)))
    out.append(Case(f"{GEN}:nothing", GEN, dumps({"sampling_params": {"max_new_tokens": 1}})))
    return out


def _openai_cases() -> list[Case]:
    bad_common = {
        "stream_options": (5, {"include_usage": "x"}, [1]),
        "user": (5, SURROGATE),
        "model": (5, [1]),
    }
    bad_cmpl = {
        "prompt": (5, [], [[]], [1.5], [-1], [VOCAB], [2**70], ["a", 1], [[1], "a"], SURROGATE, {"a": 1}, None, True,
                   [[2**63]]),
        "echo": NOT_BOOL,
        "logprobs": (-1, 21, "5", 2**70, [], True),
        "suffix": ("tail", 5),
        "best_of": (2, 0, "x"),
    }
    bad_chat = {
        "messages": (3, [], [5], [{"role": "user"}], [{"role": "user", "content": None}],
                     [{"role": "bogus", "content": "x"}], [{"content": "x"}], [{"role": "user", "content": 5}],
                     [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
                     [{"role": "user", "content": [{"type": "text"}]}], [{"role": "user", "content": [5]}],
                     [{"role": "user", "content": SURROGATE}], [{"role": "user", "content": "x", "name": 5}],
                     [{"role": 5, "content": "x"}], "hello", None, [{"role": "user", "content": [{"text": "x"}]}]),
        "logprobs": ("yes", 5, []),
        "top_logprobs": (-1, 21, "5", 2**70),
        "response_format": ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}},
                            {"type": "json_object"}, {"type": "bogus"}, 5, "text"),
        "tools": ([{"type": "function", "function": {"name": "f", "parameters": {}}}], 5),
        "tool_choice": ("required", {"type": "function", "function": {"name": "f"}}, 5),
    }
    out = []
    for route, table in ((CMPL, {**bad_common, **bad_cmpl}), (CHAT, {**bad_common, **bad_chat})):
        for field, values in table.items():
            for k, value in enumerate(values):
                body = {**BASE[route], field: value}
                if field == "top_logprobs":
                    body["logprobs"] = True
                for stream in _streams(k, False):
                    out.append(Case(f"{route}:{field}={_name(value)}:{'stream' if stream else 'plain'}", route,
                                    dumps({**body, "stream": stream})))
    out.append(Case(f"{CHAT}:top_logprobs-without-logprobs", CHAT, dumps({**BASE[CHAT], "top_logprobs": 3})))
    for route in (CMPL, CHAT):
        out.append(Case(f"{route}:text/plain", route, dumps(BASE[route]), content_type="text/plain"))
    return out


def _body_cases() -> list[Case]:
    """The JSON body itself: broken, non-object, non-finite, too deep, too big, bad encoding."""
    out = []
    deep = b"[" * 100_000 + b"]" * 100_000
    for route in BASE:
        base = dumps(BASE[route])[:-1]  # without the closing brace: extra fields follow
        raw = {
            "broken": b"{", "empty": b"", "list": b"[1, 2]", "number": b"5", "string": b'"x"', "null": b"null",
            "nan-top": b"NaN", "invalid-utf8": b'{"text": "\xff\xfe"}',
            "deep-unknown-field": base + b', "extra": ' + deep + b"}",
            "depth-100-unknown-field": base + b', "extra": ' + b"[" * 100 + b"]" * 100 + b"}",
            "depth-100-objects": base + b', "extra": ' + b'{"a": ' * 100 + b"1" + b"}" * 100 + b"}",
            "nan-unknown-field": base + b', "extra": NaN}',
            "inf-unknown-field": base + b', "extra": 1e400}',
            "int-5000-digits": base + b', "extra": ' + b"1" * 5000 + b"}",
            "surrogate-unknown-key": base + b', "bad\\udc00key": 1}',
            "surrogate-unknown-value": base + b', "extra": "\\udbff"}',
            "duplicate-deep-mixed": base + b', "extra": ' + b'[{"a": ' * 60 + b"1" + b"}]" * 60 + b"}",
        }
        crashers = {"deep-unknown-field", "int-5000-digits"}
        for name, body in raw.items():
            out.append(Case(f"{route}:body:{name}", route, body, crasher=name in crashers))
        out.append(Case(f"{route}:body:too-large", route, base + b', "pad": "' + b"x" * (33 << 20) + b'"}', expect=413))
    return out


def _unique(items: list[Case]) -> list[Case]:
    seen: dict[str, int] = {}
    out = []
    for case in items:
        k = seen[case.id] = seen.get(case.id, 0) + 1
        out.append(case if k == 1 else Case(f"{case.id}#{k}", case.route, case.body, case.expect, case.crasher,
                                            case.content_type))
    return out


def cases() -> list[Case]:
    return _unique(_sampling_cases() + _generate_cases() + _openai_cases() + _body_cases())


def valid_edge_cases() -> list[Case]:
    """At the edge of each rule, on the right side: these must be served (200)."""
    edges = [
        (GEN, {"sampling_params": {"max_new_tokens": 2, "top_k": -1, "temperature": 0}}),
        (GEN, {"sampling_params": {"max_new_tokens": 2, "top_k": 1, "top_p": 1, "min_p": 0, "temperature": 0.7,
                                   "sampling_seed": 2**63 - 1, "frequency_penalty": -2, "presence_penalty": 2,
                                   "repetition_penalty": 2, "logit_bias": {"5": -100, "6": 100},
                                   "stop": ["x" * 1024], "stop_token_ids": [0, VOCAB - 1], "n": 2}}),
        (GEN, {"sampling_params": {"max_new_tokens": 2, "min_new_tokens": 2, "stop_token_ids": [VOCAB - 1],
                                   "temperature": 0}}),
        (GEN, {"return_logprob": True, "top_logprobs_num": 256, "token_ids_logprob": [0, VOCAB - 1],
               "logprob_start_len": 0}),
        (GEN, {"sampling_params": {"max_new_tokens": 2, "temperature": 0, "regex": None, "json_schema": None,
                                   "stop_token_ids": None, "logit_bias": None}}),
        (GEN, {"input_ids": [1, 2, VOCAB - 1], "text": None}),
        (GEN, {"extra": [[[["deep enough"]]]], "other": {"x": None}}),
        (CMPL, {"prompt": [0, 1, VOCAB - 1], "n": 2, "seed": 0, "logprobs": 20, "echo": True, "best_of": 2}),
        (CMPL, {"prompt": [[5, 6], [7]], "stop": "x", "suffix": None, "logit_bias": {"5": 1.5}}),
        (CMPL, {"top_k": -1, "min_tokens": 2, "stop_token_ids": [VOCAB - 1]}),
        (CHAT, {"messages": [{"role": "system", "content": "Be brief."},
                             {"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
                "logprobs": True, "top_logprobs": 20, "response_format": {"type": "text"}, "tool_choice": "none",
                "max_completion_tokens": 2}),
        (CHAT, {"tools": [], "stream_options": {"include_usage": True}, "seed": 2**64 - 1, "user": "u"}),
    ]
    out = []
    for i, (route, extra) in enumerate(edges):
        body = {**BASE[route], **extra}
        if body.get("text") is None and route == GEN and "input_ids" in body:
            body.pop("text")
        for stream in (False, True):
            out.append(Case(f"{route}:edge{i}:{'stream' if stream else 'plain'}", route,
                            dumps({**body, "stream": stream}), expect=200))
    return out
