#!/usr/bin/env bash
# Call 3 of the session-5 issue-2 run (carry .whl .carry_tok: dummy weights, the SmolLM2 tokenizer for the prompts): offline throughput of
# the Llama-3-8B shape vs HF (median of 3 timed runs each side) and its phase profile. Results
# in $OUT. Set SGL_KVXFER_COMMIT to the commit under test.
set -uo pipefail
source scripts/gpu/env.sh || exit 1
python3 benchmarks/throughput/offline.py --model-preset llama-3-8b --tokenizer-path .carry_tok/smol --dtype bfloat16 --num-prompts 128 \
    --output-len 128 --hf-batch-size 128 --repeats 3 --mem-fraction-static 0.6 --roofline-batch 64 \
    --out-dir "$OUT" 2>&1 | grep -v Warning | grep -v clean_up
python3 benchmarks/throughput/phase_profile.py --model-preset llama-3-8b --tokenizer-path .carry_tok/smol --dtype bfloat16 --num-prompts 128 \
    --output-len 128 --mem-fraction-static 0.6 --timeline --out-dir "$OUT" 2>&1 | grep -v Warning \
    | grep -v clean_up > "$OUT/phase_profile_llama8b.log"; tail -6 "$OUT/phase_profile_llama8b.log"
ls "$OUT"
