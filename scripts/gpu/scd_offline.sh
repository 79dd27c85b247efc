#!/usr/bin/env bash
# SCD's offline side in one GPU call: train the code and prose specialists (LoRA), calibrate the
# producer (SmolLM2-135M-Instruct) against both, the drift report, and the quality harness.
#
#   here, once:  bash scripts/gpu/scd_offline.sh prepare
#                  -> .cache/scd_data/{code,prose}_{train,calib,eval}.jsonl.gz (5.2 MB, git-ignored)
#   GPU call 1:  carry [.carry_a]                           bash scripts/gpu/stage_weights.sh
#   GPU call 2:  carry [.carry_b, .whl, .cache/scd_data]    SGL_KVXFER_COMMIT=<hash> bash scripts/gpu/scd_offline.sh
#   CPU toy run: OUT=$(mktemp -d) DEVICE=cpu bash scripts/gpu/scd_offline.sh    (tiny sizes, same stages)
#
# Back in $OUT (7 files): specialists.tar (scripts/scd/specialists/{code,prose}: adapter
# safetensors + config, train_log.json, loss.png), artifacts.tar (artifacts/: manifest.json,
# producer.safetensors, calibration.json) plus consumer_code.safetensors and
# consumer_prose.safetensors (they belong in that artifacts/ dir), results.tar
# (scd_drift_*.json/png, scd_eval_*.json/png, calibration.json), stages.json (wall time and exit
# code per stage), scd_offline.log.
# SKIP_TRAIN=1 reuses the adapters already in scripts/scd/specialists/. Every stage runs under a
# timeout and a failed stage does not stop the next ones.
set -uo pipefail
cd "$(dirname "$0")/../.."

if [ "${1:-}" = prepare ]; then
  src=${SGL_KVXFER_SCD_DATA:-../shared/data}
  mkdir -p .cache/scd_data
  for c in code prose; do for s in train calib eval; do
    gzip -9 -c "$src/${c}_${s}.jsonl" > ".cache/scd_data/${c}_${s}.jsonl.gz" || exit 1
  done; done
  du -sh .cache/scd_data && exit 0
fi

DEVICE=${DEVICE:-cuda}
T0=$(date +%s)
export OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if [ "$DEVICE" = cuda ]; then
  source scripts/gpu/env.sh || exit 1
else
  export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
fi
[ -d .cache/scd_data ] && [ ! -d ../shared/data ] && export SGL_KVXFER_SCD_DATA=$PWD/.cache/scd_data
exec > >(tee -a "$OUT/scd_offline.log") 2>&1

W=$(mktemp -d); trap 'rm -rf "$W"' EXIT; mkdir -p "$W/results"  # what comes back is copied to $OUT
ART=$W/artifacts
SPEC=scripts/scd/specialists  # the GPU machine's copy of the repo; a CPU toy run must not overwrite it
[ "$DEVICE" = cuda ] || SPEC=$W/specialists
if [ "$DEVICE" = cuda ]; then
  TRAIN="--steps 400 --batch-size 16 --seq-len 512 --device cuda --time-budget-s 110"
  CALIB="--r-k 16 --r-v 48 --r-h 192 --patch-budget auto --k-min 4 --k-max 8 --prefix-len 512 --num-prefixes 192
         --batch-size 16 --select-prompts 32 --select-prefix 384 --select-cont 64 --aligner-hidden 512
         --aligner-steps 500 --aligner-tokens 65536 --storage-dtype float16 --device cuda"
  DRIFT="--windows 24 --window 512 --device cuda"
  EVAL="--device cuda"
  T_TRAIN=150; T_CAL=150; T_DRIFT=60; WALL=570  # one call may run 600 s: eval gets what is left of WALL
else
  TRAIN="--steps 2 --batch-size 1 --seq-len 32 --device cpu --dtype float32"
  CALIB="--r-k 8 --r-v 8 --r-h 16 --patch-budget 1 --pool 2 --prefix-len 48 --num-prefixes 4 --batch-size 4
         --select-prompts 2 --select-prefix 24 --select-cont 6 --aligner-hidden 16 --aligner-steps 5
         --aligner-tokens 128 --device cpu"
  DRIFT="--quick --device cpu"
  EVAL="--quick --device cpu --batch-size 4"
  T_TRAIN=900; T_CAL=1200; T_DRIFT=900; WALL=5400
fi

echo "{" > "$W/stages.json"
stage() {  # stage NAME TIMEOUT_S CMD...: run, time, record
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s.%N)
  echo "=== $name: $*"
  timeout "$limit" "$@"
  local rc=$? t1=$(date +%s.%N)
  local wall=$(python3 -c "print(round($t1 - $t0, 1))")
  echo "=== $name: rc=$rc wall=${wall}s"
  echo "  \"$name\": {\"rc\": $rc, \"wall_s\": $wall}," >> "$W/stages.json"
}

if [ "${SKIP_TRAIN:-0}" != 1 ]; then
  for s in code prose; do
    stage "train_$s" $T_TRAIN python3 scripts/scd/train_specialist.py --name $s --data $s --out-dir $SPEC/$s $TRAIN
  done
fi
stage calibrate $T_CAL python3 -m sgl_kvxfer.scd.calibrate --consumer code=$SPEC/code --consumer prose=$SPEC/prose \
  --calib code prose --out "$ART" --save-stats $CALIB
stage drift $T_DRIFT python3 benchmarks/quality/scd_drift.py --specialist code=$SPEC/code --specialist prose=$SPEC/prose \
  --out-dir "$W/results" $DRIFT
T_EVAL=$(( WALL - ($(date +%s) - T0) )); [ $T_EVAL -lt 60 ] && T_EVAL=60
# the rank grid stops starting points 45 s before the eval's timeout (QA + PPL come first)
stage eval $T_EVAL python3 benchmarks/quality/scd_eval.py --artifacts "$ART" --out-dir "$W/results" \
  --time-budget-s $(( T_EVAL - 45 )) $EVAL
echo "  \"device\": \"$DEVICE\"}" >> "$W/stages.json"

cp "$W/stages.json" "$OUT/stages.json"
[ -f "$ART/calibration.json" ] && cp "$ART/calibration.json" "$W/results/"
if [ "$DEVICE" = cuda ]; then tar -cf "$OUT/specialists.tar" $SPEC/code $SPEC/prose
else tar -cf "$OUT/specialists.tar" -C "$W" specialists; fi
if [ -d "$ART" ]; then  # each consumer's file alone (aligners make them ~10 MB; 16 MiB per file back)
  tar -cf "$OUT/artifacts.tar" -C "$W" --exclude=reuse_stats.safetensors --exclude='consumer_*.safetensors' artifacts
  cp "$ART"/consumer_*.safetensors "$OUT/"
fi
tar -cf "$OUT/results.tar" -C "$W" results
ls -la "$OUT"
