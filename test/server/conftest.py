"""Server fixtures (test/servers.py starts and stops them): the real-model server once for the
whole directory, the fake-scheduler servers once per module."""
from __future__ import annotations

import pytest
from servers import start_server

# Small limits keep the CPU server light: a modest KV pool and short prefill chunks.
LIVE_ARGS = ["--max-total-tokens", "16384", "--chunked-prefill-size", "512", "--max-running-requests", "64",
             "--context-length", "2048", "--enable-metrics", "--log-level", "warning"]


@pytest.fixture(scope="session")
def live_server():
    """One real SmolLM2 server for every module here (test_live_api, test_dsl_programs): a start
    costs tens of seconds on 2 cores. Stopped at the end with SIGTERM, which must leave no child
    process behind (the launcher stops the scheduler and the detokenizer)."""
    handle = start_server(LIVE_ARGS, name="live")
    yield handle
    assert len(handle.children()) >= 2, "scheduler and detokenizer run as child processes"
    left = handle.stop()
    assert handle.proc.returncode is not None
    assert left == [], f"processes left after SIGTERM: {left}"


@pytest.fixture(scope="module")
def fake_server():
    handle = start_server(["--log-level", "warning", "--enable-metrics"], fake=True, name="fake")
    yield handle
    handle.stop()
