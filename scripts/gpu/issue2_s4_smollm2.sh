#!/usr/bin/env bash
# Call 2 of the session-4 issue-2 run (carry .carry_b .whl, after stage_weights.sh): GPU tests of
# the fused RoPE + KV store and the fused kernels (now the CUDA default), greedy agreement fused
# vs unfused on real SmolLM2, offline throughput vs HF (median of 3 timed runs each side), and
# the phase profile. Results in $OUT. Set SGL_KVXFER_COMMIT to the commit under test.
set -uo pipefail
source scripts/gpu/env.sh || exit 1
python3 -m pytest test/kernels/test_fused_elementwise.py test/kernels/test_rope_store.py \
    test/engine/test_triton_backend.py test/engine/test_cuda_graph.py \
    test/engine/test_overlap.py::test_overlap_on_cuda_graphs -q -p no:cacheprovider -rs 2>&1 \
    | grep -v Warning | tee "$OUT/pytest_gpu.log" | tail -8
python3 benchmarks/throughput/backend_agreement.py --compare fused --model-path smollm2-135m --num-prompts 10 \
    --output-len 32 --dtypes bfloat16 --out-dir "$OUT" 2>&1 | grep -v Warning | tail -3
python3 benchmarks/throughput/offline.py --model-path smollm2-135m --dtype bfloat16 --num-prompts 256 \
    --output-len 128 --hf-batch-size 128 256 --repeats 3 --mem-fraction-static 0.5 --out-dir "$OUT" 2>&1 \
    | grep -v Warning | grep -v clean_up
python3 benchmarks/throughput/phase_profile.py --model-path smollm2-135m --dtype bfloat16 --num-prompts 256 \
    --output-len 128 --mem-fraction-static 0.5 --torch-profile --out-dir "$OUT" 2>&1 | grep -v Warning \
    | grep -v clean_up > "$OUT/phase_profile_smollm2.log"; tail -6 "$OUT/phase_profile_smollm2.log"
ls "$OUT"
