"""SGLang's native routes: /generate, health, model/server info, flush, abort, load, metrics,
profiling."""
from __future__ import annotations

import asyncio
import os
import time

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from sgl_kvxfer.message import ProfileReq
from sgl_kvxfer.server.errors import contract_error, openai_error, read_json_body, request_error
from sgl_kvxfer.server.redact import redact_command
from sgl_kvxfer.server.streaming import SSEResponse, collect, dumps, sse_merge
from sgl_kvxfer.tokenizer.generate_input import parse_generate_request
from sgl_kvxfer.tokenizer.validation import ContractError, RequestError, read_float

SGLANG_VERSION = "0.5.23"
FLUSH_OK = ("Cache flushed.\nPlease check backend logs for more details. "
            "(When there are running or waiting requests, the operation will not be performed.)\n")
router = APIRouter()


def _tm(request: Request):
    return request.app.state.tm


@router.api_route("/generate", methods=["POST", "PUT"])
async def generate(request: Request):
    body, err = await read_json_body(request)
    if err is not None:
        return err
    tm = _tm(request)
    try:
        req = parse_generate_request(body, tm.vocab_size or None)
        prompts = tm.prepare(req.items)
    except ContractError as e:
        return contract_error(str(e))
    except RequestError as e:
        return request_error(str(e), e.status_code)
    states = tm.submit_all(req.items, prompts)
    extra = (lambda i: {"prompt_token_ids": prompts[i]}) if req.return_prompt_token_ids else None
    if req.stream:
        return SSEResponse(sse_merge(tm, states, req.is_batch, extra), tm, states)
    try:
        results = await collect(tm, states, request.is_disconnected)
    except RequestError as e:
        return request_error(str(e), e.status_code)
    if any(r is None for r in results):
        return Response(status_code=499)  # the client is gone; nobody reads this
    if extra is not None:
        results = [{**r, **extra(i)} for i, r in enumerate(results)]
    return Response(dumps(results if req.is_batch else results[0]), media_type="application/json")


@router.get("/health")
@router.get("/health_generate")
async def health(request: Request):
    tm = _tm(request)
    if tm.shutting_down:
        return Response(status_code=503)
    if request.url.path == "/health" and os.environ.get("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "").lower() == "false":
        return Response(status_code=200)
    return Response(status_code=200 if await tm.health_generate() else 503)


@router.get("/ready")
async def ready(request: Request):
    return Response(status_code=503 if _tm(request).shutting_down else 200)


def model_info(app) -> dict:
    args, info = app.state.server_args, app.state.tm.info
    model_path = args.engine.model_path or info.get("model_path")
    return {
        "model_path": model_path,
        "served_model_name": args.resolved_served_model_name,
        "tokenizer_path": args.engine.tokenizer_path or info.get("tokenizer_path"),
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": "default",
        "load_format": info.get("load_format", args.engine.load_format),
        "reasoning_parser": None,
        "tool_call_parser": None,
        "disaggregation_mode": args.scheduler.disaggregation_mode,
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": info.get("model_type"),
        "architectures": info.get("architectures"),
    }


@router.get("/model_info")
@router.get("/get_model_info")
async def get_model_info(request: Request):
    return model_info(request.app)


def internal_state_dict(state) -> dict:
    d = msgspec.structs.asdict(state)
    extra = d.pop("extra", None) or {}
    d["token_usage"] = round(d["kv_used_tokens"] / max(1, d["max_total_num_tokens"]), 6)
    return {**d, **extra}


@router.get("/server_info")
@router.get("/get_server_info")
async def get_server_info(request: Request):
    app = request.app
    args, info, tm = app.state.server_args, app.state.tm.info, app.state.tm
    try:
        states = [internal_state_dict(await tm.get_internal_state())]
    except asyncio.TimeoutError:
        states = []
    flat = {k: v for k, v in args.to_flat().items() if k not in ("api_key", "admin_api_key")}
    mi = model_info(app)
    flat.update({
        "model_path": mi["model_path"], "tokenizer_path": mi["tokenizer_path"], "served_model_name": mi["served_model_name"],
        "tp_size": 1, "dp_size": 1, "pp_size": 1,
        "load_balance_method": "round_robin", "kv_cache_dtype": "auto", "context_length": tm.context_len,
        "launch_command": redact_command(app.state.launch_command, (args.api_key, args.admin_api_key)),
        "status": "ready",
        "max_total_num_tokens": info.get("max_total_num_tokens"), "max_req_input_len": info.get("max_req_input_len"),
        "startup_time": app.state.startup_time, "kv_events": None, "internal_states": states,
        "host_runtime": info.get("host_runtime"),
        # the size prefill chunks have (-1: none), where the flag left it to the device
        "chunked_prefill_size": info.get("chunked_prefill_size", flat.get("chunked_prefill_size")),
        "version": SGLANG_VERSION, "frontend": "python",
    })
    return JSONResponse(flat)


MAX_FLUSH_WAIT_S = 600.0
PROFILE_WRITE_TIMEOUT_S = 300.0  # /stop_profile waits for the export of a long capture


@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(request: Request, timeout: float = 0.0):
    if not 0.0 <= timeout <= MAX_FLUSH_WAIT_S:  # NaN fails both
        return openai_error(f"timeout must be in [0, {MAX_FLUSH_WAIT_S:g}] seconds, got {timeout}", 400)
    tm, deadline = _tm(request), time.monotonic() + timeout
    while True:
        result = await tm.flush_cache()
        if result.success:
            return PlainTextResponse(FLUSH_OK)
        if time.monotonic() >= deadline:
            return PlainTextResponse(result.message or "Cache not flushed: requests are running.", status_code=400)
        await asyncio.sleep(0.2)


@router.post("/kv_transfer_link")
async def kv_transfer_link(request: Request):
    """Re-pace a prefill server's shaped KV link: {"rate_gbps": float (0: unpaced), "latency_ms":
    float, "stream": str (optional: --kv-transfer-stream for rooms opened from now on), "trace":
    bool (optional: trace rooms opened from now on; a server started with --enable-pd-trace),
    "last_chunk": int (optional: --kv-transfer-last-chunk for rooms opened from now on)}.
    Ours, not SGLang's: benchmarks sweep link rates and streams on one server pair (benchmarks/pd/)."""
    body, err = await read_json_body(request)
    if err is not None:
        return err
    try:
        rate = read_float(body["rate_gbps"], "rate_gbps")
        latency = read_float(body.get("latency_ms", 0.0), "latency_ms")
        stream = body.get("stream")
        if stream is not None and not isinstance(stream, str):
            raise TypeError("stream")
        trace = body.get("trace")
        if trace is not None and not isinstance(trace, bool):
            raise TypeError("trace")
        last_chunk = body.get("last_chunk")
        if last_chunk is not None and (isinstance(last_chunk, bool) or not isinstance(last_chunk, int)):
            raise TypeError("last_chunk")
    except (TypeError, KeyError, AttributeError, RequestError):
        return openai_error("body must be {\"rate_gbps\": float, \"latency_ms\": float (finite), "
                            "\"stream\": str, \"trace\": bool, \"last_chunk\": int}", 400)
    result = await _tm(request).set_kv_link(rate, latency, stream, trace, last_chunk)
    return PlainTextResponse(result.message, status_code=200 if result.success else 400)


@router.post("/abort_request")
async def abort_request(request: Request):
    body, err = await read_json_body(request)
    if err is not None:
        return err
    if not isinstance(body, dict) or not isinstance(body.get("rid") or "", str) \
            or not isinstance(body.get("abort_all", False), bool):
        return openai_error("body must be {\"rid\": str, \"abort_all\": bool}", 400)
    _tm(request).abort(body.get("rid") or "", bool(body.get("abort_all", False)))
    return Response(status_code=200)


async def _load(request: Request) -> dict:
    st = await _tm(request).get_internal_state()
    return {"dp_rank": 0, "num_reqs": st.num_running_reqs + st.num_queue_reqs,
            "num_waiting_reqs": st.num_queue_reqs, "num_tokens": st.kv_used_tokens}


@router.get("/get_load")
async def get_load(request: Request):
    return [await _load(request)]


@router.get("/v1/loads")
async def v1_loads(request: Request):
    return {"timestamp": time.time(), "loads": [await _load(request)]}


@router.get("/metrics")
async def metrics(request: Request):
    app = request.app
    if not app.state.server_args.enable_metrics:
        return openai_error("Not Found (start the server with --enable-metrics)", 404, err_type="404")
    try:
        state = internal_state_dict(await app.state.tm.get_internal_state())
    except asyncio.TimeoutError:
        state = None
    text = app.state.tm.metrics.render(model_info(app)["served_model_name"], state)
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4")


_PROFILE_TYPES = {"output_dir": str, "num_steps": int, "activities": list, "with_stack": bool,
                  "record_shapes": bool, "profile_id": str}
_PROFILE_UNSUPPORTED = ("start_step", "profile_by_stage", "merge_profiles", "profile_prefix", "profile_stages")


def _profile_fields(body) -> dict:
    """SGLang's ProfileReqInput fields, type-checked (their values: scheduler/profiler.py);
    ValueError names the field. A field of SGLang's that is not implemented fails unless unset."""
    if body is None:
        return {}
    if not isinstance(body, dict):
        raise ValueError("body must be a JSON object of SGLang's /start_profile fields")
    for key in _PROFILE_UNSUPPORTED:
        if body.get(key):
            raise ValueError(f"{key} is not supported by sgl_kvxfer")
    fields = {k: v for k, v in body.items() if k in _PROFILE_TYPES and v is not None}
    for key, value in fields.items():
        kind = _PROFILE_TYPES[key]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)) \
                or (key == "activities" and not all(isinstance(a, str) for a in value)):
            raise ValueError(f"{key} must be {'a list of str' if kind is list else kind.__name__}, got {value!r}")
    return fields


@router.api_route("/start_profile", methods=["GET", "POST"])
async def start_profile(request: Request):
    """A torch.profiler trace of the scheduler (the process that runs the model) to
    <output_dir>/<profile_id>-TP-0.trace.json.gz; it ends at /stop_profile or after num_steps
    steps that ran a forward. Profiling slows the server down while it records."""
    body, err = await read_json_body(request)
    if err is not None:
        return err
    try:
        fields = _profile_fields(body)
    except ValueError as e:
        return PlainTextResponse(f"{e}\n", status_code=400)
    result = await _tm(request).profile(ProfileReq(start=True, **fields))
    return PlainTextResponse("Start profiling.\n" if result.success else f"{result.message}\n",
                             status_code=200 if result.success else 400)


@router.api_route("/stop_profile", methods=["GET", "POST"])
async def stop_profile(request: Request):
    """Stop the capture; the reply comes once the trace is written."""
    result = await _tm(request).profile(ProfileReq(start=False), timeout=PROFILE_WRITE_TIMEOUT_S)
    return PlainTextResponse("Stop profiling. This will take some time.\n" if result.success
                             else f"{result.message}\n", status_code=200 if result.success else 400)
