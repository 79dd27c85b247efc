#!/usr/bin/env bash
# SCD's quality evidence in one GPU call (after stage_weights.sh): fine-tune three specialists of
# SmolLM2-135M-Instruct on the task suite (full fine-tune, time-limited), calibrate SCD with nested
# rank levels, then the quality table, rank sweep, drift and adaptive-rank sweep
# (benchmarks/quality/scd_eval.py). The specialists' weights are built here and never leave.
#
#   GPU call 1:  carry [.carry_a]          bash scripts/gpu/stage_weights.sh
#   GPU call 2:  carry [.carry_b, .whl]    SGL_KVXFER_COMMIT=<hash> bash scripts/gpu/scd_quality.sh
#   CPU rehearsal (tiny random base, the same stages at toy sizes):
#                DEVICE=cpu OUT=<dir> bash scripts/gpu/scd_quality.sh
#
# Back in $OUT (6 files): specialists.tar (train_log.json + loss.png per specialist, no weights),
# calibration.json, scd_eval_<device>.json / .png, stages.json (wall time and exit code per stage),
# scd_quality.log. Every stage runs under `timeout -s INT`; a failed stage does not stop the next.
set -uo pipefail
cd "$(dirname "$0")/../.."
DEVICE=${DEVICE:-cuda}
T0=$(date +%s)
export OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if [ "$DEVICE" = cuda ]; then
  source scripts/gpu/env.sh || exit 1
else
  export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
fi
exec > >(tee -a "$OUT/scd_quality.log") 2>&1
W=$(mktemp -d "${TMPDIR:-/tmp}/scd_quality.XXXXXX")
trap 'rm -rf "$W"' EXIT
SPECIALISTS="qa kv code"
if [ "$DEVICE" = cuda ]; then
  BASE=smollm2-135m
  TRAIN="--method full --steps 3000 --time-limit-s ${T_TRAIN_EACH:-65} --batch-size 32 --lr 2e-4 --warmup 30 --eval-n 50 --device cuda"
  CALIB="--r-k 16 --r-v 48 --rank-levels 2:6,4:12,8:24 --r-h 96 --patch-budget auto --k-min 2 --k-max 6
         --num-prefixes 384 --batch-size 32 --select-prompts 48 --aligner-hidden 512 --aligner-steps 4000
         --aligner-patience 4 --aligner-time-s 6 --aligner-tokens 65536 --storage-dtype float16 --device cuda"
  EVAL="--n 100 --batch-size 50 --device cuda"
  T_TRAIN=$(( ${T_TRAIN_EACH:-65} + 40 )); T_CAL=150; WALL=${WALL:-530}
else
  BASE=$W/base
  python3 scripts/train/make_tiny_model.py --out "$BASE" --layers 4 --hidden 32 --heads 2 --kv-heads 1 --intermediate 64 || exit 1
  TRAIN="--method full --steps 2 --batch-size 2 --lr 1e-3 --warmup 1 --eval-n 1 --device cpu --save-dtype float32"
  CALIB="--r-k 8 --r-v 8 --rank-levels 2:2,4:4 --r-h 16 --patch-budget 1 --pool 2 --num-prefixes 6 --batch-size 3
         --select-prompts 3 --aligner-hidden 16 --aligner-steps 20 --aligner-tokens 256 --device cpu"
  EVAL="--quick --device cpu"
  T_TRAIN=900; T_CAL=1200; WALL=5400
fi

echo "{" > "$W/stages.json"
stage() {  # stage NAME TIMEOUT_S CMD...: run, time, record
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s.%N)
  echo "=== $name: $*"
  timeout -s INT -k 20 "$limit" "$@"
  local rc=$? t1=$(date +%s.%N)
  local wall=$(python3 -c "print(round($t1 - $t0, 1))")
  echo "=== $name: rc=$rc wall=${wall}s"
  echo "  \"$name\": {\"rc\": $rc, \"wall_s\": $wall}," >> "$W/stages.json"
}

CONSUMERS=""
for s in $SPECIALISTS; do
  stage "train_$s" $T_TRAIN python3 scripts/train/finetune.py --model "$BASE" --mix "$s=1" --out "$W/specialists/$s" $TRAIN
  CONSUMERS="$CONSUMERS --consumer $s=$W/specialists/$s"
done
stage calibrate $T_CAL python3 -m sgl_kvxfer.scd.calib --producer "$BASE" $CONSUMERS \
  --calib task:qa task:kv task:code --out "$W/artifacts" --save-stats $CALIB
T_EVAL=$(( WALL - ($(date +%s) - T0) )); [ $T_EVAL -lt 60 ] && T_EVAL=60
# the rank sweep stops starting levels 30 s before the eval's timeout (the table comes first)
stage eval $T_EVAL python3 benchmarks/quality/scd_eval.py --artifacts "$W/artifacts" --out-dir "$W/results" \
  --time-budget-s $(( T_EVAL - 30 )) $EVAL
echo "  \"device\": \"$DEVICE\"}" >> "$W/stages.json"

cp "$W/stages.json" "$OUT/stages.json"
[ -f "$W/artifacts/calibration.json" ] && cp "$W/artifacts/calibration.json" "$OUT/"
(cd "$W" && tar -cf "$OUT/specialists.tar" specialists/*/train_log.json specialists/*/loss.png 2>/dev/null)
cp "$W"/results/scd_eval_* "$OUT/" 2>/dev/null
ls -la "$OUT"
