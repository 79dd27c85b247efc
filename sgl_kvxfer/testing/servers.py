"""Real server processes for tests and benchmarks (SGLang has the same in sglang/test): start
`python -m sgl_kvxfer.launch_server` (or another entry script) on a free port, wait until it
answers, stop it with SIGTERM and check by pid that the launcher and all its children are gone;
the same for the real `sglang_router`. Logs go to the temp folder ($TMPDIR). Needs the `test`
extra (psutil, requests, sglang-router).
"""
from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import psutil
import requests

STARTUP_TIMEOUT = 600  # seconds on an idle machine; every wait here stretches with the load


def load_factor() -> float:
    """How many times slower than an idle machine this one runs now: the 1- or 5-minute load
    average per core, whichever is higher, at least 1."""
    try:
        load = max(os.getloadavg()[:2])
    except OSError:
        return 1.0
    return max(1.0, load / (os.cpu_count() or 1))


def scaled(seconds: float) -> float:
    """A timeout of `seconds` on an idle machine, stretched by the load now (for one request)."""
    return seconds * load_factor()


class Deadline:
    """`seconds` of an idle machine from now, stretched by the highest load seen while waiting:
    a wait that flakes only on a busy machine is a wait on the wrong clock."""

    def __init__(self, seconds: float):
        self.start, self.seconds, self.factor = time.monotonic(), seconds, load_factor()

    def expired(self) -> bool:
        self.factor = max(self.factor, load_factor())
        return time.monotonic() - self.start > self.seconds * self.factor

    def __str__(self) -> str:
        return f"{self.seconds * self.factor:.0f} s ({self.seconds:.0f} s x load {self.factor:.1f})"


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
        """SIGTERM the launcher; return the pids of any process left alive (should be []).
        The log is deleted when the launcher shut down cleanly, and kept (its path printed) when
        it had died or had to be killed. Never raises: a stop must not keep the next handle
        from stopping."""
        died_before = self.proc.poll() is not None
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
            left = [p for p in pids if _alive(p)]
            if not left:
                break
            time.sleep(0.2)
        for pid in left:  # never leak processes into other tests
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        clean = not died_before and self.proc.returncode in (0, -signal.SIGTERM) and not left
        try:
            if clean:
                os.unlink(self.log_path)
            else:
                print(f"kept {self.log_path} (exit {self.proc.returncode})", file=sys.stderr)
        except OSError:
            pass
        return left


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def stop_all(*handles) -> None:
    """Stop every handle at once (each stop waits for its own drain; they share nothing)."""
    live = [h for h in handles if h is not None]
    if len(live) <= 1:
        for h in live:
            h.stop()
        return
    with cf.ThreadPoolExecutor(len(live)) as pool:
        list(pool.map(lambda h: h.stop(), live))


def start_server(args: list[str], entry: list[str] | None = None, env: dict | None = None, name: str = "server",
                 cwd: str | None = None) -> ServerHandle:
    """`entry` replaces `-m sgl_kvxfer.launch_server` (e.g. [script path]); returns once
    /v1/models answers. A free port can be taken by another process between free_port() and the
    server's bind: a server that exits on 'address already in use' is started again on a new port."""
    for _ in range(3):
        handle = _start_once(args, entry, env, name, cwd)
        if handle is not None:
            return handle
    raise RuntimeError(f"{name}: its port was taken before it could bind, three times")


def _start_once(args, entry, env, name, cwd) -> ServerHandle | None:
    """The server's handle once it answers; None if its HTTP port was taken before it bound."""
    port = free_port()
    cmd = [sys.executable, *(entry or ["-m", "sgl_kvxfer.launch_server"]), "--port", str(port), *args]
    log_path = os.path.join(tempfile.gettempdir(), f"sgl_kvxfer_{name}_{port}.log")
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    proc = subprocess.Popen(cmd, cwd=cwd, env=full_env, stdout=open(log_path, "w"), stderr=subprocess.STDOUT)
    handle = ServerHandle(proc, f"http://127.0.0.1:{port}", log_path)
    deadline = Deadline(STARTUP_TIMEOUT)
    while not deadline.expired():
        if proc.poll() is not None:
            log = handle.log()
            if f"('127.0.0.1', {port}): address already in use" in log:
                os.remove(log_path)
                return None
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log}")
        try:
            if requests.get(handle.url + "/v1/models", timeout=2, headers=_auth(args)).status_code == 200:
                return handle
        except requests.RequestException:
            pass
        time.sleep(0.1)  # a refused connect costs little; tests start many servers
    log = handle.log()  # read first: a clean stop deletes it
    handle.stop()
    raise RuntimeError(f"server did not come up in {deadline}:\n{log}")


def _auth(args: list[str]) -> dict:
    if "--api-key" in args:
        return {"Authorization": "Bearer " + args[args.index("--api-key") + 1]}
    return {}


def start_router(prefills: list[tuple[str, int | None]], decodes: list[str], policy: str = "random",
                 name: str = "router", workers: list[str] | None = None,
                 health_check_interval_secs: int = 1, extra_args: tuple[str, ...] = ()) -> ServerHandle:
    """The real `sglang_router.launch_router --pd-disaggregation` in front of PD workers (or, with
    `workers`, in front of plain servers), with health checks every `health_check_interval_secs`
    (the router's own default is 60) and `extra_args` appended to its command line; returns once
    /readiness answers 200 (a healthy prefill and decode, or a healthy worker)."""
    port = free_port()
    mode = ["--worker-urls", *workers] if workers else ["--pd-disaggregation"]
    cmd = [sys.executable, "-m", "sglang_router.launch_router", *mode, "--host", "127.0.0.1",
           "--port", str(port), "--policy", policy, "--health-check-interval-secs", str(health_check_interval_secs),
           # a long timeout: a busy CPU worker may take seconds to answer /health (a killed one
           # refuses at once); "unhealthy" would open the router's circuit and fail requests
           "--health-check-timeout-secs", "20",
           "--worker-startup-check-interval", "1", "--log-level", "warn", "--prometheus-host", "127.0.0.1",
           "--prometheus-port", str(free_port())]
    for url, bootstrap_port in prefills:
        cmd += ["--prefill", url, str(bootstrap_port) if bootstrap_port is not None else "none"]
    for url in decodes:
        cmd += ["--decode", url]
    cmd += list(extra_args)
    log_path = os.path.join(tempfile.gettempdir(), f"sgl_kvxfer_{name}_{port}.log")
    proc = subprocess.Popen(cmd, stdout=open(log_path, "w"), stderr=subprocess.STDOUT,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    handle = ServerHandle(proc, f"http://127.0.0.1:{port}", log_path)
    deadline = Deadline(120)
    while not deadline.expired():
        if proc.poll() is not None:
            raise RuntimeError(f"router exited with {proc.returncode}:\n{handle.log()}")
        try:
            if requests.get(handle.url + "/readiness", timeout=2).status_code == 200:
                return handle
        except requests.RequestException:
            pass
        time.sleep(0.1)
    handle.stop()
    raise RuntimeError(f"router not ready in {deadline}:\n{handle.log()}")
