"""Kernels that CI runs only under the Triton interpreter compile for a GPU (sm_90, cubin), with
the Triton the GPU machine has: their kernel tests run through test/compile_sweep.py (each test
inside kernels/compile_only.py: the real JIT on CPU tensors, launches skipped, value checks on
the unwritten outputs dropped) in a subprocess.

The interpreter never lowers a kernel, so a layout-pass failure of one Triton release only shows
on the GPU (Triton 3.6 rejected a `tl.where` over tier ids in kernels/tiered_gather.py that 3.9
compiles). The subprocess imports `.cache/triton-device/` first when that folder holds a Triton
install (.ci/run puts the GPU machine's release, 3.6.0, there), else the installed one.
"""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEVICE_TRITON = ROOT / ".cache" / "triton-device"

# launches that cover each kernel's constexpr branches (FusedKV / Lite, split plans, G < D, no int stores)
CASES = [
    "test/kernels/test_fusedkv_tiered_decode.py::test_decode_matches_reference[auto-32-32-6-2-fusedkv]",
    "test/kernels/test_fusedkv_tiered_decode.py::test_decode_matches_reference[even-64-16-3-3-lite]",
    "test/kernels/test_fusedkv_tiered_decode.py::test_decode_matches_reference[one-64-16-3-3-fusedkv]",
    "test/kernels/test_fusedkv_tiered_decode.py::test_fp16_rows_only_and_graph_width",
    "test/kernels/test_tiered_gather.py::test_gather_matches_reference[out_dtype1-64-16]",
    "test/kernels/test_tiered_gather.py::test_gather_matches_reference[out_dtype0-32-32]",
    "test/kernels/test_tiered_gather.py::test_fp16_rows_only_and_empty",
    "test/kernels/test_tier_tables.py::test_block_tables_of_pool_rows_match_reference_path",
]


def _has_nvidia_backend(site: Path | None) -> bool:
    roots = [site] if site else [Path(p) for p in sys.path if p]
    return any((r / "triton" / "backends" / "nvidia" / "compiler.py").exists() for r in roots)


@pytest.mark.slow
def test_kernels_compile_for_sm90():
    site = DEVICE_TRITON if (DEVICE_TRITON / "triton").is_dir() else None
    if not _has_nvidia_backend(site):
        pytest.skip("no Triton NVIDIA backend to compile with")
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(ROOT / ".cache" / "triton-compile-check")}
    paths = [str(site)] if site else []
    env["PYTHONPATH"] = os.pathsep.join(paths + [str(ROOT / "test"), str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "compile_sweep", "-p", "no:cacheprovider",
                           *CASES], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    swept = re.search(r"compile sweep: (\d+) kernel compiles in (\d+) tests", out)
    assert swept and int(swept.group(2)) == len(CASES), out[-2000:]  # every case compiled a kernel
    if site:
        version = subprocess.run([sys.executable, "-c", "import triton; print(triton.__version__)"], env=env,
                                 capture_output=True, text=True).stdout
        assert version.startswith("3.6"), version
