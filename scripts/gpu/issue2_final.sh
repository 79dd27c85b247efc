#!/usr/bin/env bash
# Call 2 (carry .carry_b .whl): issue 2 closing run. GPU tests of what changed (overlapped decode
# on CUDA graphs, fused elementwise kernels, CUDA graphs), then offline throughput
# against HF generate at its full batch for SmolLM2 (real weights) and the Llama-3-8B shape
# (dummy weights) with the decode-step roofline, and phase profiles of both. Results in $OUT.
set -uo pipefail
source scripts/gpu/env.sh || exit 1
# The 2026-11-22 run was made while the fused kernels were briefly the default; they are opt-in
# again (their RoPE test failed there), so the reproduction sets them explicitly.
export SGL_KVXFER_FUSED_ELEMENTWISE=1
python3 -m pytest test/engine/test_overlap.py::test_overlap_on_cuda_graphs test/engine/test_cuda_graph.py \
    test/kernels/test_fused_elementwise.py -q -p no:cacheprovider -rs 2>&1 | grep -v Warning \
    | tee "$OUT/pytest_gpu.log" | tail -8
bench() { python3 benchmarks/throughput/offline.py "$@" --out-dir "$OUT" 2>&1 | grep -v Warning; }
bench --model-path smollm2-135m --dtype bfloat16 --num-prompts 256 --output-len 128 --hf-batch-size 256 \
    --mem-fraction-static 0.5
bench --model-preset llama-3-8b --dtype bfloat16 --num-prompts 128 --output-len 128 --hf-batch-size 128 \
    --mem-fraction-static 0.6 --roofline-batch 64
prof() { python3 benchmarks/throughput/phase_profile.py "$@" --out-dir "$OUT" 2>&1 | grep -v Warning | tail -5; }
prof --model-preset llama-3-8b --dtype bfloat16 --num-prompts 128 --output-len 128 --mem-fraction-static 0.6
prof --model-path smollm2-135m --dtype bfloat16 --num-prompts 256 --output-len 128 --mem-fraction-static 0.5
ls "$OUT"
