#!/usr/bin/env bash
# The three fine-tuned test beds side by side in ONE call on a two-GPU host (nvidia-h100-x2), after
# the GGUF parts are staged (stage_weights.sh, its add and join; see scripts/gpu/README.md):
#   GPU 1  scripts/gpu/scd_quality.sh         SCD specialists, calibration, quality table
#   GPU 0  scripts/gpu/spectrum_retrieval.sh $SPECTRUM_STAGES (default: train probe eval) SpectrumKV
#                                             retrieval model, its int4 probe and tier table (+ tests,
#                                             decode: the cold tier)
#   GPU 0  scripts/gpu/fusedkv_all.sh $FUSEDKV_STAGES (default: retrofit scratch; GPU: FUSEDKV_GPU)
#   GPU 1  scripts/gpu/fusedkv_all.sh $FUSEDKV2_STAGES (part fusedkv2; default: serve scratch;
#          GPU: FUSEDKV2_GPU). fusedkv_all.sh's knobs (T_SERVE, SERVE_ARGS, LONG_TASKS, ...) reach both.
# Each part writes into its own folder; the folders come back as one tarball each (the call returns
# at most 8 files): scd.tar.gz, spectrum.tar.gz, fusedkv.tar.gz, fusedkv2.tar.gz, plus testbeds.log. Every part runs
# under its own limits and the whole under WALL seconds (default 400); a part cut short keeps what
# it wrote. Parts share a GPU and the host's cores, so their wall times are not speed results.
#
#   run kind nvidia-h100-x2, carry [.carry_b], then [.carry_c]: bash scripts/gpu/stage_weights.sh add, then ... join (after stage_weights.sh)
#   run kind nvidia-h100-x2, carry [.whl, .cache/data, .cache/fusedkv]
#       SGL_KVXFER_COMMIT=<hash> bash scripts/gpu/testbeds_x2.sh
# The FusedKV call (parts fusedkv and fusedkv2 alone, their settings): scripts/gpu/fusedkv_x2.sh.
# CPU rehearsal (each part's own CPU mode, tiny shapes): DEVICE=cpu OUT=<dir> bash scripts/gpu/testbeds_x2.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
DEVICE=${DEVICE:-cuda}
export OUT=${OUT:-/tmp/out}
WALL=${WALL:-400}
PARTS=${PARTS:-scd spectrum fusedkv}
mkdir -p "$OUT"
W=$(mktemp -d "${TMPDIR:-/tmp}/testbeds.XXXXXX")
trap 'rm -rf "$W"' EXIT
LOG="$OUT/testbeds.log"
say() { echo "== $* ($(date +%T))" | tee -a "$LOG"; }
T0=$(date +%s)
if [ "$DEVICE" = cuda ]; then
  # the wheels once and the model converted once, before the parts source env.sh again
  source scripts/gpu/env.sh >> "$LOG" 2>&1 || { say "env.sh failed"; tail -20 "$LOG"; exit 1; }
  nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader | tee -a "$LOG"
fi
say "setup $(( $(date +%s) - T0 )) s; parts [$PARTS], wall $WALL s, commit ${SGL_KVXFER_COMMIT:-?}"

run_part() {  # run_part NAME GPU CMD...: the part in the background, its output in $W/NAME.log
  local name=$1 gpu=$2; shift 2
  mkdir -p "$W/$name"
  ( export OUT="$W/$name" CUDA_VISIBLE_DEVICES=$gpu
    t=$(date +%s)
    timeout -s INT -k 30 "$(( WALL - ($(date +%s) - T0) ))" "$@" > "$W/$name/$name.log" 2>&1
    echo "== $name: exit $? after $(( $(date +%s) - t )) s" >> "$LOG" ) &
}
pids=()
for p in $PARTS; do
  case $p in
    scd)      # the three specialists train side by side; WALL: the eval's end (scd_quality.sh)
              run_part scd 1 env PARALLEL_TRAIN=1 T_TRAIN_EACH="${SCD_TRAIN_S:-100}" \
                WALL=$(( WALL - ($(date +%s) - T0) - 20 )) bash scripts/gpu/scd_quality.sh ;;
    spectrum) # shellcheck disable=SC2086
              run_part spectrum 0 env T_TOTAL=$(( WALL - ($(date +%s) - T0) - 20 )) bash scripts/gpu/spectrum_retrieval.sh \
                ${SPECTRUM_STAGES:-train probe eval} ;;
    # fusedkv_all.sh's stages (or a mode: long, rerun, ...) on FUSEDKV_GPU / FUSEDKV2_GPU; DEADLINE
    # caps each stage's timeout (and sizes the scratch grid) 25 s before the call's WALL: a stage
    # gets SIGINT there, SIGKILL 15 s later, and the part's last copy into $OUT comes before WALL
    fusedkv)  run_part fusedkv "${FUSEDKV_GPU:-0}" env DEADLINE=$(( T0 + WALL - 25 )) \
                bash scripts/gpu/fusedkv_all.sh ${FUSEDKV_STAGES:-retrofit scratch} ;;
    fusedkv2) run_part fusedkv2 "${FUSEDKV2_GPU:-1}" env DEADLINE=$(( T0 + WALL - 25 )) \
                bash scripts/gpu/fusedkv_all.sh ${FUSEDKV2_STAGES:-serve scratch} ;;
    *) say "unknown part $p"; continue ;;
  esac
  pids+=($!)
done
wait "${pids[@]}"
for p in $PARTS; do
  [ -d "$W/$p" ] || continue
  tail -n 25 "$W/$p/$p.log" | cut -c1-300 | sed "s/^/[$p] /" >> "$LOG"
  tar -czf "$OUT/$p.tar.gz" -C "$W" "$p"
done
say "total $(( $(date +%s) - T0 )) s"
ls -la "$OUT" | tee -a "$LOG"
