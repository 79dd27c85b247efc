#!/usr/bin/env bash
# Session 6 (carry .whl): decode attention at SmolLM2 heads (batch 256) and Llama-3-8B heads
# (batch 64), fp16 pages per step 1 / 2 / 4 against launch configs with fewer pipeline stages
# and warps (less shared memory per program, more programs per SM). Results in $OUT.
set -uo pipefail
source scripts/gpu/env.sh >/dev/null || exit 1
run() { python3 benchmarks/kernels/decode_plan.py --pages-per-iter 1 2 4 --empty-tiers 0 --splits 1 \
    --configs 4:1 2:1 2:2 4:2 8:1 --out-dir "$OUT" "$@" 2>&1 | grep -v Warning | grep "us (" | sed "s/, num_ctas: 1//; s/, maxnreg: None//"; }
echo "== SmolLM2 heads, B 256"; run --tag smollm2_occ
echo "== 8B heads, B 64"; run --tag llama8b_b64_occ --batch 64 --q-heads 32 --kv-heads 8 --head-dim 128
