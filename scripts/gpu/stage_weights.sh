#!/usr/bin/env bash
# On the GPU machine, the embedded GGUF in three parts (one call carries <= 64 MiB with the
# working tree, about 19 MB of it), over three calls of one warm machine:
#   bash scripts/gpu/stage_weights.sh         (carry .carry_a)  park the first part in /tmp/m
#   bash scripts/gpu/stage_weights.sh add     (carry .carry_b)  append the second part to it
#   bash scripts/gpu/stage_weights.sh join    (carry .carry_c)  append the third: /tmp/m/smollm2.gguf,
#       for a next call whose carry has no room for .carry_c (env.sh finds the joined file)
# Otherwise the next call, made while the machine is still warm, carries .carry_c and env.sh joins
# the parts; either way env.sh converts the model to /tmp/models.
set -euo pipefail
case "${1:-}" in
  add|join)
    [ -f /tmp/m/partial ] || { echo "no first part in /tmp/m: run stage_weights.sh (carry .carry_a) first" >&2; exit 1; }
    if [ "$1" = add ]; then
      [ -f /tmp/m/has_b ] && { echo "the second part is already in /tmp/m/partial" >&2; exit 1; }
      cat .carry_b/part_b >> /tmp/m/partial && touch /tmp/m/has_b
    else
      [ -f /tmp/m/has_b ] || { echo "no second part: run stage_weights.sh add (carry .carry_b) first" >&2; exit 1; }
      cat /tmp/m/partial .carry_c/part_c > /tmp/m/smollm2.gguf
    fi
    ls -la /tmp/m; exit 0 ;;
  "") ;;
  *) sed -n '2,9p' "$0"; exit 2 ;;
esac
# a fresh start: this script's own two marker files from an earlier staging go, nothing else
M=/tmp/m
mkdir -p "$M" && cp .carry_a/part_a "$M/partial" && rm -f "$M/has_b" "$M/smollm2.gguf" && ls -la "$M" && nvidia-smi -L
