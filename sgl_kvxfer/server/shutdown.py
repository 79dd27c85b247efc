"""Graceful shutdown of the HTTP server: SIGTERM (or Ctrl-C) drains, a second signal stops.

    signal 1   stop admitting: new requests, /health and /ready answer 503 (JSON error body)
               in-flight requests run on for up to --shutdown-grace-period-secs
               then every request still running ends with a 503 in its route's shape:
               a JSON error body, or (streams) an error event followed by `data: [DONE]`
               then uvicorn closes the listener and the connections, and the launcher
               stops its children
    signal 2   uvicorn stops at once (connections still open are cut)

A server whose scheduler or detokenizer died drains with no grace: nothing would finish.
NOTE: uvicorn calls `handle_exit` from the signal handler, on the event loop's thread; the
drain is handed to the loop with call_soon_threadsafe (which also wakes it).
"""
from __future__ import annotations

import asyncio
import logging
import time

import uvicorn

logger = logging.getLogger(__name__)
FLUSH_WAIT_S = 5.0  # after failing the rest: time for their handlers to write the error


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, tokenizer_manager, grace_s: float, crashed=lambda: False):
        super().__init__(config)
        self.tm = tokenizer_manager
        self.grace_s = grace_s
        self.crashed = crashed
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig, frame) -> None:
        if self._draining or self._loop is None or self.should_exit:
            super().handle_exit(sig, frame)
            return
        self._draining = True
        self._captured_signals.append(sig)  # re-raised once uvicorn returns: the launcher then stops
        self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self.drain()))

    async def drain(self) -> None:
        tm = self.tm
        tm.begin_shutdown()
        grace = 0.0 if self.crashed() else self.grace_s
        logger.info("shutting down: %d requests in flight, up to %g s to finish", tm.num_active, grace)
        deadline = time.monotonic() + grace
        while tm.num_active and time.monotonic() < deadline and not self.should_exit:
            await asyncio.sleep(0.05)
        failed = tm.fail_all()
        if failed:
            logger.warning("shutting down: %d requests did not finish in %g s; they end with a 503", failed, grace)
        deadline = time.monotonic() + FLUSH_WAIT_S
        while tm.num_active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self.should_exit = True
