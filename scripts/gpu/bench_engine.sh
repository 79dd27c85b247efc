#!/usr/bin/env bash
# Call 2 (carry .carry_b .whl): offline throughput (SmolLM2 real weights; dummy Llama-3-8B) and
# triton-vs-torch greedy agreement on real SmolLM2 weights. HF generate runs every prompt in one
# batch by default (HF_BS_SMOL, HF_BS_8B): its best case. Results land in $OUT.
set -uo pipefail
source scripts/gpu/env.sh || exit 1
python3 benchmarks/throughput/offline.py --model-path smollm2-135m --dtype bfloat16 --num-prompts 256 \
    --output-len 128 --hf-batch-size ${HF_BS_SMOL:-256} --mem-fraction-static 0.5 --out-dir "$OUT" 2>&1 | grep -v Warning
python3 benchmarks/throughput/backend_agreement.py --model-path smollm2-135m --num-prompts 10 \
    --output-len 32 --dtypes bfloat16 float16 --out-dir "$OUT" 2>&1 | grep -v Warning
python3 benchmarks/throughput/offline.py --model-preset llama-3-8b --dtype bfloat16 --num-prompts 128 \
    --output-len 128 --hf-batch-size ${HF_BS_8B:-128} --mem-fraction-static 0.6 --roofline-batch 64 --out-dir "$OUT" 2>&1 | grep -v Warning
ls -la "$OUT"
