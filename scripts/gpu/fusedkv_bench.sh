#!/usr/bin/env bash
# On the GPU machine (one H100): FusedKV in the engine. Two stages, each under `timeout`, a failed
# stage does not stop the other; JSON, PNG and logs into $OUT (at most 3 files).
#   1. tests (~1 min): test/layers/test_fusedkv_triton.py natively on the GPU (triton path vs
#      torch, the graph capture target, real CUDA graphs vs eager at the SmolLM2 shape)
#   2. bench (~3-4 min): benchmarks/fusedkv/serve_bench.py, Llama-3-8B shape, dummy weights:
#      pool bytes, TTFT at 4k / 8k / 16k (+ FusedKV without the prefill skip), TPOT at ctx 8k,
#      batch 1 and 16, vanilla / FusedKV / Lite
# Carry .whl (env.sh installs it). Expected wall time on an H100: about 5 minutes.
#   run carry [.whl]  SGL_KVXFER_COMMIT=<hash> bash scripts/gpu/fusedkv_bench.sh [all|tests|bench]
# CPU smoke run: OUT=/tmp/x DEVICE=cpu BENCH_ARGS=--smoke bash scripts/gpu/fusedkv_bench.sh
set -uo pipefail
stage=${1:-all}
case $stage in all|tests|bench) ;; *) sed -n '2,12p' "$0"; exit 2 ;; esac
export OUT=${OUT:-/tmp/out} PYTHONUNBUFFERED=1
DEVICE=${DEVICE:-cuda}
TESTS_TIMEOUT=${TESTS_TIMEOUT:-150} BENCH_TIMEOUT=${BENCH_TIMEOUT:-420}
BENCH_ARGS=${BENCH_ARGS:---preset llama-3-8b --prompt-lens 4096 8192 16384 --decode-context 8192 --decode-batch 1 16 --ablate-skip}
mkdir -p "$OUT"
if [ "$DEVICE" = cuda ]; then
  source scripts/gpu/env.sh || exit 1
else  # as env.sh: the repo root on the path plus a kernels link
  [ -e sgl_kvxfer/kernels ] || ln -s ../kernels sgl_kvxfer/kernels
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
work=$(mktemp -d /tmp/fusedkv_bench.XXXX)
if [ "$stage" != bench ] && [ "$DEVICE" = cuda ]; then
  echo "== tests ($(date +%T))"
  timeout "$TESTS_TIMEOUT" python3 -m pytest test/layers/test_fusedkv_triton.py -q -x -p no:cacheprovider \
      2>&1 | tee "$work/fusedkv_tests.log" || true
fi
if [ "$stage" != tests ]; then
  echo "== bench ($(date +%T))"
  # shellcheck disable=SC2086  # BENCH_ARGS is a word list
  timeout "$BENCH_TIMEOUT" python3 benchmarks/fusedkv/serve_bench.py --device "$DEVICE" --out-dir "$work" \
      $BENCH_ARGS 2>&1 | tee "$work/fusedkv_bench.log" || true
fi
echo "== done ($(date +%T))"
cp "$work"/*.json "$work"/*.png "$OUT"/ 2>/dev/null
tar -czf "$OUT/fusedkv_bench_logs.tar.gz" -C "$work" $(cd "$work" && ls *.log)
rm -rf "$work"
ls -la "$OUT"
