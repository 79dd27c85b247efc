"""The three error envelopes SGLang clients see (spec 1.1), in one place.

    contract_error   400 {"error": "<string>"}                      /generate schema violations
    request_error    4xx {"error": {"message": ...}}                 /generate semantic errors
    openai_error     4xx {"object":"error","message","type","param","code"}   pydantic / HTTPException
"""
from __future__ import annotations

import json
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException


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
    err = {"error": {"message": message, "type": "invalid_request_error", "code": status_code, "retryable": False}}
    return b"data: " + json.dumps(err).encode() + b"\n\n"


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


async def read_json_body(request: Request):
    """Parse the body; returns (value, None) or (None, error response). Broken JSON is a 400."""
    raw = await request.body()
    try:
        return json.loads(raw or b"null"), None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        return None, openai_error(f"JSON decode error: {e}", 400)
