"""Native CPU kernels (C++/OpenMP, `csrc/`) for bf16 serving on CPU.

The Triton kernels only run interpreted on CPU, so a bf16 CPU engine would otherwise run the
model's elementwise ops as 5-10 unfused torch ops each and decode attention as a gathered,
padded copy of every request's KV. These four ops replace that:

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
512-bit vectors on AVX-512; about a minute on 2 cores) and cached by torch under
$TORCH_EXTENSIONS_DIR. The engine builds it at start-up, before it reports ready
(`engine/model_runner.py`); `available()` is False where no compiler or ninja is found, and
callers then keep the torch path.
"""
from __future__ import annotations

import hashlib
import logging
import os
import platform

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

_CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
# cpu_ops.cpp: elementwise ops + the module; cpu_decode_attention.cpp: decode attention (an
# AVX512-BF16 path where the build has it, a portable one otherwise); cpu_common.h: helpers.
_SOURCES = [os.path.join(_CSRC, "cpu_ops.cpp"), os.path.join(_CSRC, "cpu_decode_attention.cpp")]
_module = None
_load_error: str | None = None


def _build_tag() -> str:
    """Key of the cached build: code built for one CPU model and ISA level is only valid there,
    and torch rebuilds on changed sources but not on a changed header, so all go into the name."""
    from sgl_kvxfer.utils import cpu_isa

    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line for line in f if line.startswith("model name")), name)
    except OSError:
        pass
    h = hashlib.sha1(name.encode())
    h.update(" ".join(cpu_isa.native_build_flags()).encode())
    for f in sorted(os.listdir(_CSRC)):
        with open(os.path.join(_CSRC, f), "rb") as fh:
            h.update(fh.read())
    return h.hexdigest()[:8]


def load():
    """The compiled extension module; builds it once per machine and ISA level (about a minute
    on 2 cores, announced with a start and a "done in N s" line; silent when cached). Raises on
    failure."""
    global _module, _load_error
    if _module is not None:
        return _module
    if _load_error is not None:
        raise RuntimeError(_load_error)
    import time

    from torch.utils.cpp_extension import _get_build_directory
    from torch.utils.cpp_extension import load as load_ext

    from sgl_kvxfer.utils import cpu_isa

    name = f"sgl_kvxfer_cpu_ops_{_build_tag()}"
    start = time.perf_counter()
    try:
        build_dir = _get_build_directory(name, verbose=False)
        _clear_stale_build_lock(build_dir)
        cached = os.path.exists(os.path.join(build_dir, name + ".so"))
        if not cached:
            logger.info("building the native CPU kernels for %s (once per machine, about a minute)...",
                        cpu_isa.level())
        _module = load_ext(name=name, sources=_SOURCES, extra_include_paths=[_CSRC],
                           extra_cflags=["-O3", *cpu_isa.native_build_flags(), "-fopenmp", "-ffp-contract=off"],
                           extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as e:  # no compiler, no ninja, ...: callers fall back to torch
        _load_error = f"native CPU kernels unavailable: {type(e).__name__}: {str(e)[-400:]}"
        raise RuntimeError(_load_error) from e
    if not cached:
        logger.info("native CPU kernels built: done in %.0f s", time.perf_counter() - start)
    return _module


_STALE_LOCK_S = 600  # a build takes about a minute on 2 cores; a lock 10x older has no owner


def _clear_stale_build_lock(build_dir: str, poll_s: float = 1.0) -> None:
    """Hazard: torch's build lock (`<build_dir>/lock`) is a plain file that a killed build leaves
    behind, and torch then waits on it forever. Wait here instead while the lock is younger than
    any real build (another process is building: it removes the lock when done); once it is
    older than that, it has no owner and is removed with a warning."""
    import time

    lock = os.path.join(build_dir, "lock")
    while True:
        try:
            age = time.time() - os.path.getmtime(lock)
        except OSError:
            return  # no lock
        if age > _STALE_LOCK_S:
            logger.warning("removing a stale build lock %s (%.0f s old, left by a killed build)", lock, age)
            try:
                os.remove(lock)
            except OSError:
                pass
            return
        time.sleep(poll_s)


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
