#!/usr/bin/env bash
# Issue 19 in ONE device call (about 9 min on an H100): the GPU tests of the tiered decode / extend
# kernels and backends, the decode-attention config sweep + measurement (benchmarks/kernels/attention.py)
# and the engine decode matrix (benchmarks/throughput/e2e_decode.py). Everything lands in $OUT, 8 files:
#   issue19.log (stage times, FlashInfer JIT, summaries)  tests.log  attention.log  e2e.log
#   attention_<device>.json/.png  e2e_decode_llama-3-8b_<device>.json/.png
#
#   run  carry [.whl]  SGL_KVXFER_COMMIT=<hash> bash scripts/gpu/issue19.sh [STAGE ...]
#   STAGE: tests attention e2e (default all three, in this order)
#
# FlashInfer (optional): a call `run carry [.whl, .carry_fi_a] bash scripts/gpu/run_flashinfer.sh stage`
# just before, then this one carrying [.whl, .carry_fi_b]: its fp16 decode JIT-builds during the tests
# and attention.py times it too. Without it attention.py records "flashinfer not importable".
#
# Each stage runs under `timeout -s INT` (what it measured so far is kept: the benchmarks write their
# JSON after every point). Seconds: T_TESTS (120; the four test files run in parallel), T_ATTN (190,
# of which the config sweep T_SWEEP 60), T_E2E (180). The e2e matrix runs batch-major (batch 8 at
# 16k, 32k, then batch 32): at the default T_E2E an H100 gets through about batch 8; a call of its
# own, `E2E_BATCHES=32 T_E2E=420 bash scripts/gpu/issue19.sh e2e` (about 7.5 min), runs batch 32.
# Knobs: CONFIGS (JSON list of FilledDecodeConfig kwargs, default []), ATTN_CONTEXTS, ATTN_BATCHES,
# ATTN_MODELS, E2E_CONTEXTS, E2E_BATCHES, E2E_BUDGETS, E2E_N1 / E2E_N2 (the timed decode window, 8..40:
# no decode demotion inside it; e2e_decode.py's docstring).
#
# CPU check of the plumbing at toy sizes (tests deselected, tiny shapes, Triton's interpreter):
#   OUT=/tmp/issue19 DEVICE=cpu bash scripts/gpu/issue19.sh
set -uo pipefail
DEVICE=${DEVICE:-cuda}
export OUT=${OUT:-/tmp/out} PYTHONUNBUFFERED=1
mkdir -p "$OUT"
LOG="$OUT/issue19.log"
: > "$LOG"
say() { echo "$*" | tee -a "$LOG"; }
T0=$(date +%s)
if [ "$DEVICE" = cuda ]; then
  source scripts/gpu/env.sh >> "$LOG" 2>&1 || { say "env.sh failed"; tail -20 "$LOG"; exit 1; }
  if [ -d .carry_fi_a ] || [ -d .carry_fi_b ] || [ -d /tmp/fi ]; then
    source scripts/gpu/flashinfer_env.sh >> "$LOG" 2>&1 || say "flashinfer_env.sh failed (FlashInfer left out)"
  fi
  PY=${PY:-python3}
else
  PY=${PY:-python}
fi
STAGES=${*:-tests attention e2e}
say "issue19: stages [$STAGES] on $DEVICE, setup $(( $(date +%s) - T0 )) s, commit ${SGL_KVXFER_COMMIT:-?}"

# Python ignores SIGINT when started in a background job; these entry points restore it.
PYTEST=("$PY" -c "import signal, sys, pytest; signal.signal(signal.SIGINT, signal.default_int_handler); sys.exit(pytest.main(sys.argv[1:]))")

stage() {  # stage NAME LIMIT_S CMD... : run with a time limit, log its time and exit status
  local name=$1 limit=$2 t rc; shift 2
  t=$(date +%s)
  timeout -s INT -k 30 "$limit" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  say "== $name: exit $rc ($([ $rc = 124 ] && echo "stopped at its ${limit} s limit" || echo done)) in $(( $(date +%s) - t )) s"
  tail -n "${TAIL:-45}" "$OUT/$name.log" | cut -c1-300 | tee -a "$LOG"
}

fi_jit=()
if [ "$DEVICE" = cuda ] && [[ " $STAGES " == *" attention "* ]] && $PY -c "import flashinfer" 2>/dev/null; then
  for m in llama3-8b smollm2; do  # fp16 decode modules, built on the CPU while the tests use the GPU
    MAX_JOBS=6 $PY benchmarks/kernels/flashinfer_baseline.py --warm-jit cc --models $m --dtype float16 \
      > "/tmp/fi_jit_$m.log" 2>&1 &
    fi_jit+=($!)
  done
fi

for s in $STAGES; do
  case $s in
    tests)  # one pytest per file, in parallel: Triton's JIT builds (CPU-bound) dominate them
      t=$(date +%s); pids=(); names=()
      for f in test/kernels/test_filled_decode_attention.py test/layers/test_triton_tiered_backend.py \
               test/kernels/test_decode_attention.py test/kernels/test_extend_attention.py; do
        [ -f "$f" ] || continue
        n=$(basename "$f" .py); names+=("$n")
        timeout -s INT -k 15 "${T_TESTS:-120}" "${PYTEST[@]}" -m gpu -q -rs -p no:cacheprovider --durations=5 "$f" \
          > "/tmp/issue19_$n.log" 2>&1 &
        pids+=($!)
      done
      : > "$OUT/tests.log"
      for i in "${!pids[@]}"; do
        wait "${pids[$i]}"; rc=$?
        { echo "======== ${names[$i]}: exit $rc"; cat "/tmp/issue19_${names[$i]}.log"; } >> "$OUT/tests.log"
        say "== tests ${names[$i]}: exit $rc$([ $rc = 124 ] && echo " (stopped at ${T_TESTS:-120} s)"): $(grep -E \
          "passed|failed|error|skipped|no tests ran" "/tmp/issue19_${names[$i]}.log" | tail -1)"
      done
      grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | cut -c1-300 | tee -a "$LOG"
      say "== tests: $(( $(date +%s) - t )) s"
      ;;
    attention)
      for p in "${fi_jit[@]}"; do wait "$p"; done
      for m in llama3-8b smollm2; do [ -f "/tmp/fi_jit_$m.log" ] && cat "/tmp/fi_jit_$m.log" >> "$LOG"; done
      if [ "$DEVICE" = cuda ]; then
        args=(--models ${ATTN_MODELS:-llama3-8b smollm2} --batches ${ATTN_BATCHES:-8 1 32}
              --contexts ${ATTN_CONTEXTS:-32768 131072 65536 16384 4096 1024} --sweep-budget-s "${T_SWEEP:-60}")
      else
        args=(--device cpu --models smollm2 --batches 1 --contexts 64 --iters 1 --sweep-points smollm2:1:64)
      fi
      stage attention "${T_ATTN:-190}" "$PY" benchmarks/kernels/attention.py --out-dir "$OUT" "${args[@]}" \
        --sweep-configs --configs "${CONFIGS:-[]}"
      ;;
    e2e)
      if [ "$DEVICE" = cuda ]; then
        args=(--preset llama-3-8b --context ${E2E_CONTEXTS:-16384 32768} --batch ${E2E_BATCHES:-8 32}
              --n1 "${E2E_N1:-8}" --n2 "${E2E_N2:-40}" --repeats 2)
      else
        args=(--device cpu --preset tiny --context 64 --batch 2 --n1 1 --n2 2 --repeats 1)
      fi
      stage e2e "${T_E2E:-180}" "$PY" benchmarks/throughput/e2e_decode.py --out-dir "$OUT" "${args[@]}" \
        --kv-tier-budgets ${E2E_BUDGETS:-1.0 0.5 0.25}
      ;;
    *) say "unknown stage '$s' (tests attention e2e)" ;;
  esac
done
say "issue19: total $(( $(date +%s) - T0 )) s; \$OUT holds $(ls "$OUT" | wc -l) files: $(ls "$OUT" | tr '\n' ' ')"
