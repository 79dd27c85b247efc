#!/usr/bin/env bash
# Session 6, issue 2 (carry .carry_b .whl, after stage_weights.sh): the GPU tests of the overlap
# scheduler, host copies, CUDA graphs, decode attention and the fused kernels, plus the bound's arithmetic;
# offline throughput vs HF on real SmolLM2 (median of 3 timed runs each side) with the workload's
# lower bound at this GPU's measured rates. Results in $OUT. Set SGL_KVXFER_COMMIT to the commit.
set -uo pipefail
source scripts/gpu/env.sh || exit 1
python3 -m pytest test/engine/test_overlap.py test/engine/test_cuda_graph.py test/engine/test_triton_backend.py \
    test/engine/test_host_copy.py test/kernels/test_fused_elementwise.py test/kernels/test_rope_store.py test/kernels/test_decode_attention.py \
    -m gpu -q -p no:cacheprovider -rs 2>&1 | grep -v Warning | tee "$OUT/pytest_gpu.log" | tail -3
python3 -m pytest test/benchmarks -q -p no:cacheprovider 2>&1 | tee "$OUT/pytest_roofline.log" | tail -1
python3 benchmarks/throughput/offline.py --model-path smollm2-135m --dtype bfloat16 --num-prompts 256 \
    --output-len 128 --hf-batch-size 128 256 --repeats 3 --mem-fraction-static 0.5 --out-dir "$OUT" 2>&1 \
    | grep -v Warning | grep -v clean_up
