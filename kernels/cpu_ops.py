"""Native CPU kernels (C++/OpenMP, `csrc/`) for bf16 serving on CPU.

The Triton kernels only run interpreted on CPU, so a bf16 CPU engine would otherwise run the
model's elementwise ops as 5-10 unfused torch ops each and decode attention as a gathered,
padded copy of every request's KV. These ops replace that:

    add_rmsnorm(x, weight, eps, residual=None)  -> out | (out, x + residual)
    silu_mul(x [T, 2I])                          -> [T, I]
    rope_qk(q [T, Hq, D], k [T, Hkv, D], cos, sin [T, 1, D/2]) -> (q', k') contiguous
    bf16_to_f32(x, out=None)                     -> x.float(), in parallel (the logits)
    argmax_rows(x fp32 [R, V])                   -> x.argmax(-1), in parallel (greedy sampling)
    decode_attention(q [B, Hq, D], k_buf, v_buf [S, Hkv, D], table [R, C], rows [B], lens [B],
                     scale) -> [B, Hq, D]   (reads the pool in place through table rows)

Each has a `*_reference` torch function below (the model's own torch path) and a test in
test/kernels/test_cpu_ops.py. The extension is compiled with the system C++ compiler for the
CPU's ISA level (sgl_kvxfer/utils/cpu_isa.py: -march=x86-64-v3 on AVX2, -march=native with
512-bit vectors on AVX-512; about a minute on 2 cores) into a folder keyed by everything that
changes the binary, this install included (`build_key()`, `build_dir()`, under
$SGL_KVXFER_KERNEL_CACHE or ~/.cache/sgl_kvxfer/cpu_kernels), so two installs on one machine
never rebuild each other's. The engine builds it at start-up, before it reports ready
(`engine/model_runner.py`); `available()` is False where no compiler or ninja is found, and
callers then keep the torch path. Importing this module builds nothing (`toolchain_found()`
neither: test collection uses it).
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import sys

import torch
import torch.nn.functional as F

_CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
# cpu_ops.cpp: elementwise ops + the module; cpu_decode_attention.cpp: decode attention (an
# AVX512-BF16 path where the build has it, a portable one otherwise); cpu_common.h: helpers.
_SOURCES = [os.path.join(_CSRC, "cpu_ops.cpp"), os.path.join(_CSRC, "cpu_decode_attention.cpp")]
_module = None
_load_error: str | None = None


def _compiler() -> tuple[str, str]:
    """(path, first line of `--version`) of the C++ compiler torch builds with ($CXX or c++);
    ("", "") where there is none."""
    return _compiler_of(os.environ.get("CXX", "c++"))


@functools.lru_cache(maxsize=4)
def _compiler_of(cxx: str) -> tuple[str, str]:
    import shutil
    import subprocess

    path = shutil.which(cxx) or ""
    if not path:
        return "", ""
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    return os.path.realpath(path), (out.splitlines() or [""])[0]


def _cpu_model() -> str:
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    except OSError:
        pass
    return name


def _cflags() -> list[str]:
    from sgl_kvxfer.utils import cpu_isa

    return ["-O3", *cpu_isa.native_build_flags(), "-fopenmp", "-ffp-contract=off"]


_LDFLAGS = ["-fopenmp"]


def build_key() -> dict[str, str]:
    """Everything that changes the binary or decides who may load it. A build is valid only for
    all of these: the install (the interpreter prefix, torch's version and path: two virtualenvs
    on one machine never share, so never rebuild each other's), the compiler and its version,
    the CPU model and ISA level with the flags (-march=native code is only valid on this CPU),
    and every file of csrc/ (a changed header changes the build too)."""
    import sysconfig

    from sgl_kvxfer.utils import cpu_isa

    cxx_path, cxx_version = _compiler()
    h = hashlib.sha256()
    for f in sorted(os.listdir(_CSRC)):
        with open(os.path.join(_CSRC, f), "rb") as fh:
            h.update(f.encode() + b"\0" + fh.read() + b"\0")
    return {"install": sys.prefix, "python": f"{sys.version} {sysconfig.get_config_var('EXT_SUFFIX')}",
            "torch": f"{torch.__version__} {os.path.dirname(os.path.realpath(torch.__file__))}",
            "compiler": f"{cxx_path} {cxx_version}", "cpu": _cpu_model(), "isa": cpu_isa.level(),
            "cflags": " ".join(_cflags()), "ldflags": " ".join(_LDFLAGS), "sources": h.hexdigest()}


def build_dir(key: dict[str, str] | None = None) -> str:
    """The folder of this install's build: <cache root>/cpu_ops_<isa>_<hash of build_key()>."""
    from sgl_kvxfer import env

    key = build_key() if key is None else key
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    root = env.KERNEL_CACHE.get() or os.path.join(os.path.expanduser("~"), ".cache", "sgl_kvxfer", "cpu_kernels")
    return os.path.join(root, f"cpu_ops_{key['isa']}_{digest}")


def toolchain_found() -> bool:
    """A C++ compiler and ninja are on this machine (builds nothing: safe at test collection)."""
    from torch.utils.cpp_extension import is_ninja_available

    return bool(_compiler()[0]) and is_ninja_available()


def _import(name: str, path: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load():
    """The compiled extension module. Built once per install, CPU and ISA level into
    `build_dir()` (about a minute on 2 cores, announced on stderr with a "building" and a
    "done in N s" line; silent when built). Concurrent first loads build once: the others wait
    for the live builder (utils/locked_build.py). Raises on failure."""
    global _module, _load_error
    if _module is not None:
        return _module
    if _load_error is not None:
        raise RuntimeError(_load_error)
    from sgl_kvxfer.utils import cpu_isa
    from sgl_kvxfer.utils.locked_build import build_once

    key = build_key()
    final = build_dir(key)
    name = "sgl_kvxfer_cpu_ops_" + os.path.basename(final).rsplit("_", 1)[1]
    built = {}

    def build(tmp: str) -> None:
        from torch.utils.cpp_extension import load as load_ext

        with open(os.path.join(tmp, "build_key.json"), "w") as f:
            json.dump(key, f, indent=1)
        built["module"] = load_ext(name=name, sources=_SOURCES, extra_include_paths=[_CSRC],
                                   extra_cflags=_cflags(), extra_ldflags=_LDFLAGS,
                                   build_directory=tmp, verbose=False)

    try:
        if not key["compiler"].strip():
            raise RuntimeError("no C++ compiler found ($CXX or c++)")
        build_once(final, build, name + ".so", f"the native CPU kernels for {cpu_isa.level()}",
                   "(once per install, about a minute)")
        _module = built.get("module") or _import(name, os.path.join(final, name + ".so"))
    except Exception as e:  # no compiler, no ninja, ...: callers fall back to torch
        _load_error = f"native CPU kernels unavailable: {type(e).__name__}: {str(e)[-400:]}"
        raise RuntimeError(_load_error) from e
    return _module


def available() -> bool:
    try:
        load()
        return True
    except RuntimeError:
        return False


def load_error() -> str | None:
    """Why the extension could not be built (None if it was, or was never tried)."""
    return _load_error


def enabled() -> bool:
    """The engine's one switch for every native CPU path: SGL_KVXFER_CPU_KERNELS (default on)
    and an extension that builds on this machine."""
    from sgl_kvxfer import env

    return env.CPU_KERNELS.get_bool() and available()


# ------------------------------------------------------------------ launchers
def _op(name: str):
    """Names the native call in torch.profiler tables (it is invisible there otherwise)."""
    return torch.profiler.record_function(f"sgl_kvxfer_cpu::{name}")


def add_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """x [T, H] (last dim contiguous) -> normed; with residual: (normed(x + residual), x + residual)."""
    assert x.device.type == "cpu" and x.dim() == 2, (x.device, x.shape)
    with _op("add_rmsnorm"):
        out = load().add_rmsnorm(x, residual, weight.contiguous(), float(eps))
    return out[0] if residual is None else (out[0], out[1])


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] = [gate | up] -> silu(gate) * up [T, I]."""
    assert x.device.type == "cpu" and x.dim() == 2, (x.device, x.shape)
    with _op("silu_mul"):
        return load().silu_mul(x)


def rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """q [T, Hq, D], k [T, Hkv, D] (strided views allowed), cos/sin [T, 1, D/2] -> rotated copies."""
    assert q.device.type == "cpu" and cos.dtype == q.dtype, (q.device, cos.dtype, q.dtype)
    with _op("rope_qk"):
        qo, ko = load().rope_qk(q, k, cos, sin)
    return qo, ko


def bf16_to_f32(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Contiguous bf16 CPU tensor -> the same values in fp32 (exact), widened in parallel,
    into `out` (contiguous fp32, same shape) when given."""
    assert x.device.type == "cpu" and x.dtype == torch.bfloat16, (x.device, x.dtype)
    with _op("bf16_to_f32"):
        return load().bf16_to_f32(x.contiguous(), out)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """fp32 [R, V] -> int64 [R]: torch.argmax(x, -1) (first maximal index; NaN is maximal)."""
    assert x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2, (x.device, x.dtype)
    with _op("argmax_rows"):
        return load().argmax_rows(x.contiguous())


def decode_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, table: torch.Tensor,
                     rows: torch.Tensor, lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, Hq, D]; k_buf/v_buf [S, Hkv, D] (one layer of the pool); request b attends to slots
    table[rows[b], :lens[b]]. Returns [B, Hq, D] in q's dtype (fp32 softmax and accumulation)."""
    assert q.device.type == "cpu" and k_buf.device.type == "cpu"
    with _op("decode_attention"):
        return load().decode_attention(q.contiguous(), k_buf, v_buf, table, rows.to(torch.int64).contiguous(),
                                   lens.to(torch.int64).contiguous(), float(scale))


# ------------------------------------------------------------------ torch references
def argmax_rows_reference(x):
    return x.argmax(dim=-1)


def add_rmsnorm_reference(x, weight, eps, residual=None):
    from .reference import rmsnorm_torch

    return rmsnorm_torch(x, weight, eps, residual)


def silu_mul_reference(x):
    from .reference import silu_mul_torch

    return silu_mul_torch(x)


def rope_qk_reference(q, k, cos, sin):
    from .reference import apply_rope

    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


def decode_attention_reference(q, k_buf, v_buf, table, rows, lens, scale):
    """Per request: gather its slots and run SDPA (the torch backend's decode math)."""
    out = torch.empty_like(q)
    for b in range(q.shape[0]):
        slots = table[int(rows[b]), : int(lens[b])].long()
        keys, values = k_buf[slots], v_buf[slots]  # [L, Hkv, D]
        out[b] = F.scaled_dot_product_attention(
            q[b][None, :, None, :], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
            scale=scale, enable_gqa=True)[0, :, 0, :]
    return out
