#!/usr/bin/env bash
# On the GPU machine (carry .carry_a): park the first half of the embedded GGUF in /tmp/m. The
# next call, made while the machine is still warm, carries .carry_b; env.sh joins the halves
# and converts the model to /tmp/models.
set -euo pipefail
mkdir -p /tmp/m && cp .carry_a/part_a /tmp/m/part_a && ls -la /tmp/m && nvidia-smi -L
