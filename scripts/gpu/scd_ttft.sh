#!/usr/bin/env bash
# On the GPU machine: SCD over PD TTFT at the Llama-3-8B shape (dummy weights, random SCD
# artifacts: timing only), oracle vs SCD codes vs raw KV vs 4-bit KV at 10 / 25 / 100 / 200
# Gbit/s, prompts of 1k-4k tokens (benchmarks/pd/scd_ttft.py). Producer and consumer servers
# share the one GPU (one pair at a time); the KV and codes move over Mooncake TCP through host
# memory. Results (JSON, PNG, log) go to $OUT.
#
# PD needs Mooncake (.whl_pd_a) and sglang-router (.whl_pd_b), more than one call can carry, so
# two calls back to back on one warm machine:
#   run  carry [.whl, .whl_pd_a]  bash scripts/gpu/scd_ttft.sh stage
#   run  carry [.whl, .whl_pd_b]  SGL_KVXFER_COMMIT=<hash> bash scripts/gpu/scd_ttft.sh
# Expected: stage about 1 min; the run 4-6 min (three server pairs of two 8B models start once
# each, ~270 streamed requests). The JSON is rewritten after every mode, so a run cut short still
# returns the modes it finished. CPU check at toy size: OUT=/tmp/x DEVICE=cpu bash scripts/gpu/scd_ttft.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
if [ "${1:-}" = stage ]; then
  source scripts/gpu/env.sh || exit 1
  python3 -c "import mooncake.engine; print('mooncake staged')" 2>&1 | tee "$OUT/stage.log"
  exit 0
fi
DEVICE=${DEVICE:-cuda}
if [ "$DEVICE" = cuda ]; then
  source scripts/gpu/env.sh || exit 1
  PRESET=llama-3-8b VOCAB=128256 PROMPTS="1024 2048 4096" REPEATS=${REPEATS:-2}
  SERVER="--load-format dummy --dtype bfloat16 --device cuda --mem-fraction-static 0.6 --max-total-tokens 20000 --disable-cuda-graph --log-level warning"
  NAME=scd_ttft_llama-3-8b_$(python3 -c "import torch; print(torch.cuda.get_device_name(0).split()[1])")
else  # the CPU check: the same steps on the tiny preset
  export OUT=${OUT:-/tmp/out}
  mkdir -p "$OUT"
  PRESET=tiny VOCAB=512 PROMPTS="32 64" REPEATS=1
  SERVER="--load-format dummy --device cpu --max-total-tokens 2048 --log-level warning"
  NAME=scd_ttft_tiny_cpu
fi
MODEL=/tmp/scd_ttft_model_$PRESET
python3 -c "
from sgl_kvxfer.models.presets import write_preset_config as w, write_dummy_tokenizer as t
t(w('$PRESET', '$MODEL'), $VOCAB)" || exit 1
python3 benchmarks/pd/scd_ttft.py --prompts $PROMPTS --rates 10 25 100 200 --repeats "$REPEATS" \
    --vocab $((VOCAB - 256)) --name "$NAME" --out-dir "$OUT" \
    --server-args "--model-path $MODEL $SERVER" --producer-args "--random-seed 1" --consumer-args "--random-seed 2" \
    2>&1 | tee "$OUT/scd_ttft.log"
ls -la "$OUT"
