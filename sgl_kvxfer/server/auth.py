"""Bearer-token auth as a plain ASGI middleware (no BaseHTTPMiddleware: it would break streaming
disconnect detection).

Rules: OPTIONS and the probes (paths under /health, and /ready), which carry no data, are
exempt; every other route, /metrics included, needs the key. Admin routes take --admin-api-key
when set, else --api-key. Keys are compared in constant time; failure is 401
{"error":"Unauthorized"}.
"""
from __future__ import annotations

import hmac
import json

EXEMPT_PREFIXES = ("/health", "/ready")
ADMIN_PATHS = ("/flush_cache", "/abort_request", "/kv_transfer_link", "/start_profile", "/stop_profile")


def _bearer(headers: list[tuple[bytes, bytes]]) -> str | None:
    for name, value in headers:
        if name.lower() == b"authorization":
            scheme, _, token = value.decode("latin-1").strip().partition(" ")
            return token.strip() if scheme.lower() == "bearer" else None
    return None


class AuthMiddleware:
    def __init__(self, app, api_key: str | None, admin_api_key: str | None):
        self.app = app
        self.api_key = api_key
        self.admin_api_key = admin_api_key

    def _required_key(self, path: str) -> str | None:
        if path.startswith(EXEMPT_PREFIXES):
            return None
        if path in ADMIN_PATHS and self.admin_api_key:
            return self.admin_api_key
        return self.api_key

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") == "OPTIONS":
            return await self.app(scope, receive, send)
        key = self._required_key(scope.get("path", ""))
        if key is None:
            return await self.app(scope, receive, send)
        token = _bearer(scope.get("headers", []))
        if token is not None and hmac.compare_digest(token.encode(), key.encode()):
            return await self.app(scope, receive, send)
        body = json.dumps({"error": "Unauthorized"}).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
