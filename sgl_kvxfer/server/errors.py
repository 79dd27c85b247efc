"""The three error envelopes SGLang clients see (spec 1.1), in one place.

    contract_error   400 {"error": "<string>"}                      /generate schema violations
    request_error    4xx {"error": {"message": ...}}                 /generate semantic errors
    openai_error     4xx/5xx {"object":"error","message","type","param","code"}   everything else
    stream_error_event  data: {"error": {...}}                       after a stream started

Any exception a handler did not expect becomes a 500 in that shape too (never a plain-text
body): `install_exception_handlers`.
"""
from __future__ import annotations

import json
import logging
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from sgl_kvxfer.tokenizer.validation import LIMITS, RequestError, load_json

logger = logging.getLogger(__name__)


def contract_error(message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=400)


def request_error(message: str, status_code: int = 400) -> JSONResponse:
    if status_code != 400:
        return openai_error(message, status_code)
    return JSONResponse({"error": {"message": message}}, status_code=400)


def openai_error(message: str, status_code: int = 400, err_type: str | None = None, param=None) -> JSONResponse:
    if err_type is None:
        err_type = "Bad Request" if status_code == 400 else str(status_code)
    body = {"object": "error", "message": message, "type": err_type, "param": param, "code": status_code}
    return JSONResponse(body, status_code=status_code)


def stream_error_event(message: str, status_code: int = 400) -> bytes:
    kind = "invalid_request_error" if status_code < 500 else "server_error"
    err = {"error": {"message": message, "type": kind, "code": status_code, "retryable": status_code == 503}}
    return b"data: " + json.dumps(err).encode() + b"\n\n"


def internal_error_message(exc: BaseException) -> str:
    return f"Internal server error: {type(exc).__name__}: {exc}"


def _phrase(code: int) -> str:
    try:
        return HTTPStatus(code).phrase
    except ValueError:
        return str(code)


def install_exception_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError):
        # SGLang rewrites FastAPI's 422 into a 400 ErrorResponse.
        parts = []
        for err in exc.errors():
            loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
            parts.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
        return openai_error("; ".join(parts) or "Invalid request", 400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        return openai_error(str(exc.detail or _phrase(exc.status_code)), exc.status_code)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        # NOTE: Starlette re-raises after sending this (uvicorn logs the traceback); the
        # process and every other request carry on.
        logger.error("%s %s failed: %s: %s", request.method, request.url.path, type(exc).__name__, exc)
        return openai_error(internal_error_message(exc), 500, err_type="InternalServerError")


async def read_json_body(request: Request, limits=LIMITS):
    """Parse the body strictly (tokenizer/validation.py: load_json); returns (value, None) or
    (None, error response). The body is read at most `max_body_bytes` + 1 bytes far."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limits.max_body_bytes:
        return None, openai_error(f"The request body ({declared} bytes) exceeds the limit of "
                                  f"{limits.max_body_bytes} bytes.", 413)
    chunks, size = [], 0
    async for chunk in request.stream():
        chunks.append(chunk)
        size += len(chunk)
        if size > limits.max_body_bytes:
            return None, openai_error(f"The request body exceeds the limit of {limits.max_body_bytes} bytes.", 413)
    try:
        return load_json(b"".join(chunks), limits), None
    except RequestError as e:
        return None, openai_error(str(e), e.status_code)
