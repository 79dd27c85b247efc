#!/usr/bin/env bash
# On the GPU machine (carry .whl): the GPU-marked tests, with the log written to $OUT/gpu_tests.log.
#   bash scripts/gpu/run_gpu_tests.sh                                  # every test file with a gpu mark
#   bash scripts/gpu/run_gpu_tests.sh test/kernels/test_tiered_pool_decode.py -x  # files / pytest options
# With no arguments it collects only the files that hold GPU tests, so the client packages the
# other test modules import (sglang, openai, ...) need not travel. GPU tests use dummy weights.
set -uo pipefail
source scripts/gpu/env.sh || exit 1
if [ $# -eq 0 ]; then
  mapfile -t files < <(grep -rlE "mark\.gpu" test --include='test_*.py' | sort)
  set -- "${files[@]}"
fi
python3 -m pytest -m gpu -q -rs -p no:cacheprovider "$@" 2>&1 | tee "$OUT/gpu_tests.log" | tail -30
