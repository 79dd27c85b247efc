#!/usr/bin/env bash
# Triton decode over the SpectrumKV tiered pool on the GPU machine (carry .whl): the GPU tests of
# the token-gather kernel and backend, then end-to-end decode tok/s of a dummy Llama-3-8B shape at
# 32k context x batch 8 for tier budgets 1.0 / 0.5 / 0.25 (triton and torch backends).
set -uo pipefail
source scripts/gpu/env.sh || exit 1
python3 -m pytest test/kernels/test_gather_decode_attention.py test/engine/test_triton_tiered_backend.py \
    -m gpu -q -p no:cacheprovider -rs 2>&1 | tee "$OUT/gather_gpu_tests.txt"
python3 benchmarks/throughput/e2e_decode.py --preset llama-3-8b --context 32768 --batch 8 \
    --kv-tier-budgets 1.0 0.5 0.25 --backends ${BACKENDS:-triton torch} --steps 24 --warmup 4 \
    --out-dir "$OUT" 2>&1 | grep -v Warning
ls -la "$OUT"
