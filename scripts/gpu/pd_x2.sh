#!/usr/bin/env bash
# PD on a two-GPU host (nvidia-h100-x2): the prefill server on GPU 0, the decode server on GPU 1,
# KV written GPU memory to GPU memory by Mooncake's CUDA build over NVLink (MC_INTRANODE_NVLINK).
# Two calls back to back on one warm machine (scripts/gpu/README.md, "PD on two GPUs"):
#
#   run kind nvidia-h100-x2, carry [.carry_pdx2_a]        bash scripts/gpu/pd_x2.sh stage
#   run kind nvidia-h100-x2, carry [.whl, .carry_pdx2_b]  SGL_KVXFER_COMMIT=<hash> bash scripts/gpu/pd_x2.sh
#
# stage (about 1 min): Mooncake's engine, sglang-router and rdma-core's libraries into /tmp/site and
#   /tmp/pdlibs, then a 2-process GPU0 -> GPU1 write through sgl_kvxfer's engine (the GPU test).
# run (at most 9 min: stages end by T_TOTAL, 530 s from the start; each under `timeout -s INT`,
#   results rewritten as they come, so a stage cut short keeps what it measured):
#   tests    (T_TESTS, 50 s)   the GPU-marked tests of the PD transfer path
#   ttft     (T_TTFT, 300 s)   benchmarks/pd/ttft_vs_bandwidth.py at the Llama-3-8B shape: budgets
#                              1.0 / 0.5 / 0.3, prompts 2k / 8k / 32k, unpaced and paced links,
#                              streams end / chunk-upgrade, a GPU0 -> GPU1 copy, phase traces
#   goodput  (T_GOODPUT, 170 s) benchmarks/pd/goodput.py: 1 prefill + 1 decode vs 2 co-located
# $OUT gets ttft_vs_bandwidth_*.{json,png}, goodput_*.{json,png}, gpu_tests.log, pd_x2.log (7 files).
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
  # huggingface_hub 2.x, which bench_serving imports, breaks the machine's transformers (it wants < 2):
  # it goes into a folder that only bench_serving's processes see (SGL_KVXFER_BENCH_SITE)
  hub=(.carry_pdx2_b/huggingface_hub-*.whl); rest=()
  for w in .carry_pdx2_b/*.whl; do case $w in */huggingface_hub-*) ;; *) rest+=("$w") ;; esac; done
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      "${rest[@]}" || exit 1
  if [ -f "${hub[0]}" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site_bench \
        "${hub[@]}" || exit 1
    export SGL_KVXFER_BENCH_SITE=/tmp/site_bench
  fi
  [ -d /tmp/site/sglang ] || python3 -c "import zipfile, sys; zipfile.ZipFile(sys.argv[1]).extractall('/tmp/site')" \
      .carry_pdx2_b/sglang_0.5.23_py.zip || exit 1
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
  # the target points first (10 Gbit/s, NVLink unpaced): a stage cut short keeps them
  PROMPTS=(2048 8192 32768) RATES=(10 0 25 100 200) VARIANT_RATES=(10 0) REPEATS=5 REPEATS_LONG=1
  # goodput: a PD and a co-located server on each GPU (one setup serves at a time), 120k tokens each
  GOODPUT_SERVER="${COMMON/--mem-fraction-static 0.7/--mem-fraction-static 0.9} --max-total-tokens 120000 --cuda-graph-max-bs 64"
  GOODPUT=(--rates 2 4 8 --input-len 4096 --output-len 192 --seconds-per-rate 3)
  TTFT_NAME=ttft_vs_bandwidth_llama-3-8b_${GPU}_x2 GOODPUT_NAME=goodput_llama-3-8b_${GPU}_x2
  T_TESTS=${T_TESTS:-50} T_TTFT=${T_TTFT:-300} T_GOODPUT=${T_GOODPUT:-170} T_TOTAL=${T_TOTAL:-530}
  TESTS=(test/disagg/test_gpu_transfer.py test/disagg/test_pd_units.py)
else  # the CPU rehearsal: the same stages on the tiny preset, two CPU servers per setup
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
  MODEL=/tmp/pdx2_tiny VOCAB=512 PRESET=tiny
  SERVER="--model-path $MODEL --load-format dummy --device cpu --max-total-tokens 8192 --chunked-prefill-size 64 \
--kv-int4 on --log-level warning --kv-transfer-buffer-mb 16"
  PROMPTS=(64 256) RATES=(0 10) VARIANT_RATES=(10) REPEATS=1 REPEATS_LONG=1
  GOODPUT_SERVER="--model-path $MODEL --load-format dummy --device cpu --max-total-tokens 8192 --log-level warning"
  GOODPUT=(--rates 1 --input-len 64 --output-len 8 --min-prompts 3 --seconds-per-rate 1)
  TTFT_NAME=ttft_vs_bandwidth_tiny_cpu GOODPUT_NAME=goodput_tiny_cpu
  T_TESTS=${T_TESTS:-600} T_TTFT=${T_TTFT:-2400} T_GOODPUT=${T_GOODPUT:-1800} T_TOTAL=${T_TOTAL:-4800}
  TESTS=(test/disagg/test_pd_units.py)
fi
python3 -c "
from sgl_kvxfer.models.presets import write_preset_config as w, write_dummy_tokenizer as t
t(w('$PRESET', '$MODEL'), $VOCAB)" || exit 1
{
  echo "== tests ($(date +%T))"
  timeout -s INT "$T_TESTS" python3 -m pytest -q -rs -p no:cacheprovider "${TESTS[@]}" 2>&1 | tail -25 | tee "$OUT/gpu_tests.log"
  # the call ends by T_TOTAL s: ttft leaves goodput its T_GOODPUT, goodput takes what is left
  left() { echo $(( T_TOTAL - (SECONDS - START) )); }
  T_TTFT=$(( $(left) - T_GOODPUT < T_TTFT ? $(left) - T_GOODPUT : T_TTFT )); [ "$T_TTFT" -ge 1 ] || T_TTFT=1  # 0: no limit
  echo "== ttft_vs_bandwidth ($(date +%T), ${T_TTFT} s)"
  timeout -s INT "$T_TTFT" python3 benchmarks/pd/ttft_vs_bandwidth.py --prompts "${PROMPTS[@]}" --budgets 1.0 0.5 0.3 \
      --rates "${RATES[@]}" --streams end chunk-upgrade --variant-rates "${VARIANT_RATES[@]}" --repeats $REPEATS \
      --repeats-long $REPEATS_LONG --long-prompt 16384 --reference prefill --trace --peer-copy --vocab $((VOCAB - 256)) \
      --server-args "$SERVER" --prefill-args "--base-gpu-id 0" --decode-args "--base-gpu-id 1" \
      --name "$TTFT_NAME" --out-dir "$OUT"
  T_GOODPUT=$(( $(left) < T_GOODPUT ? $(left) : T_GOODPUT )); [ "$T_GOODPUT" -ge 1 ] || T_GOODPUT=1
  echo "== goodput ($(date +%T), ${T_GOODPUT} s)"
  timeout -s INT "$T_GOODPUT" python3 benchmarks/pd/goodput.py --tokenizer "$MODEL" --server-args "$GOODPUT_SERVER" \
      "${GOODPUT[@]}" --gpu-args "--base-gpu-id 0" "--base-gpu-id 1" --name "$GOODPUT_NAME" --out-dir "$OUT"
  echo "== done ($(date +%T))"
} 2>&1 | tee -a "$LOG"
ls -la "$OUT"
