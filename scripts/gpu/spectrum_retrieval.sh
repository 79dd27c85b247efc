#!/usr/bin/env bash
# SpectrumKV's retrieval test bed in one GPU call (at most T_TOTAL = 520 s, about 8.5 min, alone or
# beside another script on one H100), results in $OUT. Stages (arguments, in this order; default
# `all` = tests train eval decode):
#   tests   (CUDA only) test/spectrum/test_cold_tier.py, whose GPU test runs the side-stream promotion
#   train   SmolLM2-135M-Instruct fully fine-tuned on the task suite's key-value retrieval: the first
#           SHORT_FRAC of the items at SHORT_CTX tokens, then TRAIN_CTX (scripts/train/finetune.py
#           through scripts/gpu/spectrum_train.py); SmolLM2-135M has 8192 positions (RoPE theta
#           1e5), so 8000-token prompts need no RoPE scaling; the weights stay in /tmp, never in the repo
#   eval    benchmarks/quality/retrieval_tiers.py on it: fp16 at EVAL_CTX and LONG_CTX, the per-layer
#           profile, lambda and threshold by validation, then the table method by method at
#           b = 0.3, 0.2, 0.5 (triton attention; kivi, per-layer and their spectrumkv control on
#           torch), heatmaps; the JSON is rewritten after every point, in $OUT as it runs
#   decode  benchmarks/throughput/cold_tier_decode.py: the cold tier's decode cost at the
#           Llama-3-8B shape (dummy weights), 16k x 8, b = 0.2, triton backend, CUDA graphs
# Each stage runs under `timeout -s INT` (tests 60, T_TRAIN / T_EVAL / T_DECODE: 250 / 240 / 100 s,
# each cut to what is left of T_TOTAL) and keeps what it measured.
# $OUT (7 files): retrieval_tiers_*.json/.png, layer_profile_*.json, cold_tier_decode_*.json,
# train_log.json, loss.png, spectrum_logs.tar.gz; PACK=1: all of them in one $OUT/spectrum.tar.gz.
# Shares a machine: OUT may be any folder (a subfolder of the call's $OUT), WORK defaults to a fresh
# mktemp folder, item building uses WORKERS (8) processes, and every engine has an explicit KV
# pool (--max-total-tokens 400000: about 9.2 GB each for SmolLM2-135M; two live at a time) so it
# takes no share of GPU memory another process holds; peak about 25 GB (the decode stage: the
# Llama-3-8B dummy weights, 16 GB, and its tiered pool for 16k x 8).
#
# GPU, two calls on one warm machine (scripts/gpu/README.md):
#   run carry [.carry_a]                      bash scripts/gpu/stage_weights.sh
#   run carry [.carry_b, .whl, .cache/data]   SGL_KVXFER_COMMIT=<hash> bash scripts/gpu/spectrum_retrieval.sh [STAGE...]
# beside scd_quality.sh on one H100 (env.sh once first, then each script in its own OUT subfolder):
#   source scripts/gpu/env.sh; PACK=1 OUT=$OUT/spec bash scripts/gpu/spectrum_retrieval.sh &
#   OUT=$OUT/scd bash scripts/gpu/scd_quality.sh; wait
# CPU rehearsal (a random tiny Llama with SmolLM2's tokenizer, tiny contexts, minutes):
#   DEVICE=cpu OUT=/tmp/x bash scripts/gpu/spectrum_retrieval.sh
set -uo pipefail
stages=" ${*:-all} "
for s in $stages; do
  case $s in all|tests|train|eval|decode) ;; *) sed -n '2,33p' "$0"; exit 2 ;; esac
done
[ "$stages" = " all " ] && stages=" tests train eval decode "
want() { [[ $stages == *" $1 "* ]]; }
export OUT=${OUT:-/tmp/out} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
DEVICE=${DEVICE:-cuda}
mkdir -p "$OUT"
work=${WORK:-$(mktemp -d "${TMPDIR:-/tmp}/spectrum_run.XXXXXX")}
mkdir -p "$work"
say() { echo "== $* ($(date +%T))"; }
T0=$(date +%s)
T_TOTAL=${T_TOTAL:-520}
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
  T_TRAIN=${T_TRAIN:-250} T_EVAL=${T_EVAL:-240} T_DECODE=${T_DECODE:-100}
  # 8000, not 8192: the prompt (+ chat template and answer) stays inside SmolLM2's 8192 positions
  TRAIN_CTX=${TRAIN_CTX:-8000} TRAIN_S=${TRAIN_S:-200} ITEMS=${ITEMS:-2400} WORKERS=${WORKERS:-8}
  SHORT_CTX=${SHORT_CTX:-4000} SHORT_FRAC=${SHORT_FRAC:-0.3}
  TRAIN_ARGS=${TRAIN_ARGS:-"--batch-size 2 --grad-accum 4 --lr 3e-4 --warmup 20 --steps 3000"}
  EVAL_CTX=${EVAL_CTX:-4096} LONG_CTX=${LONG_CTX:-8000}
  # the methods in the order they matter to the table (a run cut short keeps the first ones whole)
  EVAL_ARGS=${EVAL_ARGS:-"--backend triton --depths 11 --trials-per-depth 3 --long-trials-per-depth 4
    --val-trials 16 --val-budgets 0.2 --lambdas 0 3e-4 1e-3 --cold-thresholds 0.01 0.05 --ppl-windows 2
    --profile-samples 8 --max-new-tokens 8 --max-total-tokens 400000
    --methods spectrumkv random-tier spectrumkv-torch per-layer cold-tier uniform-int4 kivi uniform-int8
    pdtrim sws balanced adaptive-2tier greedy"}
  DECODE_ARGS=${DECODE_ARGS:-"--preset llama-3-8b --context 16384 --batch 8 --kv-tier-budget 0.2 --n1 16
    --n2 80 --repeats 5 --intervals 16 4"}
else
  [ -e sgl_kvxfer/kernels ] || ln -s ../kernels sgl_kvxfer/kernels
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
  [ -d "$work/base" ] || python3 scripts/train/make_tiny_model.py --out "$work/base" --layers 2 --hidden 64 \
      --heads 4 --kv-heads 2 > /dev/null
  BASE=$work/base
  T_TRAIN=${T_TRAIN:-900} T_EVAL=${T_EVAL:-1800} T_DECODE=${T_DECODE:-900}
  TRAIN_CTX=${TRAIN_CTX:-256} TRAIN_S=${TRAIN_S:-60} ITEMS=${ITEMS:-16} WORKERS=${WORKERS:-2}
  SHORT_CTX=${SHORT_CTX:-128} SHORT_FRAC=${SHORT_FRAC:-0.5}
  TRAIN_ARGS=${TRAIN_ARGS:-"--batch-size 2 --grad-accum 1 --lr 1e-3 --warmup 2 --steps 3"}
  EVAL_CTX=${EVAL_CTX:-256} LONG_CTX=${LONG_CTX:-384}
  EVAL_ARGS=${EVAL_ARGS:-"--quick --budgets 0.3 0.2 --ppl-context 128 --ppl-chunk 16 --profile-batch 2
    --cold-thresholds 0.02 0.1"}
  DECODE_ARGS=${DECODE_ARGS:-"--preset tiny --context 128 --batch 2 --n1 2 --n2 10 --repeats 2 --backend torch
    --forced-threshold 0.001"}
fi
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
      --model "$BASE" --mix kv=1 --task-param kv.context_tokens="$TRAIN_CTX" --out "$MODEL" \
      --time-limit-s "$TRAIN_S" --max-len $((TRAIN_CTX + 256)) --eval-n 0 --device "$DEVICE" $TRAIN_ARGS \
      2>&1 | grep -v "it/s\]$" | tee "$work/train.log"
fi
res=$OUT; [ "${PACK:-0}" = 1 ] && res=$work/pack  # results written as they come
mkdir -p "$res"
cp "$MODEL/train_log.json" "$MODEL/loss.png" "$res"/ 2>/dev/null
if [ ! -f "$MODEL/config.json" ]; then
  echo "no fine-tuned model at $MODEL: the evaluation runs on the base model"
  MODEL=$BASE
fi

if want eval; then
  say "eval: retrieval table on $MODEL"
  t_eval=$(left "$T_EVAL")
  # results straight into $res, so a run cut short has them; no new point starts after
  # --time-budget-s, 30 s before the stage's limit (a point takes seconds to tens of seconds)
  # shellcheck disable=SC2086
  timeout -s INT -k 10 "$t_eval" python3 benchmarks/quality/retrieval_tiers.py --model "$MODEL" --device "$DEVICE" \
      --context "$EVAL_CTX" --long-context "$LONG_CTX" --out-dir "$res" "${PROSE[@]}" $EVAL_ARGS \
      --time-budget-s $(( t_eval > 60 ? t_eval - 30 : t_eval / 2 )) 2>&1 | tee "$work/eval.log"
  for j in "$res"/retrieval_tiers_*.json; do  # a run cut short wrote its JSON after its last plot
    [ -f "$j" ] && [ "$j" -nt "${j%.json}.png" ] && timeout 60 python3 benchmarks/quality/retrieval_tiers.py --plot-only "$j"
  done
fi

if want decode; then
  say "decode: cold tier cost"
  # shellcheck disable=SC2086
  timeout -s INT "$(left "$T_DECODE")" python3 benchmarks/throughput/cold_tier_decode.py --device "$DEVICE" \
      --out-dir "$work" $DECODE_ARGS 2>&1 | tee "$work/decode.log"
fi

say "done after $(( $(date +%s) - T0 )) s"
dest=$OUT
[ "${PACK:-0}" = 1 ] && dest=$work/pack && mkdir -p "$dest"
cp "$work"/cold_tier_decode_*.json "$dest"/ 2>/dev/null
cp "$MODEL/train_log.json" "$MODEL/loss.png" "$dest"/ 2>/dev/null
tar -czf "$dest/spectrum_logs.tar.gz" -C "$work" $(cd "$work" && ls ./*.log 2>/dev/null)
[ "${PACK:-0}" = 1 ] && tar -czf "$OUT/spectrum.tar.gz" -C "$dest" .
ls -la "$OUT"
[ -n "${WORK:-}" ] || [ "$DEVICE" = cuda ] || rm -rf "$work"  # a CPU rehearsal leaves nothing in /tmp
