#!/usr/bin/env bash
# Call 2 of the session-5 issue-2 run (carry .carry_b .whl, after stage_weights.sh): GPU tests
# of the overlap scheduler (host copy off the stream's tail, prefill overlap), decode attention, CUDA graphs and
# the fused kernels; offline throughput vs HF on real SmolLM2 (median of 3 timed runs each
# side); the phase profile with the host-vs-GPU timeline. Set SGL_KVXFER_COMMIT to the commit.
set -uo pipefail
source scripts/gpu/env.sh || exit 1
python3 -m pytest test/engine/test_overlap.py test/engine/test_cuda_graph.py test/engine/test_triton_backend.py \
    test/kernels/test_fused_elementwise.py test/kernels/test_rope_store.py test/kernels/test_decode_attention.py -m gpu -q -p no:cacheprovider -rs 2>&1 \
    | grep -v Warning | tee "$OUT/pytest_gpu.log" | tail -6
python3 benchmarks/throughput/offline.py --model-path smollm2-135m --dtype bfloat16 --num-prompts 256 \
    --output-len 128 --hf-batch-size 128 256 --repeats 3 --mem-fraction-static 0.5 --out-dir "$OUT" 2>&1 \
    | grep -v Warning | grep -v clean_up
python3 benchmarks/throughput/phase_profile.py --model-path smollm2-135m --dtype bfloat16 --num-prompts 256 \
    --output-len 128 --mem-fraction-static 0.5 --timeline --out-dir "$OUT" 2>&1 | grep -v Warning \
    | grep -v clean_up > "$OUT/phase_profile_smollm2.log"; tail -8 "$OUT/phase_profile_smollm2.log"
ls "$OUT"
