#!/usr/bin/env bash
# The cold tier's decode cost and its GPU tests, results in $OUT. Stages (arguments, default both):
#   tests   test/kernels/test_cold_mass.py, test/kernels/test_tier_relocate.py,
#           test/spectrum/test_cold_tier_scoring.py and the cold tier's CUDA promotion test
#           (T_TESTS 150 s); the pytest log in $OUT/gpu_tests_cold_tier.txt
#   decode  benchmarks/throughput/cold_tier_decode.py at the Llama-3-8B shape (dummy weights),
#           16k x 8, b = 0.2, triton backend, CUDA graphs: off, on@16, on@4, uncapped@16, the
#           synchronized breakdown, 5 repeats (T_DECODE 200 s, its time budget 10 s less); its
#           JSON and log in $OUT
# Each stage runs under `timeout -s INT` and keeps what it measured (the benchmark rewrites its
# JSON after every phase and repeat).
# GPU, one call (kind nvidia-h100-x1, carry [.whl], about 6 minutes with the machine's start-up):
#   bash scripts/gpu/cold_tier_cost.sh
# CPU rehearsal (tiny preset, torch backend, a minute):
#   DEVICE=cpu OUT=/tmp/x bash scripts/gpu/cold_tier_cost.sh decode
set -uo pipefail
stages=" ${*:-tests decode} "
for s in $stages; do
  case $s in tests|decode) ;; *) sed -n '2,17p' "$0"; exit 2 ;; esac
done
export OUT=${OUT:-/tmp/out} PYTHONUNBUFFERED=1
DEVICE=${DEVICE:-cuda}
T_TESTS=${T_TESTS:-150} T_DECODE=${T_DECODE:-200}
mkdir -p "$OUT"
if [ "$DEVICE" = cuda ]; then
  # shellcheck disable=SC1091
  source scripts/gpu/env.sh || exit 1
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi

if [[ $stages == *" tests "* ]]; then
  echo "== tests ($(date +%T))"
  timeout -s INT -k 10 "$T_TESTS" python3 -m pytest -q test/kernels/test_cold_mass.py test/kernels/test_tier_relocate.py \
      test/spectrum/test_cold_tier_scoring.py "test/spectrum/test_cold_tier.py::test_promotion_on_cuda_is_async_and_exact" \
      2>&1 | tail -30 | tee "$OUT/gpu_tests_cold_tier.txt"
fi

if [[ $stages == *" decode "* ]]; then
  echo "== decode ($(date +%T))"
  if [ "$DEVICE" = cuda ]; then
    args="--device cuda --preset llama-3-8b --context 16384 --batch 8 --kv-tier-budget 0.2 --n1 16 --n2 80
          --repeats 5 --intervals 16 4 --uncapped"
  else
    args="--device cpu --backend torch --preset tiny --context 128 --batch 2 --n1 4 --n2 12 --repeats 2
          --intervals 4 2 --uncapped"
  fi
  # shellcheck disable=SC2086
  timeout -s INT -k 10 "$T_DECODE" python3 benchmarks/throughput/cold_tier_decode.py $args \
      --time-budget-s $(( T_DECODE - 10 )) --out-dir "$OUT" 2>&1 | tee "$OUT/cold_tier_decode.log" | grep -v "^\[transformers\]"
fi
echo "== done ($(date +%T))"
ls -la "$OUT"
