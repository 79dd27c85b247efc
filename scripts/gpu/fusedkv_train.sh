#!/usr/bin/env bash
# On the GPU machine: FusedKV from scratch (benchmarks/fusedkv/train.py: vanilla / FusedKV / Lite)
# and the SmolLM2 retrofit (benchmarks/fusedkv/retrofit.py), results into $OUT.
#   bash scripts/gpu/fusedkv_train.sh [all|train|retrofit]
# Carry .cache/fusedkv (python benchmarks/fusedkv/data.py, 3.6 MB of tokens). The retrofit also
# needs the real SmolLM2: stage_weights.sh first (carry .carry_a), then this with .carry_b and .whl
# (env.sh joins and converts the GGUF). Two calls, each under the 10-minute limit:
#   run carry [.carry_a, .cache/fusedkv]        bash scripts/gpu/stage_weights.sh && bash scripts/gpu/fusedkv_train.sh train
#   run carry [.carry_b, .whl, .cache/fusedkv]  bash scripts/gpu/fusedkv_train.sh retrofit
# Each stage runs under `timeout` (TRAIN_TIMEOUT / RETROFIT_TIMEOUT s) with its own time budget
# (TRAIN_BUDGET / RETROFIT_BUDGET s, inside the scripts); a failed stage does not stop the other.
# $OUT gets at most 6 files: the JSONs and PNGs, the retrofit's weights file, logs.tar.gz.
# CPU smoke run: OUT=/tmp/x DEVICE=cpu TRAIN_ARGS="--preset toy" RETROFIT_ARGS="--preset toy" \
#   bash scripts/gpu/fusedkv_train.sh all
set -uo pipefail
stage=${1:-all}
case $stage in all|train|retrofit) ;; *) sed -n '2,16p' "$0"; exit 2 ;; esac
export OUT=${OUT:-/tmp/out} PYTHONUNBUFFERED=1
DEVICE=${DEVICE:-cuda}
TRAIN_TIMEOUT=${TRAIN_TIMEOUT:-420} TRAIN_BUDGET=${TRAIN_BUDGET:-300}
RETROFIT_TIMEOUT=${RETROFIT_TIMEOUT:-330} RETROFIT_BUDGET=${RETROFIT_BUDGET:-200}
mkdir -p "$OUT"
work=$(mktemp -d /tmp/fusedkv_run.XXXX)
if [ ! -f .cache/fusedkv/meta.json ]; then echo "no .cache/fusedkv: run python benchmarks/fusedkv/data.py here and carry it" >&2; exit 2; fi
# No network there, so no editable install: the repo root on the path plus a kernels link (as env.sh).
[ -e sgl_kvxfer/kernels ] || ln -s ../kernels sgl_kvxfer/kernels
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
[ "$DEVICE" = cuda ] && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader

if [ "$stage" != retrofit ]; then
  echo "== train ($(date +%T))"
  timeout "$TRAIN_TIMEOUT" python3 benchmarks/fusedkv/train.py --device "$DEVICE" --out-dir "$work" \
      --time-budget-s "$TRAIN_BUDGET" ${TRAIN_ARGS:-} 2>&1 | tee "$work/train.log" || true
fi
if [ "$stage" != train ]; then
  echo "== retrofit ($(date +%T))"
  if [ "$DEVICE" = cuda ]; then
    # wheels + the embedded model converted from the staged GGUF halves into /tmp/models
    source scripts/gpu/env.sh > "$work/env.log" 2>&1 || { echo "env.sh failed:"; tail -20 "$work/env.log"; }
  fi
  timeout "$RETROFIT_TIMEOUT" python3 benchmarks/fusedkv/retrofit.py --device "$DEVICE" --out-dir "$work" \
      --time-budget-s "$RETROFIT_BUDGET" ${RETROFIT_ARGS:-} 2>&1 | tee "$work/retrofit.log" || true
fi
echo "== done ($(date +%T))"
cp "$work"/*.json "$work"/*.png "$work"/*.safetensors "$OUT"/ 2>/dev/null
tar -czf "$OUT/fusedkv_logs.tar.gz" -C "$work" $(cd "$work" && ls *.log)
rm -rf "$work"
ls -la "$OUT"
