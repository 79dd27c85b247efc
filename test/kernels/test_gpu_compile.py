"""Kernels that CI runs only under the Triton interpreter compile for a GPU (sm_90, cubin), with
the Triton the GPU machine has: kernels/compile_only.py drives the real JIT from the kernel
tests' own launches on CPU tensors and skips the launches.

The interpreter never lowers a kernel, so a layout-pass failure of one Triton release only shows
on the GPU (Triton 3.6 rejected a `tl.where` over tier ids in kernels/tiered_gather.py that 3.9
compiles). The check runs in a subprocess on `.cache/triton-device/` when that folder holds a
Triton install (.ci/run puts the GPU machine's release, 3.6.0, there), else on the installed one.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEVICE_TRITON = ROOT / ".cache" / "triton-device"

# (test module, test function, arguments): launches that cover each kernel's constexpr branches
CASES = [
    ("test_fusedkv_tiered_decode", "test_decode_matches_reference", ("fusedkv", 32, 32, 6, 2, "auto")),
    ("test_fusedkv_tiered_decode", "test_decode_matches_reference", ("lite", 64, 16, 3, 3, "even")),
    ("test_fusedkv_tiered_decode", "test_decode_matches_reference", ("fusedkv", 64, 16, 3, 3, "one")),
    ("test_fusedkv_tiered_decode", "test_fp16_rows_only_and_graph_width", ()),
    ("test_tiered_gather", "test_gather_matches_reference", (64, 16, "float32")),
    ("test_tiered_gather", "test_gather_matches_reference", (32, 32, "float16")),
    ("test_tiered_gather", "test_fp16_rows_only_and_empty", ()),
]

SCRIPT = r"""
import importlib, json, sys
import torch
import triton
from sgl_kvxfer.kernels.compile_only import compile_only

for module, name, args in json.loads(sys.argv[1]):
    fn = getattr(importlib.import_module(module), name)
    args = [getattr(torch, a) if isinstance(a, str) and a.startswith("float") else a for a in args]
    with compile_only(arch=90) as kernels:
        try:
            fn(*args)
        except AssertionError:
            pass  # the outputs were never written: only the compile is checked
    print(json.dumps({"case": f"{name}{tuple(args)}", "kernels": len(kernels), "triton": triton.__version__,
                      "cubin": all(bool(k.asm.get("cubin")) for k in kernels)}), flush=True)
"""


def _has_nvidia_backend(site: Path | None) -> bool:
    roots = [site] if site else [Path(p) for p in sys.path if p]
    return any((r / "triton" / "backends" / "nvidia" / "compiler.py").exists() for r in roots)


@pytest.mark.slow
def test_kernels_compile_for_sm90():
    site = DEVICE_TRITON if (DEVICE_TRITON / "triton").is_dir() else None
    if not _has_nvidia_backend(site):
        pytest.skip("no Triton NVIDIA backend to compile with")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    paths = [str(site)] if site else []
    env["PYTHONPATH"] = os.pathsep.join(paths + [str(ROOT), str(ROOT / "test" / "kernels"),
                                                 env.get("PYTHONPATH", "")])
    env["TRITON_CACHE_DIR"] = str(ROOT / ".cache" / "triton-compile-check")
    proc = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(CASES)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == len(CASES), proc.stdout
    for row in rows:
        assert row["kernels"] >= 1 and row["cubin"], row
    if site:
        assert rows[0]["triton"].startswith("3.6"), rows[0]
