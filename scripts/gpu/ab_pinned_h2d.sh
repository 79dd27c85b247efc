#!/usr/bin/env bash
# Session 6 A/B of the pinned host->device index copies (sgl_kvxfer/utils/host_copy.py), carry
# .whl .carry_tok. Before the call, put the previous commit's package beside the tree (untracked):
#   mkdir ab_old && git archive <old-commit> sgl_kvxfer kernels | tar -x -C ab_old
# Runs the host-copy and overlap GPU tests, times a pageable 16 MB copy queued behind ~1 s of GPU
# work, then alternates old / new phase profiles (SmolLM2 shape, dummy weights) twice.
set -uo pipefail
source scripts/gpu/env.sh >/dev/null || exit 1
python3 -m pytest test/engine/test_host_copy.py test/engine/test_overlap.py -m gpu -q -p no:cacheprovider 2>&1 | tail -2
python3 - <<'PY'
import time, torch
x = torch.arange(2_000_000)
torch.cuda.synchronize(); torch.cuda._sleep(2_000_000_000)
t = time.perf_counter(); y = x.to("cuda", non_blocking=True); w = time.perf_counter() - t
torch.cuda.synchronize(); print(f"pageable 16 MB .to(cuda, non_blocking=True) behind ~1 s of queued work: host waited {w:.3f} s")
PY
[ -e ab_old/sgl_kvxfer/kernels ] || ln -s ../kernels ab_old/sgl_kvxfer/kernels
for round in 1 2; do
  for side in old new; do
    if [ $side = old ]; then PP=/tmp/site:$PWD/ab_old; else PP=/tmp/site:$PWD; fi
    PYTHONPATH=$PP python3 benchmarks/throughput/phase_profile.py --model-path .carry_tok/smol --load-format dummy --dtype bfloat16 \
      --num-prompts 256 --output-len 128 --mem-fraction-static 0.5 --timeline --tag ${side}_$round --out-dir "$OUT" 2>&1 \
      | grep -E "^timeline|^unsynced" | sed "s/^/$side $round: /"
  done
done
