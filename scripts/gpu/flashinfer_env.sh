# Sourced on the GPU machine after env.sh: FlashInfer from prepare_flashinfer_carry.sh's two
# halves, carried by two back-to-back calls on one warm machine (/tmp survives between them).
#   call 1, carry .carry_fi_a: parks the first half in /tmp/fi and installs apache-tvm-ffi
#   call 2, carry .carry_fi_b: joins the halves, checks the sha256, installs into /tmp/site
# Later calls on the same warm machine carry neither. FlashInfer JIT-builds its kernels with the
# machine's nvcc on first use (a minute or more per module) into $FLASHINFER_WORKSPACE_BASE
# (/tmp/fiws), where later calls on the same warm machine find them.
export FLASHINFER_WORKSPACE_BASE=/tmp/fiws MAX_JOBS=${MAX_JOBS:-16}
mkdir -p /tmp/fi "$FLASHINFER_WORKSPACE_BASE"
if [ -d .carry_fi_a ]; then
  cp .carry_fi_a/*.part_a /tmp/fi/
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .carry_fi_a/apache_tvm_ffi-*.whl || return 1
fi
if [ -d .carry_fi_b ]; then
  b=$(ls .carry_fi_b/*.part_b); w=$(basename "$b" .part_b)
  [ -f "/tmp/fi/$w.part_a" ] || { echo "flashinfer_env: /tmp/fi/$w.part_a missing: run the .carry_fi_a call first, on this warm machine"; return 1; }
  cat "/tmp/fi/$w.part_a" "$b" > "/tmp/fi/$w"
  (cd /tmp/fi && sha256sum -c "$OLDPWD/.carry_fi_b/SHA256SUMS") || return 1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "/tmp/fi/$w" || return 1
fi
python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__)" 2>&1 | tail -1
