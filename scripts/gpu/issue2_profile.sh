#!/usr/bin/env bash
# Call 2 (carry .carry_b .whl): verify the fused elementwise kernels on the GPU (kernel tests,
# CUDA-graph engine tests and greedy agreement with them on vs off, real SmolLM2), then split the
# offline runs of both models by phase with per-phase kernel tables. Results land in $OUT.
set -uo pipefail
source scripts/gpu/env.sh || exit 1
export SGL_KVXFER_FUSED_ELEMENTWISE=1
python3 -m pytest test/kernels/test_fused_elementwise.py test/engine/test_cuda_graph.py -q -p no:cacheprovider \
    -rs 2>&1 | grep -v Warning | tee "$OUT/pytest_fused_gpu.log" | tail -15
python3 benchmarks/throughput/backend_agreement.py --compare fused --model-path smollm2-135m --num-prompts 10 \
    --output-len 32 --dtypes bfloat16 float16 --out-dir "$OUT" 2>&1 | grep -v Warning
python3 benchmarks/throughput/phase_profile.py --model-preset llama-3-8b --dtype bfloat16 --num-prompts 128 \
    --output-len 128 --mem-fraction-static 0.6 --torch-profile --out-dir "$OUT" 2>&1 | grep -v Warning
python3 benchmarks/throughput/phase_profile.py --model-path smollm2-135m --dtype bfloat16 --num-prompts 256 \
    --output-len 128 --mem-fraction-static 0.5 --torch-profile --out-dir "$OUT" 2>&1 | grep -v Warning
