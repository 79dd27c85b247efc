#!/usr/bin/env bash
# On the CPU machine, in the repo root's checkout (once): FlashInfer for the GPU machine, in two
# git-ignored carry folders, since its wheel (~65 MB) exceeds what one call moves (64 MiB with
# the working tree). scripts/gpu/README.md ('FlashInfer') says how the two calls use them.
#   .carry_fi_a/  the wheel's first 33,000,000 bytes (*.part_a) + apache-tvm-ffi (its one
#                 import the machine lacks; the others, torch, numpy, einops, tabulate, pynvml,
#                 requests, tqdm, jinja2, filelock, packaging, ninja, cuda-bindings, are there)
#   .carry_fi_b/  the rest of the wheel (*.part_b)
# FlashInfer's other requirements (nvidia-cutlass-dsl, cuda-tile, nccl4py, cudnn-frontend, ...)
# serve kernels the FA2 paged decode / prefill path never imports: --no-deps.
set -euo pipefail
cd "$(dirname "$0")/../.."
FI_VERSION=${FI_VERSION:-0.7.2}
TVM_FFI_VERSION=${TVM_FFI_VERSION:-0.1.15.post2}
PLAT="--platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any"
get() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PLAT -d "$1" "${@:2}"; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
get "$tmp" "flashinfer-python==$FI_VERSION"
W=$(cd "$tmp" && ls flashinfer_python-*.whl)
rm -rf .carry_fi_a .carry_fi_b
mkdir -p .carry_fi_a .carry_fi_b
head -c 33000000 "$tmp/$W" > ".carry_fi_a/$W.part_a"
tail -c +33000001 "$tmp/$W" > ".carry_fi_b/$W.part_b"
get .carry_fi_a "apache-tvm-ffi==$TVM_FFI_VERSION"
(cd "$tmp" && sha256sum "$W") > .carry_fi_b/SHA256SUMS
EXCLUDE=$(git rev-parse --git-path info/exclude)  # also right in a git worktree
mkdir -p "$(dirname "$EXCLUDE")"
for d in .carry_fi_a .carry_fi_b; do grep -qx "/$d/" "$EXCLUDE" 2>/dev/null || echo "/$d/" >> "$EXCLUDE"; done
du -sh .carry_fi_a .carry_fi_b
