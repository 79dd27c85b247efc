"""Shared benchmark plumbing: device description, commit, command line, JSON + PNG output.

Every result JSON records the device it ran on, the commit and the command that produced it
(`write_json` fills the commit and the command when the payload lacks them, and refuses a
payload without a device).
"""
from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
import time

RESULTS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results")
REPO_ROOT = os.path.dirname(os.path.dirname(RESULTS_DIR))


def triton_interpreter_for(device: str) -> None:
    """Run Triton kernels in Triton's CPU interpreter when `device` is the CPU or no CUDA device
    exists. Call before anything imports a kernel module (sgl_kvxfer.utils.triton_cpu)."""
    from sgl_kvxfer.utils.triton_cpu import use_interpreter_on_cpu

    if str(device).startswith("cuda"):
        import torch

        device = device if torch.cuda.is_available() else "cpu"
    use_interpreter_on_cpu(str(device))


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        import torch

        return torch.cuda.get_device_name(0)
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        model = platform.processor() or "cpu"
    return f"{model} ({os.cpu_count()} cores)"


def git_commit() -> str:
    env_commit = os.environ.get("SGL_KVXFER_COMMIT")  # see sgl_kvxfer/env.py
    if env_commit:
        return env_commit
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], text=True,
                                       cwd=os.path.dirname(RESULTS_DIR)).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def command_line(argv: list[str] | None = None) -> str:
    """The command that ran this process, as one would type it at the repo root:
    `python benchmarks/.../script.py ARGS` (the script's path relative to the repo root when it
    lies inside it; arguments shell-quoted)."""
    argv = list(sys.argv if argv is None else argv)
    if not argv or not argv[0] or argv[0] == "-c":
        return shlex.join(["python", *argv[1:]]) if argv else "python"
    script = os.path.abspath(argv[0])
    if os.path.commonpath([script, REPO_ROOT]) == REPO_ROOT:
        script = os.path.relpath(script, REPO_ROOT)
    else:
        script = argv[0]
    return shlex.join(["python", script, *argv[1:]])


def write_json(name: str, payload: dict, out_dir: str | None = None) -> str:
    """Write `payload` as OUT_DIR/NAME.json (default benchmarks/results) and return the path.
    The payload must name its "device"; "commit" (git_commit()) and "command" (command_line())
    are filled in when absent, and a "timestamp" (UTC) is added."""
    if not payload.get("device"):
        raise ValueError(f"{name}: a result payload must record its 'device'")
    out_dir = out_dir or RESULTS_DIR
    os.makedirs(out_dir, exist_ok=True)
    payload = {"timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **payload}
    if not payload.get("commit"):
        payload["commit"] = git_commit()
    if not payload.get("command"):
        payload["command"] = command_line()
    path = os.path.join(out_dir, name + ".json")
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
    return path
