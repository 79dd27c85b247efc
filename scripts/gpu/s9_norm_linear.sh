#!/usr/bin/env bash
# Session 9 (carry .whl): GPU tests of the fused norm+linear kernel and of the CUDA-graph runners
# (decode and prefill; their shared capture loop was refactored after session 8's GPU run), then
# the norm+linear sweep (benchmarks/kernels/norm_linear.py). Results in $OUT. Set
# SGL_KVXFER_COMMIT to the commit.
set -uo pipefail
source scripts/gpu/env.sh >/dev/null || exit 1
python3 -m pytest test/kernels/test_fused_norm_linear.py test/engine/test_prefill_graph.py \
    test/engine/test_cuda_graph.py -m gpu -q -p no:cacheprovider -rs 2>&1 | grep -v Warning \
    | tee "$OUT/pytest_norm_linear.log" | tail -15
python3 benchmarks/kernels/norm_linear.py ${NL_ARGS:-} --out-dir "$OUT" 2>&1 | grep -v "Warning\|skip " | tail -60
