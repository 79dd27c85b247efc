"""uvicorn's HTTP/1.1 protocol, minus one warning: a connection that opens with HTTP/2's
prior-knowledge preface is closed without a word.

sglang-router probes every worker twice with a gRPC (HTTP/2) request to learn whether it is a
gRPC worker; uvicorn's HTTP/1.1 parser rejects the preface with "Invalid HTTP request received."
on every start behind a router. The probe learns the same either way (not a gRPC worker); any
other malformed request is still answered 400 and logged as before.
"""
from __future__ import annotations

from uvicorn.protocols.http.auto import AutoHTTPProtocol

HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n"


class Http1Protocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
    _first_data = True

    def data_received(self, data: bytes) -> None:
        if self._first_data:
            self._first_data = False
            if data.startswith(HTTP2_PREFACE):
                self.transport.close()
                return
        super().data_received(data)
