#!/usr/bin/env bash
# Session 8 (carry .whl .carry_tok): GPU tests of the tiled extend launch and CUDA-graph prefill,
# then prefill graphs off / on, SmolLM2 shape with dummy weights, ours only, runs alternating,
# and one phase timeline with graphs on. Results in $OUT. Set SGL_KVXFER_COMMIT to the commit.
set -uo pipefail
source scripts/gpu/env.sh >/dev/null || exit 1
python3 -m pytest test/kernels/test_extend_attention.py test/engine/test_prefill_graph.py \
    test/engine/test_cuda_graph.py -m gpu -q -p no:cacheprovider -rs -x 2>&1 | grep -v Warning \
    | tee "$OUT/pytest_prefill_graph.log" | tail -15
common=(--model-path .carry_tok/smol --load-format dummy --dtype bfloat16 --skip-hf --repeats 3
        --mem-fraction-static 0.5 --max-prefill-tokens 32768)
for i in 1 2; do for g in off on; do
  echo -n "prefill graphs $g (round $i): "
  flag=(); [ $g = on ] && flag=(--enable-prefill-cuda-graph)
  python3 benchmarks/throughput/offline.py "${common[@]}" "${flag[@]}" --tag pg${g}_r$i \
      --out-dir "$OUT" 2>&1 | grep -E "^sgl_kvxfer|Error|error" | head -5
done; done
python3 benchmarks/throughput/phase_profile.py --model-path .carry_tok/smol --load-format dummy --dtype bfloat16 \
    --mem-fraction-static 0.5 --max-prefill-tokens 32768 --enable-prefill-cuda-graph --timeline --tag pg_on --out-dir "$OUT" 2>&1 \
    | grep -v Warning | tail -25
