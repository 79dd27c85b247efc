#!/usr/bin/env bash
# SpectrumKV quality sweeps on the GPU machine (carry .carry_b .whl .cache/data right after
# stage_weights.sh, or .whl .cache/data once the model is converted; prepare .cache/data with
# `mkdir -p .cache/data && cp /work/shared/data/prose_eval.jsonl .cache/data/`).
# Stages: ppl [units...] | niah | decode. Results in $OUT.
#   bash scripts/gpu/quality.sh ppl bytes cost      # compressed-prefix PPL, 16 windows, 12 budgets, 9 methods
#   bash scripts/gpu/quality.sh niah decode         # NIAH 4096 x 19 depths x 4 budgets + probe + cosine
set -uo pipefail
source scripts/gpu/env.sh || exit 1
# The eval prose (and the int4 probe's filler) live at /work/shared/data on the CPU box; carry a
# copy as .cache/data (git-ignored) and put it where the code looks for it.
if [ ! -f /work/shared/data/prose_eval.jsonl ]; then
  mkdir -p /work/shared/data && cp .cache/data/prose_eval.jsonl /work/shared/data/ || exit 1
fi
MODEL=${SGL_KVXFER_MODEL_CACHE:-/tmp/models}/smollm2-135m-instruct  # converted by env.sh
POOL="--model $MODEL --device cuda --dtype bfloat16 --max-total-tokens 400000 --out-dir $OUT"
stage=${1:-ppl}; shift || true
for s in "$stage" "$@"; do
  case "$s" in
    ppl) units=("$@"); [ ${#units[@]} -eq 0 ] && units=(bytes)
         python3 benchmarks/quality/ppl_sweep.py $POOL --units "${units[@]}" 2>&1 | grep -v Warning | tee "$OUT/ppl_sweep.log"
         break ;;
    niah) python3 benchmarks/quality/niah.py $POOL 2>&1 | grep -v Warning | tee "$OUT/niah.log" ;;
    decode) python3 benchmarks/quality/decode_rule.py $POOL 2>&1 | grep -v Warning | tee "$OUT/decode_rule.log" ;;
  esac
done
ls -la "$OUT"
