"""Shared benchmark plumbing: device description, commit, JSON + PNG output."""
from __future__ import annotations

import json
import os
import platform
import subprocess
import time

RESULTS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results")


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


def write_json(name: str, payload: dict, out_dir: str | None = None) -> str:
    out_dir = out_dir or RESULTS_DIR
    os.makedirs(out_dir, exist_ok=True)
    payload = {"timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **payload}
    path = os.path.join(out_dir, name + ".json")
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
    return path
