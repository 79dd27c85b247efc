#!/usr/bin/env bash
# SpectrumKV's retrieval test bed, results in $OUT. Stages (arguments, in this order; default
# `all` = tests train probe eval resume decode, which needs more than one call's 560 s):
#   tests   (CUDA only) test/spectrum/test_cold_tier.py, whose GPU test runs the side-stream promotion
#   train   SmolLM2-135M-Instruct fully fine-tuned on the task suite's key-value retrieval
#           (KV_VALUE_DIGITS = 10-digit values; KV_NEAR_KEYS = 16 near-duplicate keys one character
#           away from the asked one, whose values are the asked value with KV_NEAR_VALUES = 1 digit
#           changed): the first SHORT_FRAC of the items at SHORT_CTX tokens, then TRAIN_CTX
#           (scripts/train/finetune.py through scripts/gpu/spectrum_train.py); SmolLM2-135M has 8192
#           positions (RoPE theta 1e5), so 8000-token prompts need no RoPE scaling; the weights stay
#           in $WORK, never in the repo
#   probe   benchmarks/quality/int4_needle_probe.py on it: int4 on the asked line vs on as many other
#           tokens vs everywhere, this bed and the 3:0 one (3 near keys, independent values), at
#           EVAL_CTX; int4_needle_probe.json
#   eval    benchmarks/quality/retrieval_tiers.py on it: fp16 at EVAL_CTX and LONG_CTX, the per-layer
#           profile, lambda and threshold by validation, then the first methods (EVAL_A) at b = 0.3
#           and 0.2; the JSON is rewritten after every point, in $OUT as it runs
#   resume  the same JSON continued (--resume: the same trials, fp16 ceilings, profile, lambda and
#           threshold): every method (METHODS) at each '|'-separated group of RESUME_BUDGETS
#           (default "0.3 0.2|0.5": b = 0.3 and 0.2, then b = 0.5), the points already measured
#           skipped; methods in the order they matter to the table
#   decode  benchmarks/throughput/cold_tier_decode.py: the cold tier's decode cost at the
#           Llama-3-8B shape (dummy weights), 16k x 8, b = 0.2, triton backend, CUDA graphs; modes
#           off, on@16, on@4, score@16 (scoring without promotions), a synchronized per-part
#           breakdown per mode, then the timed repeats (a decode-only call: T_DECODE=240)
# Each stage runs under `timeout -s INT` (tests 60, T_TRAIN / T_PROBE / T_EVAL / T_DECODE: 290 / 35 /
# 240 / 100 s; resume: what is left but T_DECODE; each cut to what is left of T_TOTAL = 520 s) and
# keeps what it measured. Trials: 11 depths x 8 = 88 items a point, the same items for every method (the summary
# counts the trials only one of best SpectrumKV / random answers; every row has a 95% Wilson interval
# and the tier each trial's asked line got).
# $OUT (8 files): retrieval_tiers_*.json/.png, layer_profile_*.json, cold_tier_decode_*.json,
# int4_needle_probe.json, train_log.json, loss.png, spectrum_logs.tar.gz; PACK=1: all of them in one
# $OUT/spectrum.tar.gz.
# Shares a machine: OUT may be any folder (a subfolder of the call's $OUT), WORK defaults to a fresh
# mktemp folder (two calls that continue one run name the same WORK), item building uses WORKERS
# (8) processes, and every engine has an explicit KV pool (--max-total-tokens 400000: about 9.2 GB
# each for SmolLM2-135M; two live at a time) so it takes no share of GPU memory another process
# holds; peak about 25 GB (the decode stage: the Llama-3-8B dummy weights, 16 GB, and its tiered
# pool for 16k x 8).
#
# GPU, four calls on one warm machine (scripts/gpu/README.md), back to back:
#   run carry [.carry_a]                      bash scripts/gpu/stage_weights.sh
#   run carry [.carry_b]                      bash scripts/gpu/stage_weights.sh add
#   run carry [.carry_c]                      bash scripts/gpu/stage_weights.sh join
#   run carry [.whl, .cache/data]             WORK=/tmp/spectrum_work bash scripts/gpu/spectrum_retrieval.sh tests train probe eval
#   run carry [.whl, .cache/data]             WORK=/tmp/spectrum_work bash scripts/gpu/spectrum_retrieval.sh resume decode
# beside scd_quality.sh on one H100 (env.sh once first, then each script in its own OUT subfolder):
#   source scripts/gpu/env.sh; WORK=/tmp/spectrum_work PACK=1 OUT=$OUT/spec bash scripts/gpu/spectrum_retrieval.sh tests train probe eval &
#   OUT=$OUT/scd bash scripts/gpu/scd_quality.sh; wait
# CPU rehearsal (a random tiny Llama with SmolLM2's tokenizer, tiny contexts, minutes):
#   DEVICE=cpu WORK=/tmp/x_work OUT=/tmp/x bash scripts/gpu/spectrum_retrieval.sh train probe eval
#   DEVICE=cpu WORK=/tmp/x_work OUT=/tmp/x bash scripts/gpu/spectrum_retrieval.sh resume decode
set -uo pipefail
stages=" ${*:-all} "
for s in $stages; do
  case $s in all|tests|train|probe|eval|resume|decode) ;; *) sed -n '2,52p' "$0"; exit 2 ;; esac
done
[ "$stages" = " all " ] && stages=" tests train probe eval resume decode "
want() { [[ $stages == *" $1 "* ]]; }
export OUT=${OUT:-/tmp/out} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
DEVICE=${DEVICE:-cuda}
mkdir -p "$OUT"
work=${WORK:-$(mktemp -d "${TMPDIR:-/tmp}/spectrum_run.XXXXXX")}
mkdir -p "$work"
say() { echo "== $* ($(date +%T))"; }
T0=$(date +%s)
T_TOTAL=${T_TOTAL:-$([ "$DEVICE" = cuda ] && echo 520 || echo 3600)}
left() {  # left CAP: CAP seconds, or what is left of T_TOTAL less 15 s for copying out (at least 1)
  local l=$(( T_TOTAL - ($(date +%s) - T0) - 15 ))
  [ "$l" -lt "$1" ] || l=$1
  [ "$l" -ge 1 ] || l=1
  echo "$l"
}

if [ "$DEVICE" = cuda ]; then
  # wheels, the repo on PYTHONPATH, the GGUF halves joined and converted into /tmp/models
  source scripts/gpu/env.sh > "$work/env.log" 2>&1 || { echo "env.sh failed:"; tail -20 "$work/env.log"; }
  BASE=$(python3 -c "from sgl_kvxfer.models.loader import resolve_model_path; print(resolve_model_path(None))")
  T_TRAIN=${T_TRAIN:-290} T_PROBE=${T_PROBE:-35} T_EVAL=${T_EVAL:-240} T_DECODE=${T_DECODE:-100}
  # 8000, not 8192: the prompt (+ chat template and answer) stays inside SmolLM2's 8192 positions
  TRAIN_CTX=${TRAIN_CTX:-8000} TRAIN_S=${TRAIN_S:-260} ITEMS=${ITEMS:-2600} WORKERS=${WORKERS:-8}
  SHORT_CTX=${SHORT_CTX:-4000} SHORT_FRAC=${SHORT_FRAC:-0.5}
  TRAIN_ARGS=${TRAIN_ARGS:-"--batch-size 2 --grad-accum 4 --lr 3e-4 --warmup 20 --steps 3000"}
  EVAL_CTX=${EVAL_CTX:-4096} LONG_CTX=${LONG_CTX:-8000}
  PROBE_ARGS=${PROBE_ARGS:-"--items 44 --device cuda"}
  EVAL_ARGS=${EVAL_ARGS:-"--backend triton --depths 11 --trials-per-depth 8 --long-trials-per-depth 4
    --val-trials 16 --val-budgets 0.3 0.2 --lambdas 0 1e-3 --cold-thresholds 0.01 0.05 --ppl-windows 2
    --profile-samples 8 --max-new-tokens 14 --max-total-tokens 400000 --promote-drop-run 32"}
  DECODE_ARGS=${DECODE_ARGS:-"--preset llama-3-8b --context 16384 --batch 8 --kv-tier-budget 0.2 --n1 16
    --n2 80 --repeats 5 --intervals 16 4 --score-only"}
else
  [ -e sgl_kvxfer/kernels ] || ln -s ../kernels sgl_kvxfer/kernels
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
  [ -d "$work/base" ] || python3 scripts/train/make_tiny_model.py --out "$work/base" --layers 2 --hidden 64 \
      --heads 4 --kv-heads 2 > /dev/null
  BASE=$work/base
  T_TRAIN=${T_TRAIN:-900} T_PROBE=${T_PROBE:-600} T_EVAL=${T_EVAL:-1800} T_DECODE=${T_DECODE:-900}
  TRAIN_CTX=${TRAIN_CTX:-256} TRAIN_S=${TRAIN_S:-60} ITEMS=${ITEMS:-16} WORKERS=${WORKERS:-2}
  SHORT_CTX=${SHORT_CTX:-128} SHORT_FRAC=${SHORT_FRAC:-0.5}
  TRAIN_ARGS=${TRAIN_ARGS:-"--batch-size 2 --grad-accum 1 --lr 1e-3 --warmup 2 --steps 3"}
  EVAL_CTX=${EVAL_CTX:-256} LONG_CTX=${LONG_CTX:-384}
  PROBE_ARGS=${PROBE_ARGS:-"--items 2 --device cpu --dtype float32"}
  EVAL_ARGS=${EVAL_ARGS:-"--quick --ppl-context 128 --ppl-chunk 16 --profile-batch 2 --max-new-tokens 14
    --cold-thresholds 0.02 0.1"}
  DECODE_ARGS=${DECODE_ARGS:-"--preset tiny --context 128 --batch 2 --n1 2 --n2 10 --repeats 2 --backend torch
    --forced-threshold 0.001"}
fi
# the test bed: the task's parameters for training and evaluation alike
KV_VALUE_DIGITS=${KV_VALUE_DIGITS:-10} KV_NEAR_KEYS=${KV_NEAR_KEYS:-16} KV_NEAR_VALUES=${KV_NEAR_VALUES:-1}
TASK_TRAIN=(--task-param kv.value_digits="$KV_VALUE_DIGITS" --task-param kv.near_keys="$KV_NEAR_KEYS"
            --task-param kv.near_values="$KV_NEAR_VALUES")
TASK_EVAL=(--task-param value_digits="$KV_VALUE_DIGITS" --task-param near_keys="$KV_NEAR_KEYS"
           --task-param near_values="$KV_NEAR_VALUES")
# methods in the order they matter to the table (a run cut short keeps the first ones whole):
# the b=0.3 comparison, the per-layer budgets and their uniform control, the cold tier, then the
# rest; the eval stage measures them all at b = 0.3 first, then at b = 0.2
EVAL_A=${EVAL_A:-"spectrumkv random-tier per-layer spectrumkv-torch uniform-int4 cold-tier spectrumkv-max"}
METHODS=${METHODS:-"$EVAL_A kivi uniform-int8 pdtrim sws balanced adaptive-2tier greedy"}
MODEL=$work/model
PROSE=()  # the eval prose for the PPL column (else the probe's fallback filler: stdlib docstrings)
[ -f .cache/data/prose_eval.jsonl ] && PROSE=(--prose .cache/data/prose_eval.jsonl)

if [ "$DEVICE" = cuda ] && want tests; then
  say "tests: the cold tier's CUDA path (side-stream promotion)"
  timeout "$(left 60)" python3 -m pytest test/spectrum/test_cold_tier.py -q -p no:cacheprovider 2>&1 | tail -5 \
      | tee "$work/tests.log"
fi

if want train; then
  say "train: kv retrieval, the first $SHORT_FRAC of $ITEMS items at $SHORT_CTX tokens, then $TRAIN_CTX; $TRAIN_S s"
  t_train=$(left "$T_TRAIN")  # TRAIN_S is cut so that the weights are saved within it
  # shellcheck disable=SC2086
  timeout -s INT "$t_train" python3 scripts/gpu/spectrum_train.py --workers "$WORKERS" --items "$ITEMS" \
      --short-context "$SHORT_CTX" --short-fraction "$SHORT_FRAC" --finish-within "$t_train" -- \
      --model "$BASE" --mix kv=1 --task-param kv.context_tokens="$TRAIN_CTX" "${TASK_TRAIN[@]}" --out "$MODEL" \
      --time-limit-s "$TRAIN_S" --max-len $((TRAIN_CTX + 256)) --eval-n 0 --device "$DEVICE" $TRAIN_ARGS \
      2>&1 | grep -v "it/s\]$" | tee "$work/train.log"
fi
# results written as they come into $work/res (a later call with the same WORK continues them),
# copied to $OUT at the end
res=$work/res
mkdir -p "$res"
cp "$MODEL/train_log.json" "$MODEL/loss.png" "$res"/ 2>/dev/null
if [ ! -f "$MODEL/config.json" ]; then
  echo "no fine-tuned model at $MODEL: the evaluation runs on the base model"
  MODEL=$BASE
fi

replot() {  # a run cut short wrote its JSON after its last plot
  for j in "$res"/retrieval_tiers_*.json; do
    [ -f "$j" ] && [ "$j" -nt "${j%.json}.png" ] && timeout 60 python3 benchmarks/quality/retrieval_tiers.py --plot-only "$j"
  done
}
table() {  # table SECONDS LOG ARGS...: retrieval_tiers.py into $res; no new point after SECONDS - 30
  local t=$1 log=$2; shift 2
  # shellcheck disable=SC2086
  timeout -s INT -k 10 "$t" python3 benchmarks/quality/retrieval_tiers.py --model "$MODEL" --device "$DEVICE" \
      --context "$EVAL_CTX" --long-context "$LONG_CTX" --out-dir "$res" "${PROSE[@]}" "${TASK_EVAL[@]}" $EVAL_ARGS \
      --time-budget-s $(( t > 60 ? t - 30 : t / 2 )) "$@" 2>&1 | tee -a "$work/$log"
}

if want probe; then
  say "probe: int4 on the asked line vs as many other tokens, beds $KV_NEAR_KEYS:$KV_NEAR_VALUES and 3:0"
  # shellcheck disable=SC2086
  timeout -s INT -k 10 "$(left "$T_PROBE")" python3 benchmarks/quality/int4_needle_probe.py --model "$MODEL" \
      --context "$EVAL_CTX" --value-digits "$KV_VALUE_DIGITS" --beds "$KV_NEAR_KEYS:$KV_NEAR_VALUES" 3:0 \
      --out "$res/int4_needle_probe.json" $PROBE_ARGS 2>&1 | tee "$work/probe.log"
fi

if want eval; then
  t_end=$(( $(date +%s) + $(left "$T_EVAL") ))
  say "eval: retrieval table on $MODEL (fp16, profile, validation, then $EVAL_A at b = 0.3, then at 0.2)"
  # shellcheck disable=SC2086
  table "$(( t_end - $(date +%s) ))" eval.log --budgets 0.3 --methods $EVAL_A
  json=$(ls "$res"/retrieval_tiers_*.json 2>/dev/null | head -1)
  t=$(( t_end - $(date +%s) ))
  if [ -n "$json" ] && [ "$t" -ge 60 ]; then
    say "eval: $EVAL_A at b = 0.2 ($t s)"
    # shellcheck disable=SC2086
    table "$t" eval.log --resume "$json" --budgets 0.2 --methods $EVAL_A
  fi
  replot
fi

if want resume; then
  json=$(ls "$res"/retrieval_tiers_*.json 2>/dev/null | grep -v _quick_ | head -1)
  [ -n "$json" ] || json=$(ls "$res"/retrieval_tiers_*.json 2>/dev/null | head -1)
  if [ -z "$json" ]; then
    echo "resume: no retrieval_tiers JSON in $res (run the eval stage first, with the same WORK)"
  else
    reserve=0; want decode && reserve=$T_DECODE  # the decode stage keeps its share
    t_end=$(( T0 + T_TOTAL - 15 - reserve ))
    IFS='|' read -r -a budget_groups <<< "${RESUME_BUDGETS:-0.3 0.2|0.5}"
    for budgets in "${budget_groups[@]}"; do
      t=$(( t_end - $(date +%s) ))
      [ "$t" -ge 60 ] || break
      say "resume: $json, every method at b = $budgets ($t s)"
      # shellcheck disable=SC2086
      table "$t" resume.log --resume "$json" --budgets $budgets --methods $METHODS
    done
    replot
  fi
fi

if want decode; then
  say "decode: cold tier cost"
  # shellcheck disable=SC2086
  t=$(left "$T_DECODE")
  # the script stops between repeats before its budget and writes its JSON after every phase, so
  # the INT at the limit only meets a run whose start-up or prefill alone overran it
  timeout -s INT -k 10 "$t" python3 benchmarks/throughput/cold_tier_decode.py --device "$DEVICE" \
      --out-dir "$work" --time-budget-s $(( t > 30 ? t - 10 : t )) $DECODE_ARGS 2>&1 | tee "$work/decode.log"
fi

say "done after $(( $(date +%s) - T0 )) s"
cp "$work"/cold_tier_decode_*.json "$res"/ 2>/dev/null
cp "$MODEL/train_log.json" "$MODEL/loss.png" "$res"/ 2>/dev/null
tar -czf "$res/spectrum_logs.tar.gz" -C "$work" $(cd "$work" && ls ./*.log 2>/dev/null)
if [ "${PACK:-0}" = 1 ]; then tar -czf "$OUT/spectrum.tar.gz" -C "$res" .; else cp "$res"/* "$OUT"/; fi
ls -la "$OUT"
[ -n "${WORK:-}" ] || [ "$DEVICE" = cuda ] || rm -rf "$work"  # a CPU rehearsal leaves nothing in /tmp
