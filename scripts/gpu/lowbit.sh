#!/usr/bin/env bash
# Low-bit decode on the GPU, ONE device call of at most 9 minutes (H100): the GPU tests of the decode
# kernels (real shapes), the attention table (benchmarks/kernels/attention.py: SDPA per backend, the
# paged fp16 pool's decode, the tiered pool's fp16 / int8 / int4 / b=0.5 mix, FlashInfer fp16 and fp8,
# with a config sweep first), ncu figures of the int8 / int4 kernels (benchmarks/kernels/ncu_decode.py)
# and the engine decode matrix (benchmarks/throughput/e2e_decode.py). $OUT gets 8 files:
#   lowbit.log (stage times and summaries)  tests.log  attention.log  attention_<dev>.json/.png
#   ncu_decode.json  e2e_decode_llama-3-8b_<dev>.json/.png
#
#   run  carry [.whl, .carry_fi_b]  SGL_KVXFER_COMMIT=<hash> bash scripts/gpu/lowbit.sh [STAGE ...]
#   STAGE: tests attention ncu e2e (default all four, in this order)
#
# FlashInfer: a call `run carry [.whl, .carry_fi_a] bash scripts/gpu/run_flashinfer.sh stage` just
# before, on the same warm machine; without it the FlashInfer columns say "not importable".
# Every stage runs under `timeout -s INT` (the benchmarks write their JSON after every point) and the
# whole call stops starting work at T_TOTAL (530 s). Stage limits in seconds: T_TESTS 120 (the test
# files in parallel), T_ATTN 270 (of which the sweep T_SWEEP 75), T_NCU 60, T_E2E the rest, skipped
# under E2E_MIN (200 s): an engine point (16k x 8) takes one to two minutes, so the matrix is a call
# of its own on the same warm machine (it finds the sweep's choice in $OUT):
#   E2E_CONTEXTS="16384 32768" E2E_BUDGETS="0.5 0.25" bash scripts/gpu/lowbit.sh e2e
# The check of the decode kernels in one call of <= 300 s (GPU tests of the real shapes and the
# conversion knobs, the sweep of the default configs below at the three target points, four
# attention points, ncu of the int8 / int4 / fp16 kernels, then the engine points that fit the rest;
# e2e_decode writes its JSON after every point, so the 16k points come back first):
#   T_TOTAL=265 T_TESTS=45 T_ATTN=100 T_SWEEP=50 T_NCU=20 E2E_MIN=45
#   TEST_FILES=test/kernels/test_tiered_pool_decode.py
#   TEST_K="real_shapes and mixed and dtype0 or knobs0 or knobs7 or knobs8 or knobs9 or one_result or fast_conversion or graph"
#   ATTN_POINTS="llama3-8b:8:32768 llama3-8b:1:32768 smollm2:8:32768 llama3-8b:8:16384"
#   SWEEP_POINTS="llama3-8b:8:32768 llama3-8b:1:32768 smollm2:8:32768"
#   E2E_CONTEXTS="16384 32768" E2E_BUDGETS="0.5 0.25" bash scripts/gpu/lowbit.sh tests attention ncu e2e
# The attention table alone, every point swept and measured with its own best config (FlashInfer
# staged by the call before; ~240 s):
#   T_TOTAL=240 T_ATTN=235 T_SWEEP=100
#   ATTN_POINTS="llama3-8b:8:32768 llama3-8b:1:32768 smollm2:8:32768 llama3-8b:32:32768"
#   SWEEP_POINTS="llama3-8b:8:32768 llama3-8b:1:32768 smollm2:8:32768 llama3-8b:32:32768" bash scripts/gpu/lowbit.sh attention
# Knobs: TEST_FILES (the test files), TEST_K (pytest -k), CONFIGS (JSON list for the sweep), ATTN_POINTS, SWEEP_POINTS,
# NCU_POINT (default llama3-8b:8:32768), NCU_VARIANTS (default "int8 int4 fp16"), E2E_CONTEXTS, E2E_BATCHES,
# E2E_BUDGETS, E2E_N1 / E2E_N2 (decode window; demotion runs every 64 steps past 128, so n2 = 272 times
# three of them), E2E_REPEATS, E2E_PAGE (--kv-tier-page-size), TIERED_DECODE_CONFIG (JSON: the config
# the engine serves, env SGL_KVXFER_TIERED_DECODE_CONFIG). Without the last two the e2e stage takes the
# attention sweep's best Llama-3-8B config and int page from $OUT; a call of its own should pass them
# (the first call's attention JSON: sweep.best).
#
# CPU check of the plumbing at toy sizes (GPU tests deselected, Triton's interpreter):
#   OUT=/tmp/lowbit DEVICE=cpu bash scripts/gpu/lowbit.sh
set -uo pipefail
DEVICE=${DEVICE:-cuda}
export OUT=${OUT:-/tmp/out} PYTHONUNBUFFERED=1
WORK=$(mktemp -d)   # scratch logs of this run (removed with it)
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$OUT"
LOG="$OUT/lowbit.log"
: > "$LOG"
say() { echo "$*" | tee -a "$LOG"; }
T0=$(date +%s)
T_TOTAL=${T_TOTAL:-530}
left() { echo $(( T_TOTAL - ($(date +%s) - T0) )); }
if [ "$DEVICE" = cuda ]; then
  source scripts/gpu/env.sh >> "$LOG" 2>&1 || { say "env.sh failed"; tail -20 "$LOG"; exit 1; }
  if [ -d .carry_fi_a ] || [ -d .carry_fi_b ] || [ -d /tmp/fi ]; then
    source scripts/gpu/flashinfer_env.sh >> "$LOG" 2>&1 || say "flashinfer_env.sh failed (FlashInfer left out)"
  fi
  PY=${PY:-python3}
else
  PY=${PY:-python}
fi
[ -n "${TIERED_DECODE_CONFIG:-}" ] && export SGL_KVXFER_TIERED_DECODE_CONFIG="$TIERED_DECODE_CONFIG"
STAGES=${*:-${STAGES:-tests attention ncu e2e}}
say "lowbit: stages [$STAGES] on $DEVICE, setup $(( $(date +%s) - T0 )) s, commit ${SGL_KVXFER_COMMIT:-?}"
[ "$DEVICE" = cuda ] && nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader | tee -a "$LOG"

# Python ignores SIGINT when started in a background job; these entry points restore it.
PYTEST=("$PY" -c "import signal, sys, pytest; signal.signal(signal.SIGINT, signal.default_int_handler); sys.exit(pytest.main(sys.argv[1:]))")

stage() {  # stage NAME LIMIT_S LOGFILE CMD... : run with a time limit, log its time, status and tail
  local name=$1 limit=$2 log=$3 t rc; shift 3
  if [ "$limit" -lt 15 ]; then say "== $name: skipped (${limit} s left of T_TOTAL)"; return; fi
  t=$(date +%s)
  timeout -s INT -k 20 "$limit" "$@" > "$log" 2>&1
  rc=$?
  say "== $name: exit $rc ($([ $rc = 124 ] && echo "stopped at its ${limit} s limit" || echo done)) in $(( $(date +%s) - t )) s"
  tail -n "${TAIL:-40}" "$log" | cut -c1-400 | tee -a "$LOG"
}
lim() { local want=$1 l; l=$(left); echo $(( want < l ? want : l )); }

fi_jit=()
if [ "$DEVICE" = cuda ] && [[ " $STAGES " == *" attention "* ]] && $PY -c "import flashinfer" 2>/dev/null; then
  for m in llama3-8b smollm2; do  # fp16 and fp8 decode modules, built on the CPU while the tests run
    MAX_JOBS=4 $PY benchmarks/kernels/flashinfer_baseline.py --warm-jit cc fp8 --models $m --dtype float16 \
      > "$WORK/lowbit_fi_jit_$m.log" 2>&1 &
    fi_jit+=($!)
  done
fi

for s in $STAGES; do
  case $s in
    tests)
      t=$(date +%s); pids=(); names=()
      # -m gpu: the real-shape tests (on the CPU they all skip: the rehearsal checks collection and
      # imports); test_tier_store.py runs whole (its tests take the GPU when there is one)
      for f in ${TEST_FILES:-test/kernels/test_tiered_pool_decode.py test/kernels/test_paged_fp16_pool_decode.py
               test/kernels/test_tier_store.py test/kernels/test_extend_attention.py
               test/layers/test_triton_tiered_backend.py}; do
        [ -f "$f" ] || continue
        n=$(basename "$f" .py); names+=("$n")
        if [ "$n" = test_tier_store ]; then mark=(); else mark=(-m gpu); fi
        [ -n "${TEST_K:-}" ] && mark+=(-k "$TEST_K")
        timeout -s INT -k 15 "$(lim "${T_TESTS:-120}")" "${PYTEST[@]}" ${mark[@]+"${mark[@]}"} -q -rs -p no:cacheprovider \
          --durations=5 "$f" > "$WORK/lowbit_$n.log" 2>&1 &
        pids+=($!)
      done
      : > "$OUT/tests.log"
      for i in "${!pids[@]}"; do
        wait "${pids[$i]}"; rc=$?
        { echo "======== ${names[$i]}: exit $rc"; cat "$WORK/lowbit_${names[$i]}.log"; } >> "$OUT/tests.log"
        say "== tests ${names[$i]}: exit $rc$([ $rc = 124 ] && echo " (stopped at its limit)"): $(grep -E \
          "passed|failed|error|skipped|no tests ran|deselected" "$WORK/lowbit_${names[$i]}.log" | tail -1)"
        rm -f "$WORK/lowbit_${names[$i]}.log"
      done
      grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | cut -c1-300 | tee -a "$LOG"
      say "== tests: $(( $(date +%s) - t )) s"
      ;;
    attention)
      for p in "${fi_jit[@]}"; do wait "$p"; done
      for m in llama3-8b smollm2; do
        [ -f "$WORK/lowbit_fi_jit_$m.log" ] && { tail -4 "$WORK/lowbit_fi_jit_$m.log" >> "$LOG"; rm -f "$WORK/lowbit_fi_jit_$m.log"; }
      done
      # the sweep (served config first, then in this order; --sweep-budget-s cuts the tail), every
      # point of --sweep-points and every tiered variant (the mix included), each point measured
      # with its own best; all but the served one on 256-token int pages, codes converted in the dot
      # operand layout as subnormals: half tiles for short splits (the Llama-3-8B pick); the
      # Llama-3-8B pick with the fp16 rows split at step granularity (row_splits off: the same-run
      # A/B of the slot-granular splits) and with the merge's next chunk in flight while one is
      # reduced (merge_prefetch: its same-run A/B; more registers, so the batch-1 points may want
      # it and the others not); three programs per SM (the SmolLM2 pick); no split under 2048
      # tokens (batch 1 at 32k gets 16 splits instead of 33, a shorter merge, batch 8 keeps its 4:
      # one config for both); 512-token int4 steps on 8 warps (twice the int4 bytes in
      # flight, as one int8 step); int4 two steps ahead (5 stages: 82 KB, still two programs per SM;
      # 3 and 4 stages both hold one step ahead); four programs per SM (more splits); 64-row fp16
      # steps at 4 warps; int8 tensor cores for q.K; 128-token steps at three per SM
      # first the served Llama-3-8B knobs in one launch over all tiers (one_launch: its same-run
      # A/B against the served row), then the served knobs at 64-token int pages (the engine's
      # default page) without and with one_launch
      default_configs='[{"int_page": 256, "dot_cvt": true, "sub_cvt": true, "min_steps": 8, "stages4": 5, "row_splits": false, "one_launch": true},
        {"int_page": 64, "dot_cvt": true, "sub_cvt": true, "min_steps": 8, "stages4": 5, "row_splits": false},
        {"int_page": 64, "dot_cvt": true, "sub_cvt": true, "min_steps": 8, "stages4": 5, "row_splits": false, "one_launch": true},
        {"int_page": 256, "dot_cvt": true, "sub_cvt": true, "min_steps": 8},
        {"int_page": 256, "dot_cvt": true, "sub_cvt": true, "min_steps": 8, "stages4": 5, "row_splits": false},
        {"int_page": 256, "dot_cvt": true, "sub_cvt": true, "min_steps": 8, "stages4": 5, "merge_prefetch": true},
        {"int_page": 256, "dot_cvt": true, "sub_cvt": true, "warps16": 4, "split_waves": 3},
        {"int_page": 256, "dot_cvt": true, "sub_cvt": true, "min_steps": 8, "min_split_tokens": 2048},
        {"int_page": 256, "dot_cvt": true, "sub_cvt": true, "min_steps": 8, "tile4": 512, "warps4": 8},
        {"int_page": 256, "dot_cvt": true, "sub_cvt": true, "min_steps": 8, "stages4": 5},
        {"int_page": 256, "dot_cvt": true, "sub_cvt": true, "min_steps": 8, "split_waves": 4},
        {"int_page": 256, "dot_cvt": true, "sub_cvt": true, "min_steps": 8, "tile16": 64, "warps16": 4, "stages16": 4},
        {"int_page": 256, "dot_cvt": true, "sub_cvt": true, "min_steps": 8, "qk_int8": true},
        {"int_page": 256, "dot_cvt": true, "sub_cvt": true, "tile8": 128, "tile4": 128, "tile16": 128, "warps16": 4,
         "split_waves": 3}]'
      if [ "$DEVICE" = cuda ]; then
        args=(--points ${ATTN_POINTS:-llama3-8b:8:32768 llama3-8b:1:32768 smollm2:8:32768 llama3-8b:8:16384
              llama3-8b:8:131072 llama3-8b:32:32768 llama3-8b:1:16384 llama3-8b:8:65536 llama3-8b:1:131072
              llama3-8b:32:16384 llama3-8b:1:65536 llama3-8b:32:65536 llama3-8b:32:131072}
              --sweep-points ${SWEEP_POINTS:-llama3-8b:8:32768 llama3-8b:1:32768 smollm2:8:32768}
              --sweep-budget-s "${T_SWEEP:-75}" --iters 10)
      else
        args=(--device cpu --points smollm2:1:128 --iters 1 --sweep-points smollm2:1:128)
        default_configs='[{"qk_int8": true}, {"int_page": 32, "tile8": 32, "tile4": 32}, {"dot_cvt": true, "sub_cvt": true},
          {"dot_cvt": true, "min_steps": 8}]'
      fi
      stage attention "$(lim "${T_ATTN:-270}")" "$OUT/attention.log" "$PY" benchmarks/kernels/attention.py \
        --out-dir "$OUT" "${args[@]}" --sweep-configs --configs "${CONFIGS:-$default_configs}"
      # a later call on this warm machine (the e2e call) serves the sweep's choice from here
      # (the device machine's /tmp outlives the call while the machine stays warm; never on the CPU)
      for f in "$OUT"/attention_*.json; do
        [ -f "$f" ] && cp "$f" $WORK/lowbit_attention.json && { [ "$DEVICE" != cuda ] || cp "$f" /tmp/lowbit_sweep.json; }
      done
      ;;
    ncu)
      if [ "$DEVICE" != cuda ]; then say "== ncu: CUDA only"; continue; fi
      if ! command -v ncu > /dev/null; then
        for d in /usr/local/cuda/bin /usr/local/cuda-*/bin /opt/nvidia/nsight-compute/*; do
          [ -x "$d/ncu" ] && { export PATH="$d:$PATH"; break; }
        done
      fi
      say "== ncu: $(command -v ncu || echo 'not found')"
      best=$($PY -c "
import json, sys
try:
    d = json.load(open(sys.argv[1]))
    b = [x['config'] for x in (d.get('sweep') or {}).get('best', []) if x['model'] == 'llama3-8b']
    print(json.dumps(b[0]) if b and b[0] != 'served' else '')
except Exception:
    print('')" "$(ls "$OUT"/attention_*.json 2>/dev/null | head -1)" 2>/dev/null)
      stage ncu "$(lim "${T_NCU:-60}")" $WORK/lowbit_ncu.log "$PY" benchmarks/kernels/ncu_decode.py --out-dir "$OUT" \
        --point "${NCU_POINT:-llama3-8b:8:32768}" --variants ${NCU_VARIANTS:-int8 int4 fp16} --timeout "$(( $(lim "${T_NCU:-60}") - 5 ))" ${best:+--config "$best"}
      rm -f $WORK/lowbit_ncu.log
      ;;
    e2e)
      page=()
      [ -n "${E2E_PAGE:-}" ] && page=(--kv-tier-page-size "$E2E_PAGE")
      attn=$(ls "$OUT"/attention_*.json 2>/dev/null | head -1)
      [ -z "$attn" ] && [ -f $WORK/lowbit_attention.json ] && attn=$WORK/lowbit_attention.json
      [ -z "$attn" ] && [ "$DEVICE" = cuda ] && [ -f /tmp/lowbit_sweep.json ] && attn=/tmp/lowbit_sweep.json
      if [ -z "${TIERED_DECODE_CONFIG:-}" ] && [ -z "${E2E_PAGE:-}" ] && [ -n "$attn" ]; then
        # serve the attention sweep's best Llama-3-8B config (its int page included) in the engine
        read -r cfg pg < <($PY -c "
import json, sys
d = json.load(open(sys.argv[1]))
b = [x['config'] for x in (d.get('sweep') or {}).get('best', []) if x['model'] == 'llama3-8b']
c = b[0] if b and b[0] != 'served' else {}
pg = c.pop('int_page', '')
print(json.dumps(c, separators=(',', ':')) if c else '-', pg or '-')" "$attn" 2>/dev/null)
        [ -n "${cfg:-}" ] && [ "$cfg" != - ] && export SGL_KVXFER_TIERED_DECODE_CONFIG="$cfg"
        [ -n "${pg:-}" ] && [ "$pg" != - ] && page=(--kv-tier-page-size "$pg")
        say "== e2e: tiered decode config ${SGL_KVXFER_TIERED_DECODE_CONFIG:-served}, int page ${pg:-default}"
      fi
      if [ "$DEVICE" = cuda ]; then
        args=(--preset llama-3-8b --context ${E2E_CONTEXTS:-16384} --batch ${E2E_BATCHES:-8}
              --n1 "${E2E_N1:-16}" --n2 "${E2E_N2:-272}" --repeats "${E2E_REPEATS:-1}")
      else
        args=(--device cpu --preset tiny --context 64 --batch 2 --n1 1 --n2 2 --repeats 1)
      fi
      if [ "$(lim "${T_E2E:-600}")" -lt "${E2E_MIN:-200}" ]; then  # an engine point takes ~1-2 min
        say "== e2e: skipped, $(left) s left (< E2E_MIN ${E2E_MIN:-200}): run it as its own call"
        continue
      fi
      stage e2e "$(lim "${T_E2E:-600}")" $WORK/lowbit_e2e.log "$PY" benchmarks/throughput/e2e_decode.py --out-dir "$OUT" \
        "${args[@]}" ${page[@]+"${page[@]}"} --kv-tier-budgets ${E2E_BUDGETS:-0.5 0.25 1.0} ${E2E_ARGS:-}
      grep -E "tok/s|breakdown|skipped|error" $WORK/lowbit_e2e.log | cut -c1-400 >> "$LOG"
      rm -f $WORK/lowbit_e2e.log
      ;;
    *) say "unknown stage '$s' (tests attention ncu e2e)" ;;
  esac
done
say "lowbit: total $(( $(date +%s) - T0 )) s; \$OUT holds $(ls "$OUT" | wc -l) files: $(ls "$OUT" | tr '\n' ' ')"
