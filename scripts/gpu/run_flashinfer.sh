#!/usr/bin/env bash
# On the GPU machine: FlashInfer's install (flashinfer_env.sh), JIT warm-up, GPU tests and decode
# baseline, logs in $OUT (jit.log, fi_tests.log, bench.log, the JSON + PNG).
#   call 1 (carry .whl .carry_fi_a):  bash scripts/gpu/run_flashinfer.sh stage
#   call 2 (carry .whl .carry_fi_b):  SGL_KVXFER_COMMIT=<hash> bash scripts/gpu/run_flashinfer.sh all [BENCH ARGS]
#   later calls on the warm machine (carry .whl): ... run_flashinfer.sh jit|tests|bench [BENCH ARGS]
set -uo pipefail
source scripts/gpu/env.sh || exit 1
source scripts/gpu/flashinfer_env.sh || exit 1
what=${1:-all}; shift || true
[ "$what" = stage ] && exit 0
python3 -c "import flashinfer" || exit 1
if [ "$what" = all ] || [ "$what" = jit ]; then
  t=$(date +%s)
  # One process per module: FlashInfer builds a module's sources in parallel, modules one by one.
  for m in llama3-8b smollm2; do for v in cc tc fp8; do
    MAX_JOBS=4 python3 benchmarks/kernels/flashinfer_baseline.py --warm-jit $v --models $m > /tmp/fi/jit_${m}_$v.log 2>&1 &
  done; done
  wait
  { echo "JIT warm-up: $(( $(date +%s) - t )) s"; cat /tmp/fi/jit_*.log; } > "$OUT/jit.log"
  grep -E "^JIT|Error|error" "$OUT/jit.log" | cut -c1-400 | head -20
fi
if [ "$what" = all ] || [ "$what" = tests ]; then
  timeout 300 python3 -m pytest -q -rs -p no:cacheprovider test/layers/test_flashinfer_backend.py 2>&1 \
    | tee "$OUT/fi_tests.log" | tail -15
fi
if [ "$what" = all ] || [ "$what" = bench ]; then
  timeout 300 python3 benchmarks/kernels/flashinfer_baseline.py --out-dir "$OUT" "$@" 2>&1 | tee "$OUT/bench.log" | tail -45
fi
