#!/usr/bin/env bash
# Session 7, issue 2 (carry .carry_b .whl .carry_tok, right after stage_weights.sh): offline
# throughput vs HF on real SmolLM2 (median of 3 timed runs each side) with a 32768-token prefill
# budget, then ours alone at the default budget (16384) on the same machine; then the GPU tests
# of the paths this session touched. Results in $OUT. Set SGL_KVXFER_COMMIT to the commit.
set -uo pipefail
source scripts/gpu/env.sh || exit 1
common=(--model-path smollm2-135m --dtype bfloat16 --num-prompts 256 --output-len 128 --repeats 3 --mem-fraction-static 0.5)
python3 benchmarks/throughput/offline.py "${common[@]}" --max-prefill-tokens 32768 --hf-batch-size 128 256 \
    --out-dir "$OUT" 2>&1 | grep -v Warning | grep -v clean_up
python3 benchmarks/throughput/offline.py "${common[@]}" --skip-hf --tag default_prefill_budget \
    --out-dir "$OUT" 2>&1 | grep -E "^sgl_kvxfer"
python3 benchmarks/kernels/launch_overhead.py --out-dir "$OUT" 2>&1 | grep "us/call"
python3 -m pytest test/kernels/test_tuned_launch.py -q -p no:cacheprovider 2>&1 | tee "$OUT/pytest_tuned_launch.log" | tail -1
python3 -m pytest test/kernels/test_decode_attention.py test/kernels/test_extend_attention.py \
    test/engine/test_overlap.py test/engine/test_triton_backend.py test/engine/test_cuda_graph.py \
    -m gpu -q -p no:cacheprovider -rs 2>&1 | grep -v Warning | tee "$OUT/pytest_gpu.log" | tail -2
