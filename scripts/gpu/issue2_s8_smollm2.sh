#!/usr/bin/env bash
# Session 8, issue 2 (carry .carry_b .whl .carry_tok, right after stage_weights.sh): offline
# throughput vs HF on real SmolLM2 (median of 3 timed runs each side), 32768-token prefill budget
# with CUDA-graph prefill; then ours alone without prefill graphs and at the default budget, on
# the same machine; then the GPU tests of CUDA-graph prefill. Results in $OUT. Set
# SGL_KVXFER_COMMIT to the commit; ONLY_MAIN=1 stops after the comparison with HF.
set -uo pipefail
source scripts/gpu/env.sh || exit 1
common=(--model-path smollm2-135m --dtype bfloat16 --num-prompts 256 --output-len 128 --repeats 3 --mem-fraction-static 0.5)
python3 benchmarks/throughput/offline.py "${common[@]}" --max-prefill-tokens 32768 --enable-prefill-cuda-graph \
    --hf-batch-size 128 256 --out-dir "$OUT" 2>&1 | grep -v Warning | grep -v clean_up
[ "${ONLY_MAIN:-0}" = 1 ] && exit 0  # another machine's ratio: the comparison alone
python3 benchmarks/throughput/offline.py "${common[@]}" --max-prefill-tokens 32768 --skip-hf \
    --tag no_prefill_graph --out-dir "$OUT" 2>&1 | grep -E "^sgl_kvxfer"
python3 benchmarks/throughput/offline.py "${common[@]}" --skip-hf --tag default_config \
    --out-dir "$OUT" 2>&1 | grep -E "^sgl_kvxfer"
python3 -m pytest test/kernels/test_extend_attention.py test/engine/test_prefill_graph.py -m gpu -q \
    -p no:cacheprovider -rs 2>&1 | grep -v Warning | tee "$OUT/pytest_prefill_graph.log" | tail -1
