"""Server fixtures: one server per test module (test/servers.py starts and stops them)."""
from __future__ import annotations

import pytest
from servers import start_server

# Small limits keep the CPU server light: a modest KV pool and short prefill chunks.
LIVE_ARGS = ["--max-total-tokens", "16384", "--chunked-prefill-size", "512", "--max-running-requests", "64",
             "--context-length", "2048", "--enable-metrics", "--log-level", "warning"]


@pytest.fixture(scope="module")
def live_server():
    handle = start_server(LIVE_ARGS, name="live")
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def fake_server():
    handle = start_server(["--log-level", "warning", "--enable-metrics"], fake=True, name="fake")
    yield handle
    handle.stop()
