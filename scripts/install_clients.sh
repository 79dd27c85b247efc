#!/usr/bin/env bash
# Installs the real SGLang 0.5.23 clients used by test/server and benchmarks/throughput.
# Idempotent: pip skips what is already installed.
#   .venv       : sglang (frontend DSL only, --no-deps) + its light import deps; torch stays put.
#   .venv-bench : sglang.bench_serving, which imports torchvision at module load; torchvision==0.29.1
#                 pins its own torch, so it lives in a separate venv and runs as a subprocess.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MAIN_VENV="${MAIN_VENV:-$ROOT/.venv}"
BENCH_VENV="${BENCH_VENV:-$ROOT/.venv-bench}"
CLIENT_DEPS=(orjson psutil pybase64 packaging pillow starlette msgspec pydantic pyzmq IPython requests tqdm aiohttp triton)

"$MAIN_VENV/bin/pip" install -q --no-deps sglang==0.5.23
"$MAIN_VENV/bin/pip" install -q "${CLIENT_DEPS[@]}"

if [ "${SKIP_BENCH_VENV:-0}" != "1" ]; then
  [ -x "$BENCH_VENV/bin/python" ] || python3 -m venv "$BENCH_VENV"
  "$BENCH_VENV/bin/pip" install -q --no-deps sglang==0.5.23
  "$BENCH_VENV/bin/pip" install -q "${CLIENT_DEPS[@]}" datasets sentencepiece compressed-tensors \
      apache-tvm-ffi torchvision==0.29.1 transformers gguf
fi
