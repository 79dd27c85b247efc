#!/usr/bin/env bash
# The tiered PD prefill path on ONE GPU, one call of at most T_TOTAL (150) s:
#
#   run kind nvidia-h100-x1, carry [.whl, .carry_pdx2_a]   bash scripts/gpu/pd_prefill_check.sh
#
# With Mooncake and sglang-router importable (carry .carry_pdx2_a: installed here as pd_x2.sh's
# stage does): benchmarks/pd/ttft_vs_bandwidth.py, one prefill / decode pair per budget
# (BUDGETS "1.0 0.5"; 1.0 first, every ratio's base), both on GPU 0, KV through pinned host
# memory over Mooncake TCP; per budget the prefill server alone (`--reference prefill`: the
# tiered prefill vs the fp16 one), then PD at PD_RATES (10 Gbit/s) with the streams end and
# chunk (b < 1), REPEATS (5) warm runs each and one traced request (phase trace: chunk tiers,
# pack, wire, unpack); `--deadline-s` stops starting points in time.
# With .whl alone (no PD): benchmarks/pd/tiered_prefill.py, a server alone per budget
# (BUDGETS "1.0 0.5 0.3"), the tiered prefill vs the fp16 one.
# Llama-3-8B shape, dummy bf16 weights, triton attention, chunked prefill 2048 (the default),
# --kv-int4 on --kv-tier-staging 0.4, --mem-fraction-static 0.3 per server (two share the GPU).
# Beside the servers' start (CUDA), the GPU tests of the pack and its checksums
# (test_gpu_transfer.py -k "wsum64 or pack_segment", 60 s at most; their summary in the log).
# Each stage under `timeout -s INT`, its JSON rewritten after every point (partial results kept).
# $OUT: ttft_vs_bandwidth_*_x1.{json,png} or tiered_prefill_*.json, pd_prefill_check.log.
# CPU rehearsal at toy size: DEVICE=cpu OUT=/tmp/x bash scripts/gpu/pd_prefill_check.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
DEVICE=${DEVICE:-cuda}
START=$SECONDS
export OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
LOG="$OUT/pd_prefill_check.log"
: "${PD_RATES=10}" "${T_TOTAL=150}"
if [ "$DEVICE" = cuda ]; then
  source scripts/gpu/env.sh || exit 1
  A=.carry_pdx2_a
  if [ -d $A ]; then  # Mooncake's engine, sglang-router and rdma-core's libraries (pd_x2.sh stage)
    mkdir -p /tmp/pdlibs
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $A/*.whl
    python3 -c "import zipfile, sys; zipfile.ZipFile(sys.argv[1]).extractall('/tmp/site')" $A/mooncake_cuda13_engine.zip
    for deb in $A/deb/*.deb; do dpkg -x "$deb" /tmp/pdlibs; done
    export LD_LIBRARY_PATH=/tmp/pdlibs/usr/lib/x86_64-linux-gnu:/tmp/pdlibs/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  fi
  MODEL=/tmp/l8b VOCAB=128256 PRESET=llama-3-8b PROMPT=8192 GPU=$(python3 -c "import torch; print(torch.cuda.get_device_name(0).split()[1])")
  SERVER="--model-path $MODEL --load-format dummy --dtype bfloat16 --device cuda --mem-fraction-static 0.3 \
--max-total-tokens 40000 --kv-tier-staging 0.4 --kv-int4 on --attention-backend triton --disable-cuda-graph \
--log-level warning"
  PD_SERVER="$SERVER --disaggregation-transfer-backend mooncake_tcp --kv-transfer-buffer-mb 1024"
  export SGL_KVXFER_KV_BUFFER=host  # one GPU: KV staged through pinned host memory, TCP on loopback
  : "${REPEATS=5}"
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
  MODEL=/tmp/pdcheck_tiny VOCAB=512 PRESET=tiny PROMPT=128 GPU=cpu
  SERVER="--model-path $MODEL --load-format dummy --device cpu --max-total-tokens 8192 --chunked-prefill-size 64 \
--kv-int4 on --log-level warning"
  PD_SERVER="$SERVER --kv-transfer-buffer-mb 16"
  : "${REPEATS=2}"
fi
python3 -c "
from sgl_kvxfer.models.presets import write_preset_config as w, write_dummy_tokenizer as t
t(w('$PRESET', '$MODEL'), $VOCAB)" || exit 1
read -ra PD_RATES <<< "$PD_RATES"
left() { echo $(( T_TOTAL - (SECONDS - START) )); }
{
  if [ "$DEVICE" = cuda ]; then  # the CUDA tests of the pack and its checksums, beside the servers' start
    echo "== GPU tests in the background ($(date +%T))"
    timeout -s INT 60 python3 -m pytest -q -rs -p no:cacheprovider test/disagg/test_gpu_transfer.py \
        -k "wsum64 or pack_segment" > /tmp/pd_prefill_check_tests.log 2>&1 &
    TESTS_PID=$!
  fi
  if python3 -c "import mooncake.engine, sglang_router" 2>/dev/null; then
    : "${BUDGETS=1.0 0.5}"; read -ra BUDGETS <<< "$BUDGETS"
    T_PD=$(left); [ "$T_PD" -ge 1 ] || T_PD=1
    echo "== PD on one GPU ($(date +%T), ${T_PD} s): budgets ${BUDGETS[*]}, ${PROMPT}-token prompts, streams end chunk at ${PD_RATES[*]} Gbit/s, traced"
    timeout -s INT "$T_PD" python3 benchmarks/pd/ttft_vs_bandwidth.py --budgets "${BUDGETS[@]}" --prompts "$PROMPT" \
        --rates "${PD_RATES[@]}" --streams end chunk --variant-rates "${PD_RATES[@]}" --repeats "$REPEATS" \
        --deadline-s "$T_PD" --reference prefill --trace --vocab $((VOCAB - 256)) --server-args "$PD_SERVER" \
        --prefill-args "--base-gpu-id 0" --decode-args "--base-gpu-id 0" \
        --name "ttft_vs_bandwidth_${PRESET}_${GPU}_x1" --out-dir "$OUT"
    python3 - "$OUT/ttft_vs_bandwidth_${PRESET}_${GPU}_x1.json" <<'EOF'
import json, sys
try:
    res = json.load(open(sys.argv[1]))
except (OSError, ValueError) as e:
    sys.exit(f"no PD result: {e}")
for name, rows in res.get("reference", {}).items():
    print(f"prefill alone {name}: {json.dumps(rows)[:300]}")
for name, rows in res.get("pd", {}).items():  # the traced request's phases: name, start, duration (ms)
    for n, r in rows.items():
        ph = ((r.get("trace") or {}).get("example") or {}).get("phases") or []
        print(f"{name} {n} tokens: TTFT {r.get('ttft_ms', float('nan')):.1f} ms")
        print("   " + " ".join(f"{p[0]}:{p[2]:.1f}" for p in ph))
print("ratios:", json.dumps(res.get("ratios"))[:1500])
EOF
  else
    : "${BUDGETS=1.0 0.5 0.3}"; read -ra BUDGETS <<< "$BUDGETS"
    T_PRE=$(left); [ "$T_PRE" -ge 1 ] || T_PRE=1
    echo "== no Mooncake / sglang-router (carry .carry_pdx2_a for PD): prefill alone ($(date +%T), ${T_PRE} s): budgets ${BUDGETS[*]}"
    timeout -s INT "$T_PRE" python3 benchmarks/pd/tiered_prefill.py --budgets "${BUDGETS[@]}" --prompt "$PROMPT" \
        --repeats "$REPEATS" --vocab $((VOCAB - 256)) --device "$DEVICE" --server-args "$SERVER" \
        --name "tiered_prefill_${PRESET}_${GPU}" --out-dir "$OUT"
  fi
  if [ -n "${TESTS_PID:-}" ]; then
    wait "$TESTS_PID"
    echo "== GPU tests: test/disagg/test_gpu_transfer.py -k 'wsum64 or pack_segment'"
    tail -6 /tmp/pd_prefill_check_tests.log
  fi
  echo "== done ($(date +%T))"
} 2>&1 | tee -a "$LOG"
ls -la "$OUT"
