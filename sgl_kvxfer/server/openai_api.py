"""OpenAI routes: /v1/models, /v1/completions, /v1/chat/completions (spec 1.7).

Both generation routes build `GenerateItem`s (choice index = prompt * n + sample) and reuse the
tokenizer manager's prepare/submit/wait path; streams turn cumulative snapshots into deltas.
"""
from __future__ import annotations

import time
import uuid

import logging

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import Response

from sgl_kvxfer.server.errors import internal_error_message, openai_error, read_json_body, stream_error_event
from sgl_kvxfer.server.native import model_info
from sgl_kvxfer.server.openai_format import ChoiceStreamer, chat_choice, completion_choice, usage
from sgl_kvxfer.server.openai_protocol import parse_chat, parse_completion
from sgl_kvxfer.server.streaming import DONE, SSEResponse, collect, dumps, iter_snapshots, sse
from sgl_kvxfer.tokenizer.generate_input import GenerateItem, parse_bootstrap
from sgl_kvxfer.tokenizer.validation import RequestError, check_item_count

logger = logging.getLogger(__name__)
router = APIRouter()


def _card(app) -> dict:
    name = model_info(app)["served_model_name"]
    return {"id": name, "object": "model", "created": int(app.state.startup_time), "owned_by": "sglang",
            "root": name, "parent": None, "max_model_len": app.state.tm.context_len}


@router.get("/v1/models")
async def list_models(request: Request):
    return {"object": "list", "data": [_card(request.app)]}


@router.get("/v1/models/{model_id:path}")
async def get_model(request: Request, model_id: str):
    card = _card(request.app)
    if model_id != card["id"]:
        body = {"error": {"message": f"The model `{model_id}` does not exist.", "type": "invalid_request_error",
                          "param": "model", "code": "model_not_found"}}
        return Response(dumps(body), status_code=404, media_type="application/json")
    return card


async def _parse(request: Request, parse):
    ctype = request.headers.get("content-type", "")
    if ctype.split(";")[0].strip().lower() != "application/json":
        return None, openai_error("Unsupported Media Type: Only 'application/json' is allowed", 400)
    body, err = await read_json_body(request)
    if err is not None:
        return None, err
    try:
        return parse(body, request.app.state.tm.vocab_size or None), None
    except RequestError as e:
        return None, openai_error(str(e), e.status_code)


def _items(req, prompts: list[list[int]], max_new: list[int], return_logprob: bool, top: int) -> list[GenerateItem]:
    n = req.n
    check_item_count(len(prompts), n)
    boot = parse_bootstrap(req.extra, len(prompts) * n)  # PD fields (top level)
    base = msgspec.structs.replace(req.sampling, n=1)
    items = []
    for i, ids in enumerate(prompts):
        sampling = base if max_new[i] == base.max_new_tokens else \
            msgspec.structs.replace(base, max_new_tokens=max_new[i])
        for j in range(n):
            items.append(GenerateItem(
                rid=uuid.uuid4().hex, text=None, input_ids=ids, sampling=sampling, max_new_tokens_given=True,
                return_logprob=return_logprob, top_logprobs_num=top, return_text_in_logprobs=return_logprob,
                bootstrap=boot[i * n + j]))
    return items


async def _run(request: Request, req, prompts, max_new, return_logprob, top, render):
    """Shared body of both routes; `render` knows the route's reply and chunk shapes."""
    tm = request.app.state.tm
    try:
        items = _items(req, prompts, max_new, return_logprob, top)
        input_ids = tm.prepare(items)
    except RequestError as e:
        return openai_error(str(e), e.status_code)
    states = tm.submit_all(items, input_ids)
    if req.stream:
        return SSEResponse(_stream(tm, states, req, render), tm, states)
    try:
        results = await collect(tm, states, request.is_disconnected)
    except RequestError as e:
        return openai_error(str(e), e.status_code)
    if any(r is None for r in results):
        return Response(status_code=499)
    choices = [render.choice(i, r) for i, r in enumerate(results)]
    body = render.envelope(choices, usage(results, req.n))
    return Response(dumps(body), media_type="application/json")


async def _stream(tm, states, req, render):
    """Every stream ends with [DONE], after an error event if the request failed."""
    streamer = ChoiceStreamer(render)
    results: dict[int, dict] = {}
    try:
        for chunk in render.opening_chunks(len(states)):
            yield sse(chunk)
        async for i, snap in iter_snapshots(tm, states):
            results[i] = snap
            for chunk in streamer.chunks(i, snap):
                yield sse(chunk)
        if req.include_usage:
            yield sse(render.envelope([], usage([results[i] for i in sorted(results)], req.n), chunk=True))
    except RequestError as e:
        yield stream_error_event(str(e), e.status_code)
    except Exception as e:  # noqa: BLE001 (a bug must still end the stream in the route's error shape)
        logger.exception("stream failed")
        yield stream_error_event(internal_error_message(e), 500)
    yield DONE


class _Render:
    def __init__(self, req, kind: str, prompt_texts=None):
        self.kind = kind
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.model = req.model
        self.req = req
        self.prompt_texts = prompt_texts

    def envelope(self, choices, usage_obj=None, chunk: bool = False) -> dict:
        obj = ("chat.completion" if self.kind == "chat" else "text_completion") + (".chunk" if chunk and self.kind == "chat" else "")
        body = {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}
        if usage_obj is not None or not chunk:
            body["usage"] = usage_obj
        return body

    def choice(self, i: int, snap: dict) -> dict:
        if self.kind == "chat":
            return chat_choice(i, snap, self.req.logprobs)
        echo = self.prompt_texts[i // self.req.n] if self.req.echo else ""
        return completion_choice(i, snap, echo, self.req.logprobs is not None)

    def opening_chunks(self, count: int):
        if self.kind != "chat":
            return []
        return [self.envelope([{"index": i, "delta": {"reasoning_content": None, "role": "assistant", "content": ""},
                                "logprobs": None, "finish_reason": None, "matched_stop": None}], chunk=True)
                for i in range(count)]


@router.post("/v1/completions")
async def completions(request: Request):
    req, err = await _parse(request, parse_completion)
    if err is not None:
        return err
    tm = request.app.state.tm
    if tm.tokenizer is None and any(isinstance(p, str) for p in req.prompts):
        return openai_error("text prompts need the tokenizer (server runs with --skip-tokenizer-init)", 400)
    prompts = [tm.tokenizer.encode(p) if isinstance(p, str) else p for p in req.prompts]
    texts = [p if isinstance(p, str) else (tm.tokenizer.decode(p) if tm.tokenizer else "") for p in req.prompts]
    top = req.logprobs or 0
    render = _Render(req, "completion", texts)
    max_new = [req.sampling.max_new_tokens] * len(prompts)
    return await _run(request, req, prompts, max_new, req.logprobs is not None, top, render)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    req, err = await _parse(request, parse_chat)
    if err is not None:
        return err
    tm = request.app.state.tm
    if tm.tokenizer is None:
        return openai_error("chat needs the tokenizer (server runs with --skip-tokenizer-init)", 400)
    try:
        prompt = tm.tokenizer.apply_chat_template(req.messages, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # jinja template errors (e.g. role order) are client errors
        return openai_error(f"Cannot apply the chat template: {e}", 400)
    ids = tm.tokenizer.encode(prompt, add_special_tokens=False)
    max_new = req.sampling.max_new_tokens
    if not req.max_new_given and tm.context_len:
        max_new = max(1, tm.context_len - len(ids) - 1)
        if req.sampling.min_new_tokens > max_new:
            return openai_error(f"`min_tokens` ({req.sampling.min_new_tokens}) exceeds the {max_new} tokens left "
                                f"in the context after the {len(ids)}-token prompt", 400)
    render = _Render(req, "chat")
    return await _run(request, req, [ids], [max_new], req.logprobs, req.top_logprobs, render)
