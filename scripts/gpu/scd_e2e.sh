#!/usr/bin/env bash
# SCD end to end on two GPUs (benchmarks/pd/scd_e2e.py): the base model (producer) prefills on
# GPU0, N = 1 / 2 / 4 specialists decode on GPU1, Llama-3-8B shape with dummy weights and random
# SCD artifacts (timing only), 8k-token documents; TTFT includes the producer's prefill; fan-out
# vs each specialist prefilling itself, and a document already in the producer's radix cache.
# Link: unpaced and paced 25 / 100 / 200 Gbit/s in the engine.
#
#   run  kind nvidia-h100-x2  carry [.whl, .whl_pd_a]  SGL_KVXFER_COMMIT=<hash> bash scripts/gpu/scd_e2e.sh
#        (TRANSFER_BACKEND=<name> picks another PD transfer backend; default mooncake over TCP)
#   CPU rehearsal (tiny preset, N = 1 / 2): DEVICE=cpu OUT=<dir> bash scripts/gpu/scd_e2e.sh
#
# Back in $OUT: scd_e2e_<shape>.json / .png (rewritten after each N: a run cut short keeps what
# finished), scd_e2e.log. Expected wall time on H100 x2: about 3-4 minutes.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1
DEVICE=${DEVICE:-cuda}
export OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
W=$(mktemp -d "${TMPDIR:-/tmp}/scd_e2e.XXXXXX")
trap 'rm -rf "$W"' EXIT
if [ "$DEVICE" = cuda ]; then
  source scripts/gpu/env.sh || exit 1
  PRESET=llama-3-8b VOCAB=128256
  ARGS=(--prompt-tokens ${PROMPTS:-8192} --fanouts 1 2 4 --rates 0 25 100 200 --repeats ${REPEATS:-5}
        --producer-gpu 0 --consumer-gpu 1 --transfer-backend "${TRANSFER_BACKEND:-mooncake}")
  SERVER="--load-format dummy --dtype bfloat16 --device cuda --mem-fraction-static 0.95 --max-total-tokens 8600 --chunked-prefill-size 2048 --disable-cuda-graph --log-level warning"
  NAME=scd_e2e_llama-3-8b_$(python3 -c "import torch; print(torch.cuda.get_device_name(0).split()[1])")
  T=${T_E2E:-560}
else
  PRESET=tiny VOCAB=512
  ARGS=(--prompt-tokens 64 --fanouts 1 2 --rates 0 25 --repeats 2 --question-tokens 8 --transfer-backend "${TRANSFER_BACKEND:-mooncake}")
  SERVER="--load-format dummy --device cpu --max-total-tokens 2048 --log-level warning"
  NAME=scd_e2e_tiny_cpu
  T=${T_E2E:-1500}
fi
MODEL=$W/model_$PRESET
python3 -c "
from sgl_kvxfer.models.presets import write_preset_config as w, write_dummy_tokenizer as t
t(w('$PRESET', '$MODEL'), $VOCAB)" || exit 1
timeout -s INT -k 30 "$T" python3 benchmarks/pd/scd_e2e.py "${ARGS[@]}" --vocab $((VOCAB - 256)) --name "$NAME" \
    --out-dir "$OUT" --server-args "--model-path $MODEL $SERVER" 2>&1 | tee "$OUT/scd_e2e.log"
ls -la "$OUT"
