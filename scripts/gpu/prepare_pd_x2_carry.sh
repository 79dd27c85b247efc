#!/usr/bin/env bash
# On the CPU machine, in the repo root (once): the git-ignored folders that scripts/gpu/pd_x2.sh's
# two calls carry (`prepare_carry.sh` first: call 2 also carries its `.whl`).
#
#   .carry_pdx2_a/  (call 1, "stage", about 41 MB)
#     mooncake_cuda13_engine.zip   the `mooncake.engine` module of PyPI mooncake-transfer-engine-cuda13
#                                  0.3.14 and the libraries it links (engine.so, libasio, libetcd_wrapper,
#                                  and from the wheel's .libs yaml-cpp, jsoncpp, glog, gflags) plus its
#                                  dist-info: the wheel is 49.7 MB, more than one call moves beside the
#                                  tree; the rest of it (Mooncake Store, EP, the master) is not imported
#     mooncake_cuda13.sha256       the sha256 of the whole wheel these files came from
#     *.whl                        sglang-router 0.3.2 (+ setproctitle, orjson), xxhash (the stage's test)
#     deb/                         rdma-core's libibverbs1 and ibverbs-providers (libmlx5.so.1, which
#                                  the CUDA build links), libnl-3, libnl-route-3, libnuma1
#   .carry_pdx2_b/  (call 2, with .whl, about 25 MB)
#     sglang_0.5.23_py.zip         sglang 0.5.23's Python sources, for `python -m sglang.bench_serving`
#                                  (the wheel is 39 MB; bench_serving imports none of its compiled parts)
#     *.whl                        bench_serving's other imports (those of prepare_carry.sh's .whl_bench
#                                  but huggingface_hub 2.x: the GPU machine's transformers wants < 2,
#                                  and bench_serving imports transformers, so its hub serves both)
set -euo pipefail
cd "$(dirname "$0")/../.."
A=.carry_pdx2_a B=.carry_pdx2_b
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
rm -rf "$A" "$B"
mkdir -p "$A/deb" "$B"
PLAT="--platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any"
get() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PLAT -d "$1" "${@:2}"; }

get "$T" mooncake-transfer-engine-cuda13==0.3.14 sglang==0.5.23
get "$A" sglang-router==0.3.2 setproctitle==1.3.8 orjson==3.13.0 xxhash==4.1.0
get "$B" apache-tvm-ffi==0.1.15.post2 compressed-tensors==0.20.0 datasets==5.2.0 dill==0.4.1 \
    multiprocess==0.70.19 ipython==9.18.1 traitlets==5.16.1 loguru==0.7.3 orjson==3.13.0 pybase64==1.5.1 \
    httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5
(cd "$A/deb" && apt-get download -q libibverbs1 ibverbs-providers libnl-3-200 libnl-route-3-200 libnuma1 >/dev/null)

python3 - "$T" "$A" "$B" <<'EOF'
import glob, hashlib, os, sys, zipfile
tmp, a, b = sys.argv[1:]
wheel = glob.glob(os.path.join(tmp, "mooncake_transfer_engine_cuda13-0.3.14-*.whl"))[0]
with open(wheel, "rb") as f:
    digest = hashlib.sha256(f.read()).hexdigest()
with open(os.path.join(a, "mooncake_cuda13.sha256"), "w") as f:
    f.write(f"{digest}  {os.path.basename(wheel)}\n")
libs = "mooncake_transfer_engine_cuda13.libs/"
keep = ("mooncake/__init__.py", "mooncake/engine.so", "mooncake/libasio.so", "mooncake/libetcd_wrapper.so")
keep_libs = ("libyaml-cpp-", "libjsoncpp-", "libglog-", "libgflags-")
with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(os.path.join(a, "mooncake_cuda13_engine.zip"), "w",
                                                   zipfile.ZIP_DEFLATED) as dst:
    for info in src.infolist():
        name = info.filename
        dist = ".dist-info/" in name and name.rsplit("/", 1)[1] in ("METADATA", "WHEEL", "top_level.txt")
        lib = name.startswith(libs) and name[len(libs):].startswith(keep_libs)
        if name in keep or dist or lib:
            dst.writestr(info, src.read(name))
sglang = glob.glob(os.path.join(tmp, "sglang-0.5.23-*.whl"))[0]
skip = (".so", ".cu", ".cuh", ".h", ".cpp", ".hip", ".co", ".s")
with zipfile.ZipFile(sglang) as src, zipfile.ZipFile(os.path.join(b, "sglang_0.5.23_py.zip"), "w",
                                                    zipfile.ZIP_DEFLATED) as dst:
    for info in src.infolist():
        if not info.filename.endswith(skip) and not info.filename.endswith("RECORD"):
            dst.writestr(info, src.read(info.filename))
EOF
EXCLUDE=$(git rev-parse --git-path info/exclude)  # also right in a git worktree
mkdir -p "$(dirname "$EXCLUDE")"
for d in $A $B; do grep -qx "/$d/" "$EXCLUDE" 2>/dev/null || echo "/$d/" >> "$EXCLUDE"; done
du -sh "$A" "$B"
