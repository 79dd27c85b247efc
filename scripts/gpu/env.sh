# Sourced by the other scripts on the GPU machine: the carried wheels (.whl) into /tmp/site, the
# repo on PYTHONPATH, and, once the three GGUF parts are there (stage_weights.sh and its add, then
# its join or a call carrying .carry_c), the embedded model converted to $SGL_KVXFER_MODEL_CACHE
# (/tmp/models).
export OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/m
# Once per machine: scripts that run side by side (testbeds_x2.sh) source this file at the same time,
# and concurrent pip installs into one --target tear each other's files.
stamp=/tmp/site/.whl_$(ls .whl | md5sum | cut -c1-12)
if [ ! -f "$stamp" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || return 1
  touch "$stamp"
fi
# PD (prepare_carry.sh's .whl_pd_a / .whl_pd_b, one per call): Mooncake, its libibverbs, the router.
for d in .whl_pd_a .whl_pd_b; do
  [ -d $d ] || continue
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $d/*.whl || return 1
  for deb in $d/deb/*.deb; do [ -f "$deb" ] && dpkg -x "$deb" /tmp/pdlibs; done
done
[ -d /tmp/pdlibs ] && export LD_LIBRARY_PATH=/tmp/pdlibs/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
# No network there, so no editable install: the repo root on the path plus a kernels link.
[ -e sgl_kvxfer/kernels ] || ln -s ../kernels sgl_kvxfer/kernels
export PYTHONPATH=/tmp/site:$PWD
export SGL_KVXFER_MODEL_CACHE=/tmp/models HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
if [ -f .carry_c/part_c ] && [ -f /tmp/m/has_b ] && [ ! -f /tmp/m/smollm2.gguf ]; then
  cat /tmp/m/partial .carry_c/part_c > /tmp/m/smollm2.gguf
fi
if [ -f /tmp/m/smollm2.gguf ]; then
  python3 -c "
from sgl_kvxfer.models.convert import convert_gguf, default_cache_dir, is_converted
d = default_cache_dir()
print(d if is_converted(d) else convert_gguf('/tmp/m/smollm2.gguf', d))" || return 1
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
