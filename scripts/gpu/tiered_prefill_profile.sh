#!/usr/bin/env bash
# Where the tiered prefill's time goes, one call of at most T_TOTAL (200) s on one GPU:
#
#   run kind nvidia-h100-x1, carry [.whl]   SGL_KVXFER_COMMIT=<hash> bash scripts/gpu/tiered_prefill_profile.sh
#
# benchmarks/pd/tiered_prefill_profile.py at the Llama-3-8B shape (dummy bf16 weights, no
# download: models/presets.py writes the config and a dummy tokenizer), triton attention, chunked
# prefill 2048, 8192-token prompts, --kv-int4 on --kv-tier-staging 0.4, one process (one Engine)
# per budget (BUDGETS "0.3 1.0": the tiered one first, so a short call still profiles it), each
# under `timeout -s INT` with what is left of T_TOTAL; both write one JSON (`--merge`).
# Per budget: 2 warm-up prompts, REPEATS (5) plain timed prompts (their medians' ratio to b = 1.0 in
# the summary; per prompt the re-tier's functions, unsynced, the CUDA allocator's retries and
# device mallocs / frees, the collector's runs and the re-tier's wall / CPU time, context switches
# and page faults), then one prompt per view (timed spans and the
# re-tier's functions unsynced / synced, sync-debug sites, cProfile, torch.profiler).
# $OUT: tiered_prefill_profile_<device>.json, tiered_prefill_profile.txt (the summaries),
# tiered_prefill_profile.log (progress and errors).
# MAX_TOKENS (40000), MEM_FRACTION (0.6) and EXTRA_ARGS (e.g. --cuda-graph) set the engine as a server is;
# PROMPT (8192) the prompt length, VIEWS (default all) the views, e.g. "timed torch_profiler". A
# 32768-token prompt needs the fp16 staging store to hold it: MAX_TOKENS=100000 (0.4 of it).
# SGL_KVXFER_GC_FREEZE=0 / SGL_KVXFER_SCHEDULER_THREADS=0: without the scheduler's collector freeze /
# single intra-op thread (sgl_kvxfer/utils/host_runtime.py), to compare against the defaults.
# CPU rehearsal at toy size: DEVICE=cpu OUT=/tmp/x bash scripts/gpu/tiered_prefill_profile.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
DEVICE=${DEVICE:-cuda}
START=$SECONDS
export OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
LOG="$OUT/tiered_prefill_profile.log"
TXT="$OUT/tiered_prefill_profile.txt"
: "${T_TOTAL=200}" "${BUDGETS=0.3 1.0}"
if [ "$DEVICE" = cuda ]; then
  source scripts/gpu/env.sh >> "$LOG" 2>&1 || { echo "env.sh failed" | tee -a "$LOG"; exit 1; }
  ARGS=(--device cuda --preset llama-3-8b --prompt ${PROMPT:-8192} --chunk 2048 --max-total-tokens ${MAX_TOKENS:-40000}
        --mem-fraction-static ${MEM_FRACTION:-0.6} --attention-backend triton --warmup 2 --repeats ${REPEATS:-5} ${VIEWS:+--views $VIEWS} ${EXTRA_ARGS:-})
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
  ARGS=(--device cpu --preset tiny --prompt 128 --chunk 64 --max-total-tokens 8192 --warmup 1 --repeats 1)
fi
read -ra BUDGETS <<< "$BUDGETS"
left() { echo $(( T_TOTAL - (SECONDS - START) )); }
for b in "${BUDGETS[@]}"; do
  T=$(( $(left) - 5 ))
  if [ "$T" -lt 20 ]; then
    echo "== budget $b skipped: ${T} s left" | tee -a "$LOG"
    continue
  fi
  echo "== budget $b ($(date +%T), ${T} s)" | tee -a "$LOG"
  timeout -s INT "$T" python3 benchmarks/pd/tiered_prefill_profile.py "${ARGS[@]}" --budgets "$b" --merge \
      --out-dir "$OUT" 2>> "$LOG" | tee -a "$TXT"
  echo "== budget $b: exit ${PIPESTATUS[0]} ($(date +%T))" | tee -a "$LOG"
done
echo "== done in $((SECONDS - START)) s" | tee -a "$LOG"
ls -la "$OUT"
