"""What the host CPU runs, read once per process, and the native CPU paths that follows from it.

Levels, lowest first (each includes the one before):

    baseline      any x86-64 (or another architecture): torch paths only, C++ kernels at -O3
    avx2          AVX2 + FMA (x86-64-v3): C++ kernels built for x86-64-v3; bf16 linears run as
                  fp32 GEMMs on an fp32 copy of the weights (oneDNN has no bf16 GEMM here)
    avx512        AVX-512 F/BW/VL/DQ: oneDNN-prepacked bf16 linears, 512-bit C++ kernels
    avx512_bf16   + AVX512_BF16: the C++ decode attention's bf16 dot-product path
    amx           + AMX-BF16 (oneDNN uses it by itself for bf16 GEMMs)

`SGL_KVXFER_CPU_ISA` caps the level (e.g. `avx2` on an AVX-512 machine runs exactly the paths an
AVX2-only CPU runs). torch's own kernels dispatch on their own; to cap them as well, set
`ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2` before torch starts (the test suite does this
when the cap is set: test/conftest.py).
"""
from __future__ import annotations

import functools
import logging
import os
import platform

from sgl_kvxfer import env

logger = logging.getLogger(__name__)

LEVELS = ("baseline", "avx2", "avx512", "avx512_bf16", "amx")
# /proc/cpuinfo flags each level needs on top of the level below it
_LEVEL_FLAGS = {
    "avx2": {"avx2", "fma"},
    "avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq"},
    "avx512_bf16": {"avx512_bf16"},
    "amx": {"amx_bf16", "amx_tile"},
}


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The kernel's CPU feature flags (Linux); empty where /proc/cpuinfo is unreadable."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def _is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def detected_level(flags: frozenset[str] | None = None) -> str:
    """The highest level whose flags (and all lower levels' flags) are in `flags` (default:
    this CPU's; any other architecture is "baseline")."""
    if flags is None:
        if not _is_x86():
            return "baseline"
        flags = cpu_flags()
    level = "baseline"
    for name in LEVELS[1:]:
        if not _LEVEL_FLAGS[name] <= flags:
            break
        level = name
    return level


def level() -> str:
    """The level the native paths use: the detected one, capped by SGL_KVXFER_CPU_ISA."""
    cap = (env.CPU_ISA.get() or "auto").strip().lower()
    found = detected_level()
    if cap in ("", "auto", "native"):
        return found
    if cap not in LEVELS:
        raise ValueError(f"{env.CPU_ISA.name}={cap!r}: expected auto or one of {LEVELS}")
    return LEVELS[min(LEVELS.index(cap), LEVELS.index(found))]


def at_least(name: str) -> bool:
    return LEVELS.index(level()) >= LEVELS.index(name)


# ONEDNN_MAX_CPU_ISA values under which oneDNN itself has neither bf16 route (AVX2_VNNI_2 brings
# AVX-NE-CONVERT); oneDNN reads the variable once, when torch first uses it.
_ONEDNN_CAPS_WITHOUT_BF16 = frozenset({"SSE41", "AVX", "AVX2", "AVX2_VNNI"})


def onednn_bf16_linear() -> bool:
    """oneDNN's bf16 weight prepack (`mkldnn._reorder_linear_weight`) runs here: it needs AVX-512
    BW/VL/DQ or AVX-NE-CONVERT, and raises on anything less, including a CPU that has them
    under a ONEDNN_MAX_CPU_ISA cap below them."""
    if os.environ.get("ONEDNN_MAX_CPU_ISA", "").strip().upper() in _ONEDNN_CAPS_WITHOUT_BF16:
        return False
    return at_least("avx512") or (at_least("avx2") and "avx_ne_convert" in cpu_flags())


def native_build_flags() -> list[str]:
    """Code-generation flags for the C++ kernels at this level (kernels/cpu_ops.py)."""
    lvl = level()
    if not _is_x86():
        return ["-march=native"]
    if lvl == "baseline":
        return []
    if lvl == "avx2":
        return ["-march=x86-64-v3"]
    flags = ["-march=native", "-mprefer-vector-width=512"]
    if lvl == "avx512":  # a cap below what the CPU has: keep its extensions out of the build
        flags += ["-mno-avx512bf16", "-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"]
    return flags


# What a cap means for torch's own kernels: (ONEDNN_MAX_CPU_ISA, ATEN_CPU_CAPABILITY)
_TORCH_CAPS = {"baseline": ("SSE41", "default"), "avx2": ("AVX2", "avx2"), "avx512": ("AVX512_CORE", "avx512"),
               "avx512_bf16": ("AVX512_CORE_BF16", "avx512"), "amx": ("AVX512_CORE_AMX", "avx512")}


def torch_cap_env() -> dict[str, str]:
    """The environment that caps torch's oneDNN and ATen dispatch at SGL_KVXFER_CPU_ISA (empty
    when it is unset). Only effective in a process that has not started torch yet."""
    cap = (env.CPU_ISA.get() or "auto").strip().lower()
    if cap not in _TORCH_CAPS:
        return {}
    onednn, aten = _TORCH_CAPS[cap]
    return {"ONEDNN_MAX_CPU_ISA": onednn, "ATEN_CPU_CAPABILITY": aten}


def describe() -> str:
    """One log line: what was detected, what runs."""
    lvl, found = level(), detected_level()
    capped = f" (capped by {env.CPU_ISA.name}; the CPU has {found})" if lvl != found else ""
    linears = "oneDNN-prepacked bf16" if onednn_bf16_linear() else "fp32 GEMMs on an fp32 weight copy"
    return f"CPU ISA {lvl}{capped}: bf16 linears run as {linears}; C++ kernels built with {native_build_flags() or ['-O3']}"
