#!/usr/bin/env bash
# Session 7 probe (carry .whl .carry_tok): decode attention in batch order vs longest request
# first; where the host's time goes per phase (host_breakdown) with each order; the prefill
# batch budget (max_prefill_tokens) against end-to-end time. SmolLM2 shape, dummy weights.
# Results in $OUT. Set SGL_KVXFER_COMMIT to the commit.
set -uo pipefail
source scripts/gpu/env.sh >/dev/null || exit 1
SMOL=.carry_tok/smol
python3 -m pytest test/kernels/test_decode_attention.py test/engine/test_cuda_graph.py test/engine/test_triton_backend.py \
    -m gpu -q -p no:cacheprovider 2>&1 | tee "$OUT/pytest_gpu.log" | tail -1
plan() { python3 benchmarks/kernels/decode_plan.py --empty-tiers 0 --order none longest --out-dir "$OUT" "$@" 2>&1 | grep -v Warning | grep -E "^num_warps" | sed 's/num_ctas: 1, //; s/, maxnreg: None//'; }
plan --tag smollm2_order --pages-per-iter 1 2 --splits 1 2 --configs 4:2 2:2
plan --tag llama8b_b64_order --batch 64 --q-heads 32 --kv-heads 8 --head-dim 128 --splits 1 2 4 --configs 4:2
plan --tag llama8b_b128_order --batch 128 --q-heads 32 --kv-heads 8 --head-dim 128 --splits 1 2 --configs 4:2
for lf in 0 1; do
  echo "=== phase_profile, SGL_KVXFER_DECODE_LONGEST_FIRST=$lf"
  SGL_KVXFER_DECODE_LONGEST_FIRST=$lf python3 benchmarks/throughput/phase_profile.py --model-path $SMOL --load-format dummy \
      --dtype bfloat16 --mem-fraction-static 0.5 --timeline --host-breakdown --tag lf$lf --out-dir "$OUT" 2>&1 \
      | grep -v Warning | grep -E "^timeline|^unsynced|^extend|^decode|^outside|^host|---| ms " | head -70
done
for run in "16384 0" "16384 1" "32768 1" "65536 1"; do
  read -r mpt lf <<< "$run"
  {
    echo -n "max_prefill_tokens $mpt longest_first $lf: "
    SGL_KVXFER_DECODE_LONGEST_FIRST=$lf python3 benchmarks/throughput/offline.py --model-path $SMOL --load-format dummy \
        --dtype bfloat16 --skip-hf --repeats 3 --mem-fraction-static 0.5 --max-prefill-tokens $mpt \
        --tag mpt${mpt}_lf$lf --out-dir "$OUT" 2>&1 | grep -E "^sgl_kvxfer"
  }
done
