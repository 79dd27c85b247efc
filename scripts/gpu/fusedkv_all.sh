#!/usr/bin/env bash
# On the GPU machine (one H100): the FusedKV measurements, each stage under `timeout -s INT` (a
# stage that runs out keeps what it measured; a failed stage does not stop the next). Results into
# $OUT: the stages' JSONs, fusedkv_results.tar.gz (JSONs + PNGs) and fusedkv_all.log.
#   teacher   python -m sgl_kvxfer.fusedkv.teacher_text: TEACHER_TOKENS (required) tokens sampled from
#             SmolLM2-135M-Instruct, prompted from the corpus, added to $DATA as {domain}-teacher
#             train files for a retrofit stage after it (T_TEACHER, default 240 s; sampling stops
#             30 s before it and keeps what it has)
#   retrofit  python -m sgl_kvxfer.fusedkv.convert on SmolLM2-135M-Instruct (1.25 minutes of
#             training), the PPL-vs-GPU-minutes curve, task-suite scores of both models through the
#             engine; the converted model stays in /tmp for tiers                       (135 s)
#   scratch   scripts/fusedkv/compare_scratch.py: vanilla / fusedkv / lite / cla2 / yoco and two
#             fusedkv ablations (fusion weights starting as Lite; their learning rate x30), 3 seeds
#             on 3 workers, steps sized to a 150 s budget (floor 200 steps)             (175 s)
#   tiers     benchmarks/fusedkv/tiers.py: the converted model and the original at b = 1.0 / 0.5
#             (PPL, resident bytes, decode TPOT); needs retrofit's model                 (150 s)
#   serve     benchmarks/fusedkv/serve_bench.py, Llama-3-8B shape: pool, TTFT, warm TPOT with
#             spread, for $SERVE_VARIANTS (default vanilla fusedkv lite)                 (180 s)
#   capacity  benchmarks/fusedkv/capacity.py: 32k-token requests at the memory limit      (160 s)
# Usage: bash scripts/gpu/fusedkv_all.sh [stage | all | rerun | curve | long | STAGE...]
#   stage     join the staged GGUF halves and convert the model into /tmp/models (~30 s)
#   all       every stage in the order above (~13.5 min: more than one call; run it as the calls below)
#   rerun     scratch, then serve with vanilla and lite only (~5 min; no model needed)
#   curve     retrofit with 3.75 training minutes (the PPL-vs-GPU-minutes curve; T_RETROFIT 320 s),
#             then scratch (~8.5 min in all; fits one call on a GPU shared with other jobs)
#   long      retrofit alone with LONG_MIN (7) training minutes, 128 calib windows, batch 64; LONG_TASKS
#             (e.g. qa,kv,code) adds the task suite after the report is on disk (T_RETROFIT_LONG 580 s);
#             with TEACHER_TOKENS the teacher stage runs first (then lower LONG_MIN to fit one call)
#   STAGE...  the named stages, in the order given
# Calls (the model: stage_weights.sh and its add park the GGUF's first two parts; `stage` joins the
# third and converts it; one call cannot carry a part and the rest):
#   run carry [.carry_a]                 bash scripts/gpu/stage_weights.sh
#   run carry [.carry_b]                 bash scripts/gpu/stage_weights.sh add
#   run carry [.carry_c, .whl_gguf]      bash scripts/gpu/fusedkv_all.sh stage                   (~30 s)
#   run carry [.whl, .cache/fusedkv]     SGL_KVXFER_COMMIT=<hash> bash scripts/gpu/fusedkv_all.sh retrofit tiers  (~5 min)
#   run carry [.whl, .cache/fusedkv]     SGL_KVXFER_COMMIT=<hash> bash scripts/gpu/fusedkv_all.sh rerun           (~5 min)
#   run carry [.whl]                     SGL_KVXFER_COMMIT=<hash> bash scripts/gpu/fusedkv_all.sh serve capacity  (~6 min)
#   run carry [.whl, .cache/fusedkv]     SGL_KVXFER_COMMIT=<hash> bash scripts/gpu/fusedkv_all.sh curve           (~8.5 min)
#   run carry [.whl, .cache/fusedkv]     SGL_KVXFER_COMMIT=<hash> bash scripts/gpu/fusedkv_all.sh long            (~8 min)
# (.whl_gguf: scripts/gpu/prepare_fusedkv_carry.sh; .cache/fusedkv: python -m sgl_kvxfer.fusedkv.data.)
# Without the converted model in /tmp/models, retrofit and tiers are skipped (logged). Exit status 1
# when a stage failed or scratch trained <= 1 step per run.
# DATA (default .cache/fusedkv): the token folder; teacher adds its files there, so a teacher call
# and a retrofit call after it share a DATA under /tmp (a carried .cache/fusedkv is replaced each call).
# DEADLINE (epoch seconds) caps every stage's timeout, and the scratch grid's budget is then
# SCRATCH_SAFETY (85) % of what it leaves less SCRATCH_MARGIN (25) s, at most SCRATCH_BUDGET (150) s
# (testbeds_x2.sh sets DEADLINE);
# SCRATCH_MIN_STEPS lowers the grid's floor of steps (the preset's min_steps).
# CPU rehearsal (tiny shapes, the embedded SmolLM2, a few minutes):
#   DEVICE=cpu OUT=/tmp/x bash scripts/gpu/fusedkv_all.sh [rerun | long | STAGE...]
set -uo pipefail
mode=${1:-all}
case $mode in
  stage) ;;
  all) stages="retrofit scratch tiers serve capacity" ;;
  rerun) stages="scratch serve"; SERVE_VARIANTS=${SERVE_VARIANTS:-vanilla lite} ;;
  curve) stages="retrofit scratch" ;;
  long) stages="${TEACHER_TOKENS:+teacher }retrofit" ;;  # TEACHER_TOKENS: sample more training text first
  teacher|retrofit|scratch|tiers|serve|capacity)
    stages="$*"
    for s in $stages; do
      case $s in teacher|retrofit|scratch|tiers|serve|capacity) ;; *) echo "unknown stage $s" >&2; exit 2 ;; esac
    done ;;
  *) sed -n '2,42p' "$0"; exit 2 ;;
esac
export OUT=${OUT:-/tmp/out} PYTHONUNBUFFERED=1 TQDM_MININTERVAL=5
DEVICE=${DEVICE:-cuda}
mkdir -p "$OUT"
[ -e sgl_kvxfer/kernels ] || ln -s ../kernels sgl_kvxfer/kernels

if [ "$mode" = stage ]; then  # join the GGUF halves, convert into /tmp/models (gguf is all it needs)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl_gguf/*.whl || exit 1
  bash scripts/gpu/stage_weights.sh join || exit 1
  PYTHONPATH=/tmp/site:$PWD SGL_KVXFER_MODEL_CACHE=/tmp/models python3 -c "
from sgl_kvxfer.models.convert import convert_gguf, default_cache_dir, is_converted
d = default_cache_dir()
print(d if is_converted(d) else convert_gguf('/tmp/m/smollm2.gguf', d))" 2>&1 | tee "$OUT/stage.log"
  exit "${PIPESTATUS[0]}"
fi

SERVE_VARIANTS=${SERVE_VARIANTS:-vanilla fusedkv lite}
if [ "$DEVICE" = cuda ]; then
  # the wheels once per machine (env.sh's stamp: two parts of testbeds_x2.sh never install at once)
  source scripts/gpu/env.sh || exit 1
  T_RETROFIT=${T_RETROFIT:-135} T_SCRATCH=${T_SCRATCH:-175} T_TIERS=${T_TIERS:-150} T_SERVE=${T_SERVE:-180}
  T_CAPACITY=${T_CAPACITY:-160}
  [ "$mode" = rerun ] && T_SERVE=${T_SERVE_RERUN:-145}  # two variants
  RETROFIT_MIN=1.25
  # the longer curve: 225 s of training, ~95 s for start-up, evaluations, the task suite and saving
  [ "$mode" = curve ] && RETROFIT_MIN=3.75 T_RETROFIT=${T_RETROFIT_CURVE:-320}
  RETROFIT_EXTRA="--tasks qa,kv,code --task-n 30"
  # long: 420 s of training (the compile included: --compile auto is on for CUDA), ~60 s for
  # start-up, the closed-form fit's evaluations, 14 PPL points, saving; 128 calib windows (65k
  # tokens: the o_proj regression overfits a few thousand); batch 64 x 512 (4x the tokens per second
  # of batch 16: benchmarks/fusedkv/distill_step.py) at twice the default peak rate.
  # LONG_TASKS (e.g. qa,kv,code) adds the task suite after the report is written (~45 s, 30 items each)
  [ "$mode" = long ] && RETROFIT_MIN=${LONG_MIN:-7} T_RETROFIT=${T_RETROFIT_LONG:-580} \
    RETROFIT_EXTRA="--calib-windows 128 --batch 64 --lr 4e-4${LONG_TASKS:+ --tasks $LONG_TASKS --task-n 30}"
  RETROFIT_ARGS=${RETROFIT_ARGS:---budget-min $RETROFIT_MIN $RETROFIT_EXTRA}
  SCRATCH_ARGS=${SCRATCH_ARGS:---preset small --seeds 0 1 2 --workers 3}
  SCRATCH_BUDGET=${SCRATCH_BUDGET:-150}
  TIERS_ARGS=${TIERS_ARGS:---budgets 1.0 0.5 --windows 16 --decode-batch 8 --decode-context 2048}
  SERVE_ARGS=${SERVE_ARGS:---preset llama-3-8b --points 1x8192 16x8192 1x32768 --prompt-lens 8192 32768 --ttft-repeats 3}
  CAPACITY_ARGS=${CAPACITY_ARGS:---preset llama-3-8b --context 32768}
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
  T_RETROFIT=${T_RETROFIT:-900} T_SCRATCH=${T_SCRATCH:-900} T_TIERS=${T_TIERS:-900} T_SERVE=${T_SERVE:-900}
  T_CAPACITY=${T_CAPACITY:-900}
  RETROFIT_MIN=0.3 RETROFIT_EXTRA="--tasks qa --task-n 2 --dtype float32"
  # long: past the source search and the closed-form fit (~40 s on CPU), into training
  [ "$mode" = long ] && RETROFIT_MIN=${LONG_MIN:-1.5} RETROFIT_EXTRA="${LONG_TASKS:+--tasks $LONG_TASKS --task-n 2}"
  RETROFIT_ARGS=${RETROFIT_ARGS:---budget-min $RETROFIT_MIN --seq 32 --batch 2 --eval-windows 2 --calib-windows 4 $RETROFIT_EXTRA}
  # a time budget, as on the GPU: the rehearsal goes through the step plan
  SCRATCH_ARGS=${SCRATCH_ARGS:---preset toy --seeds 0 1 --workers 2}
  SCRATCH_BUDGET=${SCRATCH_BUDGET:-600}
  TIERS_ARGS=${TIERS_ARGS:---budgets 1.0 0.5 --windows 2 --context 32 --continuation 8 --decode-batch 1 --decode-context 16 --n1 1 --n2 2 --dtype float32}
  SERVE_ARGS=${SERVE_ARGS:---smoke}
  CAPACITY_ARGS=${CAPACITY_ARGS:---smoke}
fi
DATA=${DATA:-.cache/fusedkv}
has() { [[ " $stages " == *" $1 "* ]]; }
if { has teacher || has retrofit || has scratch || has tiers; } && [ ! -f "$DATA/meta.json" ]; then
  echo "no $DATA: python -m sgl_kvxfer.fusedkv.data --data-dir DIR --out $DATA" >&2; exit 2
fi
MODEL=
if has teacher || has retrofit || has tiers; then
  MODEL=$(python3 -c "from sgl_kvxfer.models.loader import resolve_model_path; print(resolve_model_path(None))" 2>/dev/null)
fi
# the names benchmarks/results keeps: fusedkv_retrofit_<model>_<GPU name>.json (cpu on CPU)
DEVTAG=cpu
[ "$DEVICE" = cuda ] && DEVTAG=$(python3 -c "import torch; print(torch.cuda.get_device_name(0).replace(' ', '_'))")
work=$(mktemp -d /tmp/fusedkv_all.XXXX)
# FKV_MODEL: where retrofit writes the converted model (default inside this run's temp folder,
# removed at the end); a path under /tmp keeps it for a `tiers` call after it on the same machine
fkv_model=${FKV_MODEL:-$work/smollm2-135m-fusedkv}
log=$OUT/fusedkv_all.log
failed=()
left() {  # seconds to DEADLINE (epoch seconds; unset: no deadline, a large number)
  if [ -n "${DEADLINE:-}" ]; then echo $(( DEADLINE - $(date +%s) )); else echo 1000000; fi
}
stage_run() {  # name timeout command...: run under timeout -s INT (never past DEADLINE), log, report the exit status
  local name=$1 t=$2 rc; shift 2
  [ "$(left)" -lt "$t" ] && t=$(left)
  if [ "$t" -lt 20 ]; then
    echo "== $name skipped: ${t} s to the deadline" | tee -a "$log"; failed+=("$name:deadline"); return
  fi
  echo "== $name ($(date +%T), timeout ${t}s): $*" | tee -a "$log"
  timeout -s INT -k 15 "$t" "$@" 2>&1 | tee -a "$log"
  rc=${PIPESTATUS[0]}
  echo "== $name exit $rc ($(date +%T))" | tee -a "$log"
  [ "$rc" = 0 ] || failed+=("$name:$rc")
  collect
}
collect() {  # the results so far into $OUT (after every stage: a call cut off later keeps them)
  cp "$work"/*.json "$OUT"/ 2>/dev/null
  (cd "$work" && tar -czf "$OUT/fusedkv_results.tar.gz" ./*.json ./*.png 2>/dev/null)
}
check_scratch() {  # the grid must have trained: > 1 step per run, and the audit clean
  python3 - "$work" <<'EOF' 2>&1 | tee -a "$log"
import glob, json, sys
paths = glob.glob(sys.argv[1] + "/fusedkv_scratch_*.json")
assert paths, "scratch wrote no JSON"
r = json.load(open(paths[0]))
assert r.get("steps", 0) > 1 and not r.get("audit"), f"scratch: steps {r.get('steps')}, audit {r.get('audit')}"
print(f"scratch check: {r['steps']} steps per run (preset {r['planned_steps']}, budget_capped {r['budget_capped']}), "
      f"{len(r['results'])} runs")
EOF
  [ "${PIPESTATUS[0]}" = 0 ] || failed+=("scratch-check")
}

# shellcheck disable=SC2086  # *_ARGS and SERVE_VARIANTS are word lists
for s in $stages; do
  case $s in
    teacher)
      if [ -z "${TEACHER_TOKENS:-}" ]; then
        echo "== teacher skipped: set TEACHER_TOKENS" | tee -a "$log"; failed+=("teacher:no-tokens")
      elif [ -n "$MODEL" ] && [ -f "$MODEL/config.json" ]; then
        stage_run teacher "${T_TEACHER:-240}" python3 -m sgl_kvxfer.fusedkv.teacher_text --model "$MODEL" --data "$DATA" \
            --tokens "$TEACHER_TOKENS" --device "$DEVICE" --force --time-budget-s $(( ${T_TEACHER:-240} - 30 )) ${TEACHER_ARGS:-}
      else
        echo "== teacher skipped: no converted SmolLM2 (run the stage call first)" | tee -a "$log"
      fi ;;
    retrofit)
      if [ -n "$MODEL" ] && [ -f "$MODEL/config.json" ]; then
        stage_run retrofit "$T_RETROFIT" python3 -m sgl_kvxfer.fusedkv.convert --model "$MODEL" --variant fusedkv \
            --out "$fkv_model" --train-data "$DATA" --device "$DEVICE" --report "$work/fusedkv_retrofit_$(basename "$MODEL")_$DEVTAG.json" $RETROFIT_ARGS
      else
        echo "== retrofit skipped: no converted SmolLM2 (run the stage call first)" | tee -a "$log"
      fi ;;
    scratch)
      # the grid's budget: SCRATCH_BUDGET, or SCRATCH_SAFETY % (85) of what DEADLINE leaves less
      # SCRATCH_MARGIN s (the JSON and PNG): runs can take longer than the probe's plan, and a grid
      # of fewer steps beats one cut short; the stage's timeout is the deadline itself
      b=$(( ($(left) - ${SCRATCH_MARGIN:-25}) * ${SCRATCH_SAFETY:-85} / 100 ))
      [ "$b" -gt "$SCRATCH_BUDGET" ] && b=$SCRATCH_BUDGET
      [ "$b" -lt 1 ] && b=1
      stage_run scratch "$T_SCRATCH" python3 scripts/fusedkv/compare_scratch.py --data-dir "$DATA" --device "$DEVICE" \
          --runs vanilla fusedkv lite cla2 yoco "fusedkv[init=lite]" "fusedkv[fusion_lr=x30]" --out-dir "$work" \
          $SCRATCH_ARGS --time-budget-s "$b" ${SCRATCH_MIN_STEPS:+--min-steps $SCRATCH_MIN_STEPS}
      check_scratch ;;
    tiers)
      if [ -f "$fkv_model/config.json" ]; then
        stage_run tiers "$T_TIERS" python3 benchmarks/fusedkv/tiers.py --fusedkv-model "$fkv_model" --base-model "$MODEL" \
            --eval-tokens "$DATA/prose_eval.u16.xz" --device "$DEVICE" --out-dir "$work" $TIERS_ARGS
      else
        echo "== tiers skipped: no converted model (tiers runs after retrofit in the same call, or with the FKV_MODEL it wrote)" | tee -a "$log"
      fi ;;
    serve)
      stage_run serve "$T_SERVE" python3 benchmarks/fusedkv/serve_bench.py --device "$DEVICE" --out-dir "$work" \
          --variants $SERVE_VARIANTS $SERVE_ARGS ;;
    capacity)
      stage_run capacity "$T_CAPACITY" python3 benchmarks/fusedkv/capacity.py --device "$DEVICE" --out-dir "$work" $CAPACITY_ARGS ;;
  esac
done

echo "== done ($(date +%T))${failed[*]:+; failed: ${failed[*]}}" | tee -a "$log"
collect
rm -rf "$work"
ls -la "$OUT"
[ ${#failed[@]} = 0 ]
