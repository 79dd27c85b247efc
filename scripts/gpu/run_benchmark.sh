#!/usr/bin/env bash
# On the GPU machine: one benchmark script from benchmarks/, in env.sh's environment, with its
# JSON, PNG and a log written to $OUT (they come back with the call).
#   bash scripts/gpu/run_benchmark.sh NAME [ARGS...]
# NAME is a script's base name under benchmarks/ (offline, phase_profile, host_breakdown,
# decode_step, e2e_decode, backend_agreement, serving, host_overhead, attention, decode_plan,
# launch_overhead, ppl_sweep, niah, decode_rule, shaped_link, ttft_vs_bandwidth). ARGS go to it
# unchanged, so the command a result records,
#   python benchmarks/throughput/offline.py ARGS
# runs on the GPU machine as
#   bash scripts/gpu/run_benchmark.sh offline ARGS
# What each call must carry: scripts/gpu/README.md. Set SGL_KVXFER_COMMIT to the commit under test
# (a literal hash: git on the GPU machine reports the commit the session started from).
set -uo pipefail
if [ $# -lt 1 ]; then sed -n '2,13p' "$0"; exit 2; fi
name=${1%.py}; shift
script=$(ls benchmarks/{throughput,kernels,quality,pd}/"$name".py 2>/dev/null | head -1)
if [ -z "$script" ]; then echo "no benchmark script named '$name' under benchmarks/" >&2; exit 2; fi
source scripts/gpu/env.sh || exit 1

# The quality scripts read the eval prose (and the int4 probe its filler) from the shared data
# beside the checkout, which does not travel: carry a copy as .cache/data/prose_eval.jsonl.
if [ -f .cache/data/prose_eval.jsonl ]; then
  export SGL_KVXFER_PROSE=$PWD/.cache/data/prose_eval.jsonl SGL_KVXFER_PROBE_PROSE=$PWD/.cache/data/prose_eval.jsonl
elif [[ $script == benchmarks/quality/* ]]; then
  echo "the quality benchmarks need the eval prose: carry .cache/data (scripts/gpu/README.md)" >&2; exit 2
fi
# bench_serving (the serving benchmark's client) needs SGLang's client stack: carry .whl_bench.
if [ "$name" = serving ] && [ -d .whl_bench ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site_bench \
      .whl_bench/*.whl || exit 1
  export PYTHONPATH=$PYTHONPATH:/tmp/site_bench
fi

# Results go to $OUT unless the arguments say where.
out=()
case " $* " in
  *" --out-dir "* | *" --out "* | *" --plot-only "* | *" --replot "*) ;;
  *) out=(--out-dir "$OUT") ;;
esac
python3 "$script" "${out[@]}" "$@" 2>&1 | tee "$OUT/$name.log"
