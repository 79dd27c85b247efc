#!/usr/bin/env bash
# CUDA-graph decode on the GPU machine (carry .whl, see README.md): the GPU tests of the graph
# runner, the Triton backend and the decode kernel, then decode step time with graphs on vs off
# (dummy SmolLM2 and Llama-3-8B shapes, batch 1/8/64). The pytest log and JSON land in $OUT.
set -uo pipefail
source scripts/gpu/env.sh || exit 1
python3 -m pytest test/engine/test_cuda_graph.py test/engine/test_triton_backend.py \
    test/kernels/test_decode_attention.py test/kernels/test_fused_elementwise.py -q -p no:cacheprovider -rs 2>&1 | tee "$OUT/pytest_cuda_graph.log"
python3 benchmarks/throughput/decode_step.py --presets smollm2-135m llama-3-8b --batches 1 8 64 \
    --out-dir "$OUT" 2>&1 | grep -v Warning
