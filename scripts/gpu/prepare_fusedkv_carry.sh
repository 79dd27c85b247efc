#!/usr/bin/env bash
# Here, once (after prepare_carry.sh): the git-ignored folders the FusedKV GPU calls carry
# (scripts/gpu/fusedkv_all.sh says which call carries which).
#   .whl_gguf/       the gguf wheel alone: the `stage` call converts the embedded GGUF with it
#                    (a GGUF part and the full .whl together exceed one call's 64 MiB)
#   .cache/fusedkv/  the FusedKV token data: python -m sgl_kvxfer.fusedkv.data over DATA_DIR
#                    ({prose,code}_{train,calib,eval}.jsonl), SmolLM2's tokenizer (3.7 MB)
# Usage: DATA_DIR=/path/to/jsonl bash scripts/gpu/prepare_fusedkv_carry.sh
#        (DATA_DIR defaults to $SGL_KVXFER_FUSEDKV_DATA)
set -euo pipefail
cd "$(dirname "$0")/../.."
DATA_DIR=${DATA_DIR:-${SGL_KVXFER_FUSEDKV_DATA:-}}
if [ -z "$DATA_DIR" ]; then echo "set DATA_DIR (or SGL_KVXFER_FUSEDKV_DATA) to the folder of the jsonl files" >&2; exit 2; fi
mkdir -p .whl_gguf
if ls .whl/gguf-*.whl >/dev/null 2>&1; then
  cp .whl/gguf-*.whl .whl_gguf/
else
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp -d .whl_gguf gguf==0.19.0
fi
python3 -m sgl_kvxfer.fusedkv.data --data-dir "$DATA_DIR" --out .cache/fusedkv
du -sh .whl_gguf .cache/fusedkv
