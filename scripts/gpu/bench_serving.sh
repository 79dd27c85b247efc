#!/usr/bin/env bash
# Call 3 (carry .whl .whl_bench): sglang.bench_serving against our server at rates 1, 4, 16, inf
# on real SmolLM2 weights (converted in call 2; the machine must still be warm).
set -uo pipefail
source scripts/gpu/env.sh || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site_bench .whl_bench/*.whl || exit 1
cat > /tmp/benchpy <<'PY'
#!/usr/bin/env bash
CUDA_VISIBLE_DEVICES= PYTHONPATH=/tmp/site_bench:/tmp/site exec python3 "$@"  # client only: the CPU import path of sglang
PY
chmod +x /tmp/benchpy
python3 benchmarks/throughput/serving.py --bench-python /tmp/benchpy --num-prompts 64 --input-len 256 \
    --output-len 64 --max-concurrency 64 --out "$OUT/serving_gpu.json" \
    --server-args "--dtype bfloat16 --mem-fraction-static 0.5" 2>&1 | grep -v Warning | tail -40
ls -la "$OUT"
