"""How our tests and benchmarks run SGLang's own `sglang.bench_serving` client.

It runs in this project's environment (installed by the README's install command) with two
changes: `torchvision_stub/` first on its PYTHONPATH (see that module for why), and no GPU in
sight (CUDA_VISIBLE_DEVICES empty): bench_serving is an HTTP client, and on a CUDA machine
sglang's modules it imports (sglang.srt's quantization configs) import `sgl_kernel`, a compiled
package the client does not need. Nothing else of bench_serving is changed.
"""
from __future__ import annotations

import os
import sys

STUB_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torchvision_stub")


def bench_serving_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "sglang.bench_serving", *args]


def bench_serving_env(base: dict | None = None) -> dict:
    """The environment for a bench_serving subprocess: offline hub, no GPU, the stub first on the
    path, and no raw API_KEY (bench_serving would send it without "Bearer")."""
    env = dict(os.environ if base is None else base)
    env["HF_HUB_OFFLINE"] = "1"
    env["CUDA_VISIBLE_DEVICES"] = ""  # sglang's is_cuda() is False: none of its sgl_kernel imports run
    env["PYTHONPATH"] = os.pathsep.join(p for p in (STUB_DIR, env.get("PYTHONPATH")) if p)
    env.pop("API_KEY", None)
    return env


def first_chunk(url: str, req: dict, t0: float, timeout: float) -> tuple[float, dict]:
    """Seconds from t0 to the first streamed chunk of POST url/generate, and the last meta_info.
    An HTTP error, an error event or a stream without chunks raises RuntimeError."""
    import json
    import time

    import requests

    first, meta = None, {}
    with requests.post(url + "/generate", json=req, stream=True, timeout=timeout) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: {r.status_code} {r.text[:500]}")
        for line in r.iter_lines():
            if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                continue
            first = first or time.perf_counter() - t0
            chunk = json.loads(line[5:])
            if "error" in chunk:
                raise RuntimeError(f"{url}: {chunk['error']}")
            meta = chunk.get("meta_info", meta)
    if first is None:
        raise RuntimeError(f"{url}: no streamed chunk")
    return first, meta
