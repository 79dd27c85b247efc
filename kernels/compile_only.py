"""Compile the project's Triton kernels for a CUDA target on a machine with no GPU.

    with compile_only(arch=90):
        gather_tiered_kv(...)          # CPU tensors: every launch compiles for sm_90, none runs

The Triton interpreter (TRITON_INTERPRET=1, what CI tests kernels with) runs a kernel's Python
and never lowers it, so a kernel can pass every interpreter test and still fail to compile on a
GPU: a layout pass that rejects the IR, an unsupported op, a constexpr that only the real
specializer produces. Inside `compile_only` the real JIT runs its whole pipeline (TTIR, TTGIR,
LLVM IR, PTX, cubin through the ptxas Triton ships) with the specialization a real launch gets
from the same arguments (pointer alignment from data_ptr, integers equal to 1 as constants,
multiples of 16), and skips the launch itself.

Hazards: launchers return their outputs unwritten (torch.empty), so nothing after a launch may
depend on its values; an autotuned kernel compiles all its configs and records no tuned pick; a launcher that asks torch.cuda about the device gets the answers of
`num_sms` (kernels/_tiles.py) for CPU tensors. Not reentrant: it swaps Triton's active driver
and the kernels' launch (`fn[grid](...)`) for the duration of the block.
"""
from __future__ import annotations

import contextlib
import os

import torch


class _CompileOnlyDriver:
    """The parts of Triton's driver interface that the JIT's compile path calls."""

    def __init__(self, target):
        self.target = target

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


@contextlib.contextmanager
def compile_only(arch: int = 90, warp_size: int = 32):
    """Every JIT launch inside the block compiles for CUDA sm_`arch` and returns without running.
    Yields the list of compiled kernels (CompiledKernel, in launch order)."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise RuntimeError("compile_only needs the real JIT: unset TRITON_INTERPRET")
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver
    from triton.runtime.jit import KernelInterface

    compiled = []
    launch = KernelInterface.__getitem__

    def compile_instead(self, grid):
        # warmup: a JITFunction compiles its launch; an Autotuner compiles every (pruned) config
        # of it, and benchmarks none (nothing runs, so it records no pick either)
        def run(*args, **kwargs):
            kernels = self.warmup(*args, grid=grid, **kwargs)
            compiled.extend(kernels if isinstance(kernels, list) else [kernels])
            return kernels
        return run

    previous = driver._active  # None on a machine without a GPU: reset_active() would build one and fail
    driver.set_active(_CompileOnlyDriver(GPUTarget("cuda", arch, warp_size)))
    KernelInterface.__getitem__ = compile_instead
    try:
        yield compiled
    finally:
        KernelInterface.__getitem__ = launch
        driver._active = previous
