"""Triton's CPU interpreter for engines on CPU.

Hazard: `triton.jit` reads TRITON_INTERPRET when a kernel module is *imported*; kernels imported
before it is set cannot run on CPU ("Cannot call @triton.jit'd outside of the scope of a
kernel"). Engine and scheduler-process entry points call `use_interpreter_on_cpu` before they
import anything that imports `sgl_kvxfer.kernels`.
"""
from __future__ import annotations

import logging
import os
import sys

logger = logging.getLogger(__name__)


def use_interpreter_on_cpu(device: str) -> None:
    if not device.startswith("cpu") or os.environ.get("TRITON_INTERPRET") == "1":
        return
    early = jit_kernel_modules()
    if early:
        logger.warning("Triton kernels were imported before the CPU interpreter was turned on (%s); the "
                       "triton attention backend will not run in this process: set TRITON_INTERPRET=1 first",
                       ", ".join(early[:3]))
    os.environ["TRITON_INTERPRET"] = "1"


def jit_kernel_modules() -> list[str]:
    """Our modules that hold a Triton kernel (a `@triton.jit` or autotuned function) already
    made: the torch-only ones (the tier codec, the references) are not the hazard."""
    jit = sys.modules.get("triton.runtime.jit")
    if jit is None:  # triton not imported: no kernel was made
        return []
    return sorted(name for name, mod in list(sys.modules.items())
                  if name.startswith(("sgl_kvxfer.kernels", "kernels.")) and mod is not None
                  and any(isinstance(v, jit.KernelInterface) for v in list(vars(mod).values())))
