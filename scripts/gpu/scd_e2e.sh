#!/usr/bin/env bash
# SCD end to end on two GPUs (benchmarks/pd/scd_e2e.py): the base model (producer) prefills on
# GPU0, N = 4 / 1 / 2 specialists (in that order: the N=4 target first) decode on GPU1, Llama-3-8B
# shape with dummy weights and random SCD artifacts (timing only), 8k-token documents; TTFT
# includes the producer's prefill; fan-out vs each specialist prefilling itself, and (with N=1) a
# document already in the producer's radix cache; then the bandwidth-adaptive rank (--scd-rank
# auto) against the lowest and the top fixed nested level (4:8, 12:20), N=1, one producer per mode
# started at once on GPU0 (3 x 8B weights and 20000-token pools fit an H100). Link: paced 200 /
# 100 / 25 Gbit/s (200 first) and unpaced, in the engine. Transfer: Mooncake's CUDA build writing
# GPU memory to GPU memory over NVLink (MC_INTRANODE_NVLINK), staged by pd_x2.sh's stage call on
# the same warm machine:
#
#   run kind nvidia-h100-x2, carry [.carry_pdx2_a]  bash scripts/gpu/pd_x2.sh stage
#   run kind nvidia-h100-x2, carry [.whl]           SGL_KVXFER_COMMIT=<hash> bash scripts/gpu/scd_e2e.sh
#
#   TRANSFER_BACKEND=mooncake_tcp runs over TCP through host memory instead (no stage call needed
#   when the carried .whl holds Mooncake's non-CUDA build); T_TOTAL (default 285 s) bounds the call.
#   CPU rehearsal (tiny preset, N = 2 / 1): DEVICE=cpu OUT=<dir> bash scripts/gpu/scd_e2e.sh
#
# Back in $OUT: scd_e2e_<shape>.json / .png (rewritten after each link rate and after the shared
# document: a run cut short keeps what finished), scd_e2e.log, server_logs.txt. Each point (N and
# rate, shared document and rate) also runs ONE traced request after its timed repeats
# (--enable-pd-trace on every server, the producer's tracing on for that request only): its
# per-phase breakdown is the row's `trace`, condensed in the JSON's summary.trace. Expected wall time
# on H100 x2: the fan-outs and the shared document about 3.5 minutes (4 decode servers start once,
# one prefill server per N; 27 requests per N, 28 for the shared document); the rank stage, last,
# about 1 more minute (3 prefill servers at once, 6 + 4 x 3 x 3 requests), so the default T_TOTAL
# cuts the rank stage short and keeps its finished rates (T_TOTAL=400 runs it whole).
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1
DEVICE=${DEVICE:-cuda}
export OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
W=$(mktemp -d "${TMPDIR:-/tmp}/scd_e2e.XXXXXX")
trap 'rm -rf "$W"' EXIT
if [ "$DEVICE" = cuda ]; then
  source scripts/gpu/env.sh || exit 1
  BACKEND=${TRANSFER_BACKEND:-mooncake}
  if [ "$BACKEND" = mooncake ]; then
    export LD_LIBRARY_PATH=/tmp/pdlibs/lib/x86_64-linux-gnu:$LD_LIBRARY_PATH  # libnl (libibverbs1 links it)
    export MC_INTRANODE_NVLINK=true  # Mooncake's intra-node NVLink transport (both servers on this host)
    # the stage call's installs live in /tmp of this warm machine: without them, stop in seconds
    if ! python3 -c "
from sgl_kvxfer.disagg.mooncake import build_has_cuda, installed_build
assert build_has_cuda(), installed_build()" 2>&1 | tail -3; then
      echo "Mooncake's CUDA build is not importable: pd_x2.sh's stage call (carry .carry_pdx2_a) must run first, on this same warm machine" | tee "$OUT/scd_e2e.log"
      exit 3
    fi
  fi
  PRESET=llama-3-8b VOCAB=128256
  ARGS=(--prompt-tokens ${PROMPTS:-8192} --fanouts ${FANOUTS:-4 1 2} --rates 200 100 25 0 --repeats ${REPEATS:-5}
        --rank-modes ${RANK_MODES:-auto 4:8 12:20} --rank-producer-args "--max-total-tokens 20000"
        --producer-gpu 0 --consumer-gpu 1 --gpu-placement flag --transfer-backend "$BACKEND"
        --producer-args "${PRODUCER_ARGS:---max-total-tokens 40000}")
  # 4 decode servers share GPU1: 15 GiB of weights, a 1.05 GiB pool and a 512 MB transfer buffer each
  # and CUDA graphs of batch 1-4 (SCD_GRAPH_BS): the consumer's first token comes from its first
  # decode step, which a decode server runs as a graph replay
  # (8k tokens of codes at ranks 12 / 20 / 128 with 6 patch layers: 14,848 B/token, 122 MB)
  SERVER="--load-format dummy --dtype bfloat16 --device cuda --mem-fraction-static 0.95 --max-total-tokens 8600 --chunked-prefill-size 2048 --cuda-graph-max-bs ${SCD_GRAPH_BS:-4} --kv-transfer-buffer-mb 512 --log-level warning"
  NAME=scd_e2e_llama-3-8b_$(python3 -c "import torch; print(torch.cuda.get_device_name(0).split()[1])")_x2
  T_TOTAL=${T_TOTAL:-285}
else
  PRESET=tiny VOCAB=512
  # the GPU run's pool family (head-major pages of 64, PagedFp16KVPool) on the torch backend, and a
  # producer pool of 10 pages: its radix cache evicts and its last page (slots past the pool's
  # size) is handed out within the first requests, as 8k prompts do to the GPU producer's 40000
  ARGS=(--prompt-tokens 200 --fanouts ${FANOUTS:-2 1} --rates 25 0 --repeats 2 --question-tokens 8
        --rank-modes ${RANK_MODES:-auto 4:8 top} --rank-repeats 2 --rank-producer-args "--max-total-tokens 640"
        --transfer-backend "${TRANSFER_BACKEND:-mooncake}" --producer-args "--max-total-tokens 640")
  SERVER="--load-format dummy --device cpu --attention-backend torch --page-size 64 --max-total-tokens 2048 --kv-transfer-buffer-mb 16 --log-level warning"
  NAME=scd_e2e_tiny_cpu
  T_TOTAL=${T_TOTAL:-1500}
fi
MODEL=$W/model_$PRESET
python3 -c "
from sgl_kvxfer.models.presets import write_preset_config as w, write_dummy_tokenizer as t
t(w('$PRESET', '$MODEL'), $VOCAB)" || exit 1
T=$(( T_TOTAL - SECONDS - 5 )); [ $T -lt 30 ] && T=30  # SECONDS: since this script started
timeout -s INT -k 15 "$T" python3 benchmarks/pd/scd_e2e.py "${ARGS[@]}" --vocab $((VOCAB - 256)) --name "$NAME" \
    --out-dir "$OUT" --server-args "--model-path $MODEL $SERVER" 2>&1 | tee "$OUT/scd_e2e.log"
# the logs of servers that exited badly (the benchmark keeps them in the temp dir): their tails come back
for f in "${TMPDIR:-/tmp}"/sgl_kvxfer_scd_e2e_*.log; do
  [ -f "$f" ] && { echo "== $f"; tail -n 60 "$f" | cut -c1-400; }
done > "$OUT/server_logs.txt" 2>&1
ls -la "$OUT"
