#!/usr/bin/env bash
# On the GPU machine, the embedded GGUF in two halves (one call cannot carry both beside the rest):
#   bash scripts/gpu/stage_weights.sh         (carry .carry_a)  park the first half in /tmp/m
#   bash scripts/gpu/stage_weights.sh join    (carry .carry_b)  join the second half to it, for a
#       next call whose carry has no room for .carry_b (env.sh finds the joined file)
# Otherwise the next call, made while the machine is still warm, carries .carry_b and env.sh joins
# the halves; either way env.sh converts the model to /tmp/models.
set -euo pipefail
if [ "${1:-}" = join ]; then
  [ -f /tmp/m/part_a ] || { echo "no first half in /tmp/m: run stage_weights.sh (carry .carry_a) first" >&2; exit 1; }
  cat /tmp/m/part_a .carry_b/part_b > /tmp/m/smollm2.gguf && ls -la /tmp/m
  exit 0
fi
mkdir -p /tmp/m && cp .carry_a/part_a /tmp/m/part_a && ls -la /tmp/m && nvidia-smi -L
