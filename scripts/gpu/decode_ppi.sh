#!/usr/bin/env bash
# Session 6 (carry .whl): decode attention with 1 / 2 / 4 fp16 pages per kernel loop step, every
# autotune config, 1 and 2 splits, pure-fp16 plan, at SmolLM2 heads (batch 256) and Llama-3-8B
# heads (batch 64 and 128). Results in $OUT.
set -uo pipefail
source scripts/gpu/env.sh >/dev/null || exit 1
run() { python3 benchmarks/kernels/decode_plan.py --pages-per-iter 1 2 4 --empty-tiers 0 --splits 1 2 --out-dir "$OUT" "$@" 2>&1 | grep -v Warning; }
run --tag smollm2_ppi | tail -4 | cut -c1-400
run --tag llama8b_b64_ppi --batch 64 --q-heads 32 --kv-heads 8 --head-dim 128 | tail -3 | cut -c1-400
run --tag llama8b_b128_ppi --batch 128 --q-heads 32 --kv-heads 8 --head-dim 128 | tail -3 | cut -c1-400
python3 - "$OUT" <<'PY'
import glob, json, sys
for f in sorted(glob.glob(sys.argv[1] + "/decode_plan_*.json")):
    d = json.load(open(f))
    best = {}
    for r in d["rows"]:
        k = r["pages_per_iter"]
        if k not in best or r["ms"] < best[k]["ms"]:
            best[k] = r
    print(f.split("/")[-1], {k: (round(1e3 * v["ms"], 1), round(v["pct_copy_bw"]), v["config"][:30], v["S16"]) for k, v in sorted(best.items())})
    cur = [r for r in d["rows"] if r["pages_per_iter"] == 1 and "num_warps: 4," in r["config"] and "num_stages: 2," in r["config"] and r["S16"] == 1]
    print("  current default (1 page, 4 warps, 2 stages, S16=1):", [round(1e3 * r["ms"], 1) for r in cur])
PY
