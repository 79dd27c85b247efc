#!/usr/bin/env bash
# The FusedKV measurements in ONE call on a two-GPU host (nvidia-h100-x2), through testbeds_x2.sh:
#   GPU 0  fusedkv_all.sh long: the retrofit of SmolLM2-135M-Instruct from the closed-form start
#          (LONG_MIN 6.25 training minutes, the PPL-vs-GPU-minutes curve and its extrapolation),
#          then the task suite of both models (qa, kv, code; 30 items each) if time is left: the
#          report is on disk before the suite starts              (~420 s, then ~40 s of tasks)
#   GPU 1  fusedkv_all.sh serve scratch: serve_bench (Llama-3-8B shape, dummy weights; vanilla, Lite,
#          FusedKV in that order; warm TPOT, 5 paired repeats with spread and the bytes check at
#          1x8192 16x8192 64x4096 1x32768; TTFT at 8k / 32k; T_SERVE 220 s), then the
#          from-scratch grid (7 layouts x 3 seeds on 3 workers) with its steps planned for what
#          is left before the deadline (floor SCRATCH_MIN_STEPS 150)              (~220 + ~240 s)
# The deadline is WALL (560) - 25 s after the start; every stage ends by it (timeout -s INT, partial
# results kept). The parts start after env.sh's setup (wheels, the model converted: ~50 s).
# Back in $OUT: fusedkv.tar.gz (GPU 0), fusedkv2.tar.gz (GPU 1), testbeds.log; each tarball holds
# <part>/<part>.log, fusedkv_all.log, the stages' JSONs and fusedkv_results.tar.gz (JSONs + PNGs).
# 64x8192 and 16x32768 are not points: vanilla's KV there does not fit beside its weights on one H100.
#
#   run kind nvidia-h100-x2, carry [.carry_a]: bash scripts/gpu/stage_weights.sh
#   run kind nvidia-h100-x2, carry [.carry_b]: bash scripts/gpu/stage_weights.sh add
#   run kind nvidia-h100-x2, carry [.carry_c]: bash scripts/gpu/stage_weights.sh join
#   run kind nvidia-h100-x2, carry [.whl, .cache/fusedkv]:
#       SGL_KVXFER_COMMIT=<hash> bash scripts/gpu/fusedkv_x2.sh
# (a GGUF part beside .whl, .cache/fusedkv and the tree passes the 64 MiB one call carries.)
# CPU rehearsal (fusedkv_all.sh's CPU shapes, both parts at once; ~10 min on two loaded cores):
#   DEVICE=cpu OUT=$(mktemp -d) bash scripts/gpu/fusedkv_x2.sh
# Every setting below can be overridden from the environment (LONG_TASKS= : no task suite).
set -uo pipefail
cd "$(dirname "$0")/../.."
DEVICE=${DEVICE:-cuda}
export PARTS=${PARTS:-fusedkv fusedkv2} FUSEDKV_STAGES=${FUSEDKV_STAGES:-long}
export FUSEDKV2_STAGES=${FUSEDKV2_STAGES:-serve scratch} LONG_TASKS=${LONG_TASKS-qa,kv,code}
export SERVE_VARIANTS=${SERVE_VARIANTS:-vanilla lite fusedkv}
if [ "$DEVICE" = cuda ]; then
  export WALL=${WALL:-560} LONG_MIN=${LONG_MIN:-6.25} T_RETROFIT_LONG=${T_RETROFIT_LONG:-600}
  export T_SERVE=${T_SERVE:-220} T_SCRATCH=${T_SCRATCH:-600} SCRATCH_BUDGET=${SCRATCH_BUDGET:-600}
  export SCRATCH_MIN_STEPS=${SCRATCH_MIN_STEPS:-150}
  export SERVE_ARGS=${SERVE_ARGS:---preset llama-3-8b --points 1x8192 16x8192 64x4096 1x32768 --prompt-lens 8192 32768 --ttft-repeats 3}
else  # fusedkv_all.sh's CPU shapes; the wall only bounds the rehearsal
  export WALL=${WALL:-1500} LONG_MIN=${LONG_MIN:-0.5}
fi
exec bash scripts/gpu/testbeds_x2.sh
