"""Server fixtures: one server per test module, on a free port, stopped with SIGTERM.

`start_server(args, fake=False)` launches `python -m sgl_kvxfer.launch_server` (or the fake-scheduler
harness) as a subprocess, waits for GET /v1/models, and returns a `ServerHandle`. `stop()` sends
SIGTERM and checks by pid that the launcher and all its children are gone.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import psutil
import pytest
import requests

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STARTUP_TIMEOUT = 600


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerHandle:
    proc: subprocess.Popen
    url: str
    log_path: str

    def children(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-5000:]

    def stop(self, timeout: float = 30) -> list[int]:
        """SIGTERM the launcher; return the pids of any process left alive (should be [])."""
        pids = [p.pid for p in self.children()]
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        deadline = time.time() + 10
        left = pids
        while time.time() < deadline:
            left = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
            if not left:
                break
            time.sleep(0.2)
        for pid in left:  # never leak processes into other tests
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return left


def start_server(args: list[str], fake: bool = False, env: dict | None = None, name: str = "server") -> ServerHandle:
    port = free_port()
    entry = [os.path.join(ROOT, "test", "server", "fake_server.py")] if fake else ["-m", "sgl_kvxfer.launch_server"]
    cmd = [sys.executable, *entry, "--port", str(port), *args]
    log_path = os.path.join(tempfile.gettempdir(), f"sgl_kvxfer_{name}_{port}.log")
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=open(log_path, "w"), stderr=subprocess.STDOUT)
    handle = ServerHandle(proc, f"http://127.0.0.1:{port}", log_path)
    deadline = time.time() + STARTUP_TIMEOUT
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{handle.log()}")
        try:
            if requests.get(handle.url + "/v1/models", timeout=2, headers=_auth(args)).status_code == 200:
                return handle
        except requests.RequestException:
            pass
        time.sleep(0.5)
    handle.stop()
    raise RuntimeError(f"server did not come up in {STARTUP_TIMEOUT}s:\n{handle.log()}")


def _auth(args: list[str]) -> dict:
    if "--api-key" in args:
        return {"Authorization": "Bearer " + args[args.index("--api-key") + 1]}
    return {}


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
