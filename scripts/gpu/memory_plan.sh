#!/usr/bin/env bash
# The start-up memory check (sgl_kvxfer/engine/memory.py) against a real GPU's free memory, no
# weights loaded: the plan of each configuration the benchmarks start (it must fit an 80 GB card)
# and one that must be refused (a ~64B-parameter shape). About 1 min on an H100 (env.sh included).
#   run carry [.whl]  bash scripts/gpu/memory_plan.sh        -> $OUT/memory_plan.json
#   CPU rehearsal:   OUT=$(mktemp -d) DEVICE=cpu bash scripts/gpu/memory_plan.sh
set -uo pipefail
DEVICE=${DEVICE:-cuda}
if [ "$DEVICE" = cuda ]; then source scripts/gpu/env.sh || exit 1; fi
: "${OUT:?set OUT}"
timeout -s INT 120 python3 - "$DEVICE" "$OUT/memory_plan.json" <<'PY'
import json, sys
from sgl_kvxfer.engine import memory
from sgl_kvxfer.models.arch_config import ModelArchConfig
from sgl_kvxfer.models.presets import PRESETS

device, out = sys.argv[1], sys.argv[2]
big = {**PRESETS["llama-3-8b"], "num_hidden_layers": 256}  # ~64B parameters
# (name, preset config, bytes per element, mem fraction, max total tokens, max prefill tokens)
cases = [("smollm2 bf16, defaults", PRESETS["smollm2-135m"], 2, None, None, 16384),
         ("llama-3-8b bf16, defaults", PRESETS["llama-3-8b"], 2, None, None, 16384),
         ("llama-3-8b bf16, PD benchmark (0.6, 40000 tokens)", PRESETS["llama-3-8b"], 2, 0.6, 40000, 16384),
         ("llama-3-8b bf16, prefill budget 32768", PRESETS["llama-3-8b"], 2, 0.5, None, 32768),
         ("64B shape bf16: must be refused", big, 2, None, None, 16384)]
rows = []
for name, cfg, elem, frac, tokens, prefill in cases:
    arch = ModelArchConfig.from_hf_dict(cfg)
    bpt = 2.0 * arch.num_hidden_layers * arch.num_key_value_heads * arch.head_dim * elem
    dev = device if device == "cpu" else "cuda"
    try:
        plan = memory.plan_memory(dev, arch, elem, bpt, frac, tokens, prefill, None)
        rows.append({"case": name, "fits": True, "plan": plan.describe()})
    except (memory.InsufficientMemoryError, RuntimeError) as e:
        rows.append({"case": name, "fits": False, "error": str(e)})
    print(json.dumps(rows[-1]), flush=True)
json.dump({"device": device, "rows": rows}, open(out, "w"), indent=1)
PY
