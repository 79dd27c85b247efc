#!/usr/bin/env bash
# Session 7 (carry .whl .carry_tok): host cost per kernel launch on the prefill path; the GPU
# tests of the engine paths this session touched (batch packing, longest-first decode order);
# prefill budget A/B, SmolLM2 shape with dummy weights, ours only, runs alternating.
set -uo pipefail
source scripts/gpu/env.sh >/dev/null || exit 1
python3 benchmarks/kernels/launch_overhead.py --cprofile --out-dir "$OUT" 2>&1 | grep -v Warning | head -40
python3 -m pytest test/engine/test_overlap.py test/engine/test_cuda_graph.py test/engine/test_triton_backend.py \
    test/engine/test_host_copy.py -m gpu -q -p no:cacheprovider 2>&1 | tee "$OUT/pytest_gpu.log" | tail -1
for i in 1 2; do for mpt in 16384 32768; do
  echo -n "max_prefill_tokens $mpt (round $i): "
  python3 benchmarks/throughput/offline.py --model-path .carry_tok/smol --load-format dummy --dtype bfloat16 \
      --skip-hf --repeats 3 --mem-fraction-static 0.5 --max-prefill-tokens $mpt --tag mpt${mpt}_r$i \
      --out-dir "$OUT" 2>&1 | grep -E "^sgl_kvxfer"
done; done
