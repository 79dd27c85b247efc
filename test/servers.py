"""The test suite's server helpers: sgl_kvxfer.testing.servers, plus the fake-scheduler harness."""
from __future__ import annotations

import concurrent.futures as cf
import os

from sgl_kvxfer.testing.servers import (Deadline, ServerHandle, free_port, scaled, start_router,  # noqa: F401
                                         stop_all)
from sgl_kvxfer.testing.servers import start_server as _start_server

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAKE_SERVER = os.path.join(ROOT, "test", "server", "fake_server.py")


def start_server(args: list[str], fake: bool = False, env: dict | None = None, name: str = "server") -> ServerHandle:
    return _start_server(args, [FAKE_SERVER] if fake else None, env, name, cwd=ROOT)


def start_all(specs: list[tuple]) -> list[ServerHandle]:
    """Start servers concurrently: [(args, env, name)] -> handles in order. If one fails, the
    others are stopped and its error is raised."""
    with cf.ThreadPoolExecutor(len(specs)) as pool:
        futures = [pool.submit(start_server, args, env=env, name=name) for args, env, name in specs]
        cf.wait(futures)
    failed = [f.exception() for f in futures if f.exception() is not None]
    if failed:
        stop_all(*(f.result() for f in futures if f.exception() is None))
        raise failed[0]
    return [f.result() for f in futures]
