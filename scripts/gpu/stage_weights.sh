#!/usr/bin/env bash
# Call 1 (carry .carry_a): park the first half of the GGUF on the warm machine.
set -euo pipefail
mkdir -p /tmp/m && cp .carry_a/part_a /tmp/m/part_a && ls -la /tmp/m && nvidia-smi -L
