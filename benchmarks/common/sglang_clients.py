"""How our tests and benchmarks run SGLang's own `sglang.bench_serving` client.

It runs in this project's environment (installed by the README's install command) with one
addition: `torchvision_stub/` first on its PYTHONPATH (see that module for why). Nothing else
of bench_serving is changed.
"""
from __future__ import annotations

import os
import sys

STUB_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torchvision_stub")


def bench_serving_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "sglang.bench_serving", *args]


def bench_serving_env(base: dict | None = None) -> dict:
    """The environment for a bench_serving subprocess: offline hub, the stub first on the path,
    and no raw API_KEY (bench_serving would send it without "Bearer")."""
    env = dict(os.environ if base is None else base)
    env["HF_HUB_OFFLINE"] = "1"
    from sgl_kvxfer.env import BENCH_SITE

    env["PYTHONPATH"] = os.pathsep.join(p for p in (BENCH_SITE.get(), STUB_DIR, env.get("PYTHONPATH")) if p)
    env.pop("API_KEY", None)
    return env
