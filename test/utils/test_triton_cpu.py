"""The CPU interpreter warning (utils/triton_cpu.py) names modules that made a Triton kernel
before TRITON_INTERPRET was set, and only those: the torch-only codec and references are fine."""
import os
import subprocess
import sys

CHECK = """
import logging, sys
logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(message)s")
{imports}
from sgl_kvxfer.utils.triton_cpu import use_interpreter_on_cpu
use_interpreter_on_cpu("cpu")
"""


def _run(imports: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", CHECK.format(imports=imports)], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_torch_only_kernel_modules_do_not_warn():
    assert _run("import sgl_kvxfer.kernels, sgl_kvxfer.kernels.reference, sgl_kvxfer.layers.rope") == ""


def test_a_jit_kernel_imported_early_warns_with_its_module():
    assert "sgl_kvxfer.kernels.tier_store" in _run("import sgl_kvxfer.kernels.tier_store")
