#!/usr/bin/env bash
# PD on a two-GPU host (nvidia-h100-x2): the prefill server on GPU 0, the decode server on GPU 1,
# KV written GPU memory to GPU memory by Mooncake's CUDA build over NVLink (MC_INTRANODE_NVLINK).
# Two calls back to back on one warm machine (scripts/gpu/README.md, "PD on two GPUs"):
#
#   run kind nvidia-h100-x2, carry [.carry_pdx2_a]        bash scripts/gpu/pd_x2.sh stage
#   run kind nvidia-h100-x2, carry [.whl, .carry_pdx2_b]  SGL_KVXFER_COMMIT=<hash> bash scripts/gpu/pd_x2.sh
#
# .carry_pdx2_b holds what goodput needs (sglang.bench_serving); with T_GOODPUT=0 the run needs
# only the stage's installs and .whl (both calls in one fit only while the tree, .carry_pdx2_a
# and .whl stay under a call's 64 MiB: scripts/gpu/README.md)
#
# stage (about 1 min): Mooncake's engine, sglang-router and rdma-core's libraries into /tmp/site and
#   /tmp/pdlibs, then a 2-process GPU0 -> GPU1 write through sgl_kvxfer's engine (the GPU test).
# run (stages end by T_TOTAL, 530 s from the start; each under `timeout -s INT`, results rewritten
#   after every point, so a stage cut short keeps what it measured):
#   tests    (T_TESTS, 50 s; 0 skips)  the GPU-marked tests of the PD transfer path
#   ttft     (T_TTFT, 300 s; 0 skips) benchmarks/pd/ttft_vs_bandwidth.py at the Llama-3-8B shape, one
#                              prefill / decode pair per budget, phase traces, a GPU0 -> GPU1 copy
#   goodput  (T_GOODPUT, 170 s; 0 skips) benchmarks/pd/goodput.py: 1 prefill + 1 decode vs 2 co-located,
#                              --deadline-s 15 s short of the stage (rates that cannot finish: skipped)
# Which points the ttft stage measures, in order (environment; device defaults shown):
#   BUDGETS="1.0 0.5 0.3"  one server pair each, in this order (1.0 first: every ratio's base)
#   PROMPTS="8192" RATES="10 0"        the core grid, measured at every budget (0: unpaced, NVLink)
#   STREAMS="end chunk-upgrade" VARIANT_RATES="10 0"  b < 1 streams; those other than end at these rates
#                              (chunk@N / chunk-upgrade@N: that stream with --kv-transfer-last-chunk N, 0: off;
#                              plain chunk streams run at the servers' default, 512)
#   MORE_PROMPTS="2048 32768" MORE_RATES="25 100 200" MORE_S=60  extra points after the core grid,
#                              started while the pair has measured for less than MORE_S seconds and
#                              the budgets still to come fit in T_TTFT (ttft_vs_bandwidth --deadline-s)
#   REPEATS=5 REPEATS_LONG=1   warm requests per point (REPEATS_LONG from 16k tokens up)
#   GOODPUT_RATES="4 8 16"     goodput's request rates (2 s of arrivals each, at least 8 requests,
#                              128-token outputs; a rate that does not fit T_GOODPUT is skipped)
#   PROFILE_ROWS="reference|b=0.3 chunk@1024 10"  ('|'-separated; unset: none) one more request per
#                              such row under the prefill server's torch profiler: traces in
#                              $OUT/profiles, read by benchmarks/pd/trace_timeline.py into
#                              $OUT/trace_timeline${NAME_SUFFIX}.txt (the traces themselves are
#                              deleted after, unless KEEP_TRACES=1)
#   CHUNK=""                   --chunked-prefill-size of every ttft server (unset: the servers' default,
#                              SGLang's by device memory: 8192 on an H100 or H200)
#   NAME_SUFFIX=""             appended to the ttft result's and the timeline's names (a second run
#                              in one call, e.g. under another environment, keeps the first's files)
# $OUT gets ttft_vs_bandwidth_*.{json,png}, goodput_*.{json,png}, gpu_tests.log, pd_x2.log (7 files);
# with PROFILE_ROWS also trace_timeline.{txt,json} (and profiles/*.trace.json.gz with KEEP_TRACES=1).
# CPU rehearsal at toy size: DEVICE=cpu OUT=/tmp/x bash scripts/gpu/pd_x2.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
DEVICE=${DEVICE:-cuda}
START=$SECONDS
export OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"

if [ "${1:-}" = stage ]; then
  A=.carry_pdx2_a
  mkdir -p /tmp/site /tmp/pdlibs
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $A/*.whl || exit 1
  python3 -c "import zipfile, sys; zipfile.ZipFile(sys.argv[1]).extractall('/tmp/site')" $A/mooncake_cuda13_engine.zip || exit 1
  for deb in $A/deb/*.deb; do dpkg -x "$deb" /tmp/pdlibs; done
  cat $A/mooncake_cuda13.sha256
  export LD_LIBRARY_PATH=/tmp/pdlibs/usr/lib/x86_64-linux-gnu:/tmp/pdlibs/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  [ -e sgl_kvxfer/kernels ] || ln -s ../kernels sgl_kvxfer/kernels
  export PYTHONPATH=/tmp/site:$PWD
  python3 -c "import torch, mooncake.engine; from sgl_kvxfer.disagg.mooncake import installed_build; print('mooncake', installed_build())" 2>&1 | tee "$OUT/stage.log"
  nvidia-smi topo -m 2>&1 | head -5 | tee -a "$OUT/stage.log"
  timeout -s INT 120 python3 -m pytest -m gpu -q -rs -p no:cacheprovider test/disagg/test_gpu_transfer.py \
      -k mooncake_writes 2>&1 | tail -15 | tee -a "$OUT/stage.log"
  exit 0
fi

LOG="$OUT/pd_x2.log"
if [ "$DEVICE" = cuda ]; then
  source scripts/gpu/env.sh || exit 1
  export LD_LIBRARY_PATH=/tmp/pdlibs/lib/x86_64-linux-gnu:$LD_LIBRARY_PATH  # libnl (libibverbs1 links it)
  # huggingface_hub 2.x is not installed: the machine's transformers wants < 2, and bench_serving
  # imports transformers too (the machine's hub serves both)
  # .carry_pdx2_b (bench_serving: sglang and its client dependencies) only where goodput runs:
  # ttft and the tests need none of it, so a call without it fits the stage's carry beside it
  rest=()
  for w in .carry_pdx2_b/*.whl; do [ -f "$w" ] || continue; case $w in */huggingface_hub-*) ;; *) rest+=("$w") ;; esac; done
  if [ ${#rest[@]} -gt 0 ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "${rest[@]}" || exit 1
  fi
  if [ ! -d /tmp/site/sglang ] && [ -f .carry_pdx2_b/sglang_0.5.23_py.zip ]; then
    python3 -c "import zipfile, sys; zipfile.ZipFile(sys.argv[1]).extractall('/tmp/site')" \
        .carry_pdx2_b/sglang_0.5.23_py.zip || exit 1
  fi
  export MC_INTRANODE_NVLINK=true  # Mooncake's intra-node NVLink transport (both servers on this host)
  # the stage call's installs live in /tmp of this warm machine: without them, stop in seconds
  python3 -c "
import mooncake.engine, sglang_router
from sgl_kvxfer.disagg.mooncake import build_has_cuda, installed_build
assert build_has_cuda(), installed_build()" 2>&1 | tail -3 | tee "$OUT/pd_x2.log"
  if [ "${PIPESTATUS[0]}" != 0 ]; then
    echo "Mooncake's CUDA build or sglang-router is not importable: the stage call (carry .carry_pdx2_a) must run first, on this same warm machine" | tee -a "$OUT/pd_x2.log"
    exit 3
  fi
  MODEL=/tmp/pdx2_l8b VOCAB=128256 PRESET=llama-3-8b
  GPU=$(python3 -c "import torch; print(torch.cuda.get_device_name(0).split()[1])")
  COMMON="--model-path $MODEL --load-format dummy --dtype bfloat16 --device cuda --mem-fraction-static 0.7 --log-level warning"
  # TTFT: 32k prompts fit the tiered pool's fp16 staging store (0.4 of 100k tokens); no decode graphs
  SERVER="$COMMON --max-total-tokens 100000 --kv-tier-staging 0.4 --kv-int4 on --attention-backend triton \
--disable-cuda-graph --kv-transfer-buffer-mb 4096"
  : "${PROMPTS=8192}" "${RATES=10 0}" "${VARIANT_RATES=10 0}" "${MORE_PROMPTS=2048 32768}" "${MORE_RATES=25 100 200}"
  : "${MORE_S=60}" "${REPEATS=5}" "${REPEATS_LONG=1}" "${GOODPUT_RATES=4 8 16}"
  # goodput: a PD and a co-located server on each GPU (one setup serves at a time), 120k tokens each
  GOODPUT_SERVER="${COMMON/--mem-fraction-static 0.7/--mem-fraction-static 0.9} --max-total-tokens 120000 --cuda-graph-max-bs 64"
  GOODPUT=(--input-len 4096 --output-len 128 --seconds-per-rate 2)
  TTFT_NAME=ttft_vs_bandwidth_llama-3-8b_${GPU}_x2${NAME_SUFFIX:-} GOODPUT_NAME=goodput_llama-3-8b_${GPU}_x2
  T_TESTS=${T_TESTS:-50} T_TTFT=${T_TTFT:-300} T_GOODPUT=${T_GOODPUT:-170} T_TOTAL=${T_TOTAL:-530}
  if [ "$T_GOODPUT" -gt 0 ] && [ ! -d /tmp/site/sglang ]; then
    echo "goodput runs sglang.bench_serving: carry .carry_pdx2_b on this machine first, or T_GOODPUT=0" | tee -a "$OUT/pd_x2.log"
    exit 3
  fi
  TESTS=(test/disagg/test_gpu_transfer.py test/disagg/test_pd_units.py test/disagg/test_pd_role.py test/disagg/test_pack_stream.py)
else  # the CPU rehearsal: the same stages on the tiny preset, two CPU servers per setup
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
  MODEL=/tmp/pdx2_tiny VOCAB=512 PRESET=tiny
  SERVER="--model-path $MODEL --load-format dummy --device cpu --max-total-tokens 8192 --chunked-prefill-size 64 \
--kv-int4 on --log-level warning --kv-transfer-buffer-mb 16"
  : "${PROMPTS=64}" "${RATES=10 0}" "${VARIANT_RATES=10}" "${MORE_PROMPTS=256}" "${MORE_RATES=25}"
  : "${MORE_S=600}" "${REPEATS=1}" "${REPEATS_LONG=1}" "${GOODPUT_RATES=1}"
  GOODPUT_SERVER="--model-path $MODEL --load-format dummy --device cpu --max-total-tokens 8192 --log-level warning"
  GOODPUT=(--input-len 64 --output-len 8 --min-prompts 3 --seconds-per-rate 1)
  TTFT_NAME=ttft_vs_bandwidth_tiny_cpu${NAME_SUFFIX:-} GOODPUT_NAME=goodput_tiny_cpu
  T_TESTS=${T_TESTS:-600} T_TTFT=${T_TTFT:-2400} T_GOODPUT=${T_GOODPUT:-1800} T_TOTAL=${T_TOTAL:-4800}
  TESTS=(test/disagg/test_pd_units.py)
fi
: "${BUDGETS=1.0 0.5 0.3}" "${STREAMS=end chunk-upgrade}"
[ -z "${CHUNK:-}" ] || SERVER="$SERVER --chunked-prefill-size $CHUNK"
# word lists (an empty MORE_* list: no extra points)
read -ra BUDGETS <<< "$BUDGETS"; read -ra PROMPTS <<< "$PROMPTS"; read -ra RATES <<< "$RATES"
read -ra STREAMS <<< "$STREAMS"; read -ra VARIANT_RATES <<< "$VARIANT_RATES"; read -ra GOODPUT_RATES <<< "$GOODPUT_RATES"
read -ra MORE_PROMPTS <<< "$MORE_PROMPTS"; read -ra MORE_RATES <<< "$MORE_RATES"
PROFILE=()
if [ -n "${PROFILE_ROWS:-}" ]; then
  IFS='|' read -ra ROWS <<< "$PROFILE_ROWS"
  PROFILE=(--profile-dir "$OUT/profiles" --profile-rows "${ROWS[@]}")
fi
python3 -c "
from sgl_kvxfer.models.presets import write_preset_config as w, write_dummy_tokenizer as t
t(w('$PRESET', '$MODEL'), $VOCAB)" || exit 1
{
  echo "== $(date +%T): budgets ${BUDGETS[*]}; prompts ${PROMPTS[*]} (+ ${MORE_PROMPTS[*]:-none}); rates ${RATES[*]} (+ ${MORE_RATES[*]:-none}); streams ${STREAMS[*]} at ${VARIANT_RATES[*]}"
  if [ "$T_TESTS" -gt 0 ]; then
    echo "== tests ($(date +%T))"
    timeout -s INT "$T_TESTS" python3 -m pytest -q -rs -p no:cacheprovider "${TESTS[@]}" 2>&1 | tail -25 | tee "$OUT/gpu_tests.log"
  fi
  # the call ends by T_TOTAL s: ttft leaves goodput its T_GOODPUT, goodput takes what is left
  left() { echo $(( T_TOTAL - (SECONDS - START) )); }
  if [ "$T_TTFT" -gt 0 ]; then
  T_TTFT=$(( $(left) - T_GOODPUT < T_TTFT ? $(left) - T_GOODPUT : T_TTFT )); [ "$T_TTFT" -ge 1 ] || T_TTFT=1  # 0: no limit
  echo "== ttft_vs_bandwidth ($(date +%T), ${T_TTFT} s)"
  timeout -s INT "$T_TTFT" python3 benchmarks/pd/ttft_vs_bandwidth.py --budgets "${BUDGETS[@]}" \
      --prompts "${PROMPTS[@]}" --rates "${RATES[@]}" --more-prompts "${MORE_PROMPTS[@]}" --more-rates "${MORE_RATES[@]}" \
      --more-seconds "$MORE_S" --deadline-s "$T_TTFT" --streams "${STREAMS[@]}" --variant-rates "${VARIANT_RATES[@]}" --repeats "$REPEATS" \
      --repeats-long "$REPEATS_LONG" --long-prompt 16384 --reference prefill --trace --peer-copy --vocab $((VOCAB - 256)) \
      --server-args "$SERVER" --prefill-args "--base-gpu-id 0" --decode-args "--base-gpu-id 1" \
      --name "$TTFT_NAME" --out-dir "$OUT" "${PROFILE[@]}"
  if [ ${#PROFILE[@]} -gt 0 ] && ls "$OUT"/profiles/*.trace.json.gz > /dev/null 2>&1; then
    TIMELINE="$OUT/trace_timeline${NAME_SUFFIX:-}"
    python3 benchmarks/pd/trace_timeline.py "$OUT"/profiles/*.trace.json.gz --json "$TIMELINE.json" \
        > "$TIMELINE.txt" 2>&1
    head -c 6000 "$TIMELINE.txt"
    grep -E "^== |copy at" "$TIMELINE.txt" | head -60
    [ "${KEEP_TRACES:-0}" = 1 ] || rm -rf "$OUT/profiles"
  fi
  fi
  if [ "$T_GOODPUT" -gt 0 ]; then
    T_GOODPUT=$(( $(left) < T_GOODPUT ? $(left) : T_GOODPUT )); [ "$T_GOODPUT" -ge 1 ] || T_GOODPUT=1
    echo "== goodput ($(date +%T), ${T_GOODPUT} s)"
    timeout -s INT "$T_GOODPUT" python3 benchmarks/pd/goodput.py --tokenizer "$MODEL" --server-args "$GOODPUT_SERVER" \
        --rates "${GOODPUT_RATES[@]}" "${GOODPUT[@]}" --gpu-args "--base-gpu-id 0" "--base-gpu-id 1" \
        --deadline-s $(( T_GOODPUT > 30 ? T_GOODPUT - 15 : T_GOODPUT )) --name "$GOODPUT_NAME" --out-dir "$OUT"
  fi
  echo "== done ($(date +%T))"
} 2>&1 | tee -a "$LOG"
ls -la "$OUT"
