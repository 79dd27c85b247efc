#!/usr/bin/env bash
# SCD's quality evidence in one GPU call (after stage_weights.sh): fine-tune three specialists of
# SmolLM2-135M-Instruct on the task suite (full fine-tune, time-limited), calibrate SCD with nested
# rank levels, then the quality table, rank sweep, drift and adaptive-rank sweep
# (benchmarks/quality/scd_eval.py). The specialists' weights are built here and never leave.
#
#   GPU calls 1-2: carry [.carry_a], then [.carry_b]: bash scripts/gpu/stage_weights.sh, then ... add
#   GPU call 2b: carry [.carry_c]          bash scripts/gpu/stage_weights.sh join
#   GPU call 3:  carry [.whl]              SGL_KVXFER_COMMIT=<hash> bash scripts/gpu/scd_quality.sh
#   GPU call 4 (optional, same warm machine, right after call 3 run with WORK=DIR):
#                carry [.whl]  REFINE=1 WORK=DIR SGL_KVXFER_COMMIT=<hash> bash scripts/gpu/scd_quality.sh
#                the aligners of call 3's calibration train on from their saved state for what
#                the eval's minimum leaves of WALL (python -m sgl_kvxfer.scd.calib.refine: same
#                calib tokens, same held-out split), then the eval runs again on the refined
#                artifacts; repeat it for more aligner time (SKIP_EVAL=1 T_EVAL_MIN=0 on all but the
#                last such call gives the aligners the whole WALL)
#   EVAL_ONLY=1 WORK=DIR (same warm machine): the eval alone on the artifacts in DIR, e.g. after a
#                call with SKIP_EVAL=1 T_EVAL_MIN=0 that gave calibration the whole WALL
#   NUM_PREFIXES (768) and ALIGNER_TOKENS (262144): the calibration's paired prefixes (task items,
#                about 390 tokens each) and the tokens sampled from them for the aligners; GPU
#                memory of the aligner pass grows with ALIGNER_TOKENS (by its tensors' sizes about
#                80 GB at 786432: an H200's, not an 80 GB card's)
#   EVAL_N (100): held-out items per task the eval scores (300 on an H200: about 225 s)
#   SELECT_PROMPTS (48): held-out items the layer selection scores; CODE_DTYPE (bfloat16): the
#                codes' wire dtype at calibration (int8 / int4: the aligners train on the rounded
#                codes, and the table's SCD rows send them); CODE_SCALE (auto): --code-scale, unit =
#                every code column at unit variance (calib/fit.py), none = the principal
#                components' own scale, auto = unit for int4 codes, none otherwise
#   R_K, R_V (32, 64), RANK_LEVELS (4:12,8:28,16:48): the calibration's top rank per kv head and
#                its nested levels (--r-k, --r-v, --rank-levels)
#   R_H (128), ALIGNER_HIDDEN (512), PATCH_BUDGET (6): a Patch layer's hidden-state code rank (R_H
#                values a token at the code dtype's width), the aligners' MLP width, and how many
#                layers are patched (--patch-budget and --k-max)
#   GEN_STEPS (0: off): first fine-tune a generalist producer from the base on the mixed suite
#                (GEN_MIX, default qa=1,kv=1,code=1) for GEN_STEPS steps at GEN_LR (5e-5), then
#                every specialist from it and the generalist as the producer: the paper's pair (a
#                model that already reads the documents, and fine-tunes of it), where the plain
#                base reads none of the suite's documents the way its specialists learn to
#   CPU rehearsal (tiny random base, the same stages at toy sizes):
#                DEVICE=cpu OUT=<dir> bash scripts/gpu/scd_quality.sh
#                (WORK=<dir> keeps the specialists and artifacts; then REFINE=1 with the same WORK)
#
# Time shares of WALL (default 540 s from the start): on a GPU the three specialists train side by
# side (PARALLEL_TRAIN=1), T_TRAIN_EACH (100) s each plus 40 s of loading and held-out scoring;
# calibration what is left minus T_EVAL_MIN (180 s); its six Patch layers' aligners (3 consumers
# each: 18 aligners) train in ONE stacked pass (--aligner-joint) over what its earlier stages leave,
# so each layer gets the whole pass rather than a sixth of it; the eval the rest. The eval's table
# includes the diagnostic scd-oracle-patch row, and its sweep SCD and Reuse-only at every level
# with bf16 and int4 codes (scd_eval.py --code-quant; the sweep starts a consumer only when
# the time its methods took says it ends inside the budget). testbeds_x2.sh passes WALL = its own
# WALL less its set-up, less 20 s.
#
# Back in $OUT (6 files): specialists.tar (train_log.json + loss.png per specialist and generalist, no weights),
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
if [ -n "${WORK:-}" ]; then  # kept for a later call on the same machine (REFINE=1)
  W=$WORK; mkdir -p "$W"
else
  W=$(mktemp -d "${TMPDIR:-/tmp}/scd_quality.XXXXXX")
  trap 'rm -rf "$W"' EXIT
fi
if { [ "${REFINE:-0}" = 1 ] || [ "${EVAL_ONLY:-0}" = 1 ]; } && [ ! -f "$W/artifacts/calibration.json" ]; then
  echo "REFINE=1 / EVAL_ONLY=1: no calibration in $W/artifacts (run this script with the same WORK first)"; exit 1
fi
SPECIALISTS="qa kv code"
case "${GEN_STEPS:-0}" in ''|*[!0-9]*) echo "GEN_STEPS must be a step count (0: no generalist), got '$GEN_STEPS'"; exit 2 ;; esac
if [ "$DEVICE" = cuda ]; then
  # the host's cores are shared (three trainings here, other parts beside): no 16-thread pools each
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
  BASE=smollm2-135m
  # TRAIN_LR (5e-5): at 2e-4 each task's loss is under 0.3 within 15 steps and the specialists
  # drift so far that raw producer KV keeps under a quarter of the oracle's score; a lower rate
  # keeps their K/V closer to the base (the drift table of scd_eval.py), but at 2e-5 raw producer
  # KV still kept about a quarter (0.232 of 0.883; sgl_kvxfer/scd/README.md, "Specialists nearer
  # the base")
  TRAIN="--method full --steps 3000 --time-limit-s ${T_TRAIN_EACH:-100} --batch-size 32 --lr ${TRAIN_LR:-5e-5} --warmup 30 --eval-n 50 --device cuda"
  GEN_TRAIN="--method full --steps ${GEN_STEPS:-0} --batch-size 32 --lr ${GEN_LR:-5e-5} --warmup 10 --eval-n 50 --device cuda"
  # Top level 32:64 (V at full rank: Reuse there is the ridge translator with no truncation) over
  # nested 4:12 / 8:28 / 16:48, so the sweep reaches past the point where Reuse meets raw KV
  # (8:28 with six Patch layers: 6720 B/token, the most within int4 of raw KV's 7200; 16:48 with
  # int4 codes: 2796 B/token, under 1/8 of raw KV's 23040); six Patch layers from the greedy
  # order (the paper's k = 6: the auto rule picks k_min here, one layer dominating the gain).
  # Aligners: all six layers in one stacked pass over the time calibration's earlier stages
  # leave (--aligner-joint; layer by layer at 25 s each, every aligner's best step was its last),
  # 8192-token steps on 1/3 more sampled tokens, the loss weighted towards the consumer's own K/V
  # (--aligner-h-weight 0.25: the K/V term is the error attention reads; the hidden-state term
  # keeps the rest of h in check); patience 40 checks (2000 steps) for the larger, less noisy steps
  CALIB="--r-k ${R_K:-32} --r-v ${R_V:-64} --rank-levels ${RANK_LEVELS:-4:12,8:28,16:48} --r-h ${R_H:-128} --patch-budget ${PATCH_BUDGET:-6} --k-max ${PATCH_BUDGET:-6}
         --num-prefixes ${NUM_PREFIXES:-768} --batch-size 32 --select-prompts ${SELECT_PROMPTS:-48} --aligner-hidden ${ALIGNER_HIDDEN:-512} --aligner-steps 200000
         --aligner-joint --aligner-batch 8192 --aligner-lr ${ALIGNER_LR:-0.002} --aligner-h-weight 0.25
         --aligner-patience 40 --aligner-time-s 400 --aligner-tokens ${ALIGNER_TOKENS:-262144} --storage-dtype float16 --code-dtype ${CODE_DTYPE:-bfloat16}
         --code-scale ${CODE_SCALE:-auto} --device cuda"
  # int4 codes only (CODE_QUANT="int4 int8" adds the int8 rows): every level of them, 4:12 to
  # 32:64, lands between 1788 and 3948 B/token, the region of the 1/8-of-raw-KV (2880) target
  EVAL="--n ${EVAL_N:-100} --batch-size 50 --code-quant ${CODE_QUANT:-int4} --device cuda"
  T_TRAIN=$(( ${T_TRAIN_EACH:-100} + 40 )); WALL=${WALL:-540}; PARALLEL_TRAIN=${PARALLEL_TRAIN:-1}
  # the table's methods for 3 x EVAL_N items, drift and timings, then the sweep (6 bf16 + 8
  # int4-code variants per consumer)
  T_EVAL_MIN=${T_EVAL_MIN:-180}
else
  BASE=$W/base
  [ -f "$BASE/config.json" ] || python3 scripts/train/make_tiny_model.py --out "$BASE" --layers 4 --hidden 32 --heads 2 \
    --kv-heads 1 --intermediate 64 || exit 1
  TRAIN="--method full --steps 2 --batch-size 2 --lr 1e-3 --warmup 1 --eval-n 1 --device cpu --save-dtype float32"
  GEN_TRAIN="--method full --steps ${GEN_STEPS:-0} --batch-size 2 --lr 1e-3 --warmup 1 --eval-n 1 --device cpu --save-dtype float32"
  CALIB="--r-k 8 --r-v 8 --rank-levels 2:2,4:4 --r-h 16 --patch-budget 2 --pool 2 --num-prefixes 6 --batch-size 3
         --select-prompts 3 --aligner-hidden 16 --aligner-steps 20 --aligner-tokens 256 --aligner-joint
         --aligner-batch 64 --aligner-h-weight 0.25 --device cpu"
  EVAL="--quick --device cpu"
  T_TRAIN=900; WALL=5400; T_EVAL_MIN=1200  # toy sizes on a slow shared CPU: no device budget to keep
fi
left() { echo $(( WALL - ($(date +%s) - T0) )); }
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

if [ "${EVAL_ONLY:-0}" = 1 ]; then
  echo "=== EVAL_ONLY=1: the artifacts in $W/artifacts as they are"
elif [ "${REFINE:-0}" = 1 ]; then
  # the aligners of the calibration in $W/artifacts train on from where they stopped; the
  # specialists and the Reuse fits stay (sgl_kvxfer/scd/calib/refine.py)
  T_REF=$(( $(left) - T_EVAL_MIN )); [ $T_REF -lt 60 ] && T_REF=60
  stage refine $T_REF python3 -m sgl_kvxfer.scd.calib.refine --artifacts "$W/artifacts" \
    --time-budget-s $(( T_REF - 15 )) ${ALIGNER_LR:+--aligner-lr $ALIGNER_LR}
else
  if [ "${GEN_STEPS:-0}" -gt 0 ]; then  # the generalist producer; the specialists start from it
    stage train_generalist $(( T_TRAIN + 60 )) python3 scripts/train/finetune.py --model "$BASE" \
      --mix "${GEN_MIX:-qa=1,kv=1,code=1}" --out "$W/specialists/generalist" $GEN_TRAIN
    [ -f "$W/specialists/generalist/config.json" ] || { echo "the generalist was not written"; exit 1; }
    BASE=$W/specialists/generalist
  fi
  CONSUMERS=""
  train_pids=()
  for s in $SPECIALISTS; do
    if [ "${PARALLEL_TRAIN:-0}" = 1 ]; then  # side by side on one GPU (a 135M model leaves it idle between kernels)
      stage "train_$s" $T_TRAIN python3 scripts/train/finetune.py --model "$BASE" --mix "$s=1" --out "$W/specialists/$s" \
        $TRAIN > "$W/train_$s.log" 2>&1 &
      train_pids+=($!)
    else
      stage "train_$s" $T_TRAIN python3 scripts/train/finetune.py --model "$BASE" --mix "$s=1" --out "$W/specialists/$s" $TRAIN
    fi
    CONSUMERS="$CONSUMERS --consumer $s=$W/specialists/$s"
  done
  if [ "${PARALLEL_TRAIN:-0}" = 1 ]; then
    wait "${train_pids[@]}"  # not a bare wait: that also waits for the log's tee, which never ends
    for s in $SPECIALISTS; do grep -v "it/s\]$" "$W/train_$s.log" | tail -n 15; done
  fi
  # calibration takes what the eval's minimum leaves. Its --time-budget-s (T_CAL - 15) counts from the
  # python process's start and keeps 10 s of itself for writing the artifacts (calib/budget.py), so
  # it exits near T_CAL - 25 s; the 15 s outside cover the last aligner turn's overrun (one step
  # and a held-out check) and a slow disk under the ~300 MB of reuse stats, before timeout's SIGINT
  # at T_CAL (the artifacts are still written, but the joint aligner pass a SIGINT cuts leaves
  # every Patch layer Reuse: the budget keeps it clear of that). The eval takes the rest: its rank
  # sweep starts a consumer only when the time its methods took says it ends 30 s before the limit
  T_CAL=$(( $(left) - T_EVAL_MIN )); [ $T_CAL -lt 60 ] && T_CAL=60
  stage calibrate $T_CAL python3 -m sgl_kvxfer.scd.calib --producer "$BASE" $CONSUMERS \
    --calib task:qa task:kv task:code --out "$W/artifacts" --save-stats --time-budget-s $(( T_CAL - 15 )) $CALIB
fi
if [ "${SKIP_EVAL:-0}" = 1 ]; then
  echo "=== eval: skipped (SKIP_EVAL=1)"
else
  T_EVAL=$(( $(left) )); [ $T_EVAL -lt 60 ] && T_EVAL=60
  stage eval $T_EVAL python3 benchmarks/quality/scd_eval.py --artifacts "$W/artifacts" --out-dir "$W/results" \
    --time-budget-s $(( T_EVAL - 30 )) $EVAL
fi
# the headline rows in the log: each method's score per specialist (base = the producer alone)
python3 - "$W"/results/scd_eval_*.json <<'PY' 2>/dev/null
import json, sys
for path in sys.argv[1:]:
    s = json.load(open(path))["summary"]["methods"]
    for k, v in s.items():
        per = " ".join(f"{c}={x:.3f}" for c, x in v["per_consumer"].items())
        wire = "diagnostic, not sent" if v.get("diagnostic") else f"{v['bytes_per_token']} B/token"
        print(f"[table] {k:12s} score {v['score']:.3f} ({per}) KL {v['kl']:.4f} top1 {v['top1']:.3f} "
              f"{wire} rebuild {v['rebuild_ms_per_1k_tokens']:.2f} ms/1k")
    if "oracle" in s and "raw" in s:  # the suite discriminates when raw producer KV loses points
        for c, o in s["oracle"]["per_consumer"].items():
            print(f"[table] {c}: oracle {o:.3f}, base {s.get('base', {}).get('per_consumer', {}).get(c, float('nan')):.3f}, "
                  f"raw producer KV loses {100 * (o - s['raw']['per_consumer'][c]):.1f} points")
PY
echo "  \"device\": \"$DEVICE\"}" >> "$W/stages.json"

cp "$W/stages.json" "$OUT/stages.json"
[ -f "$W/artifacts/calibration.json" ] && cp "$W/artifacts/calibration.json" "$OUT/"
(cd "$W" && tar -cf "$OUT/specialists.tar" specialists/*/train_log.json specialists/*/loss.png 2>/dev/null)
cp "$W"/results/scd_eval_* "$OUT/" 2>/dev/null
ls -la "$OUT"
