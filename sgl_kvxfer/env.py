"""Every environment toggle of sgl_kvxfer, typed, in one place (prefix SGL_KVXFER_).

Read through the accessors below at the point of use, so tests can monkeypatch os.environ.
"""
from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: str | None
    doc: str

    def get(self) -> str | None:
        return os.environ.get(self.name, self.default)

    def get_float(self) -> float:
        return float(self.get())

    def get_bool(self) -> bool:
        """Unset or "", "0", "false", "no", "off" (any case) -> False; anything else -> True."""
        v = self.get()
        return v is not None and v.strip().lower() not in ("", "0", "false", "no", "off")


MODEL_CACHE = EnvVar("SGL_KVXFER_MODEL_CACHE", None,
                     "root folder for converted models (default ~/.cache/sgl_kvxfer/models)")


def model_cache_root() -> str:
    """The converted-models folder: $SGL_KVXFER_MODEL_CACHE or ~/.cache/sgl_kvxfer/models."""
    return os.path.expanduser(MODEL_CACHE.get() or "~/.cache/sgl_kvxfer/models")


PROBE_CACHE = EnvVar("SGL_KVXFER_PROBE_CACHE", None,
                     "folder for cached int4-probe decisions (default ~/.cache/sgl_kvxfer/int4_probe)")
STARTUP_TIMEOUT = EnvVar("SGL_KVXFER_STARTUP_TIMEOUT", "900",
                         "seconds launch_server waits for the scheduler and detokenizer to come up")
COMMIT = EnvVar("SGL_KVXFER_COMMIT", None, "commit recorded by benchmarks when git is unavailable")
FUSED_ELEMENTWISE = EnvVar(
    "SGL_KVXFER_FUSED_ELEMENTWISE", "1",
    "on CUDA fp16/bf16 the model runs fused Triton RMSNorm / RoPE(+KV store) / SwiGLU; 0: the "
    "torch ops instead (kernels/README.md section 7)")

CPU_KERNELS = EnvVar(
    "SGL_KVXFER_CPU_KERNELS", "1",
    "0: on CPU bf16 keep the torch path instead of the native C++ kernels (kernels/cpu_ops.py: "
    "RMSNorm / RoPE / SwiGLU, in-place decode attention, prepacked oneDNN linears)")

KERNEL_CACHE = EnvVar(
    "SGL_KVXFER_KERNEL_CACHE", None,
    "root folder of the native CPU kernel builds, one per install and CPU (kernels/cpu_ops.py; "
    "default ~/.cache/sgl_kvxfer/cpu_kernels)")

CPU_ISA = EnvVar(
    "SGL_KVXFER_CPU_ISA", "auto",
    "cap on the CPU instruction set the native CPU paths use: auto (what the CPU has), baseline, "
    "avx2, avx512, avx512_bf16, amx (sgl_kvxfer/utils/cpu_isa.py); avx2 on an AVX-512 machine "
    "runs the paths of an AVX2-only CPU")

DECODE_LONGEST_FIRST = EnvVar(
    "SGL_KVXFER_DECODE_LONGEST_FIRST", "1",
    "the triton backend's decode attention serves a batch's requests longest first (one argsort "
    "per batch; kernels/README.md); 0: in batch order")

TORCH_PROFILER_DIR = EnvVar(
    "SGLANG_TORCH_PROFILER_DIR", None,
    "SGLang's name, read as SGLang reads it: where POST /start_profile writes its trace when the "
    "request names no output_dir (default: the system temp folder; sgl_kvxfer/scheduler/profiler.py)")

# The data checkouts share (eval prose, SCD corpora): ../shared/data beside the repository, where
# dev machines and CI keep it. Never a fixed machine path; each use also takes a variable or flag.
SHARED_DATA_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                               "shared", "data")

PROBE_PROSE = EnvVar(
    "SGL_KVXFER_PROBE_PROSE", os.path.join(SHARED_DATA_DIR, "prose_eval.jsonl"),
    "JSONL of {\"text\": ...} rows: filler prose for the int4 probe's needle-in-a-haystack "
    "prompts; when the file is absent, the docstrings of Python's standard library are used")

KV_TRANSFER_FAULT = EnvVar(
    "SGL_KVXFER_KV_TRANSFER_FAULT", None,
    "tests only: faults the PD prefill's sender injects into KV writes, comma-separated "
    "kind[:seconds][@room] with kind corrupt, truncate or delay (sgl_kvxfer/disagg/common.py)")

KV_BUFFER = EnvVar(
    "SGL_KVXFER_KV_BUFFER", "auto",
    "where a PD server's registered transfer buffer lives: auto (GPU memory on CUDA when the installed "
    "Mooncake build registers GPU memory, else host), host, or device (sgl_kvxfer/disagg/buffers.py)")

SCD_DATA = EnvVar(
    "SGL_KVXFER_SCD_DATA", None,
    "folder of text corpora NAME_SPLIT.jsonl[.gz] that SCD calibration reads for a `corpus:NAME` "
    "spec (sgl_kvxfer/scd/calib/data.py); unset: only task-suite specs and explicit paths work")

TIERED_DECODE_CONFIG = EnvVar(
    "SGL_KVXFER_TIERED_DECODE_CONFIG", None,
    "JSON object of kernels.tiered_pool_decode.TieredDecodeConfig fields (e.g. {\"tile8\": 128, "
    "\"qk_int8\": true}) replacing the served config of the tiered pool's decode for every head shape")

FUSEDKV_DATA = EnvVar(
    "SGL_KVXFER_FUSEDKV_DATA", None,
    "folder of {domain}_{train,calib,eval}.jsonl (or their token files) for FusedKV conversion and "
    "training when no --train-data / --data-dir is given (sgl_kvxfer/fusedkv/data.py)")

GC_FREEZE = EnvVar(
    "SGL_KVXFER_GC_FREEZE", "auto",
    "1: the scheduler moves every object alive after its start-up (the model, kernel caches, CUDA "
    "graphs) out of the garbage collector's scans (gc.freeze), so a collection of the oldest "
    "generation scans only what requests allocate; auto: 1 when the model runs on a GPU; 0: collect "
    "as Python does (utils/host_runtime.py)")

SCHEDULER_THREADS = EnvVar(
    "SGL_KVXFER_SCHEDULER_THREADS", "auto",
    "torch intra-op threads of the scheduler process: auto (1 when the model runs on a GPU without "
    "a cold tier, where the host's tensor work is id bookkeeping of at most a few hundred thousand "
    "elements; else torch's default), 0 (torch's default), or a count (utils/host_runtime.py)")

GIL_SWITCH_US = EnvVar(
    "SGL_KVXFER_GIL_SWITCH_US", "auto",
    "the scheduler process's GIL switch interval in microseconds (sys.setswitchinterval): how long a "
    "thread back from a blocking call (the KV sender after a Mooncake write, which releases the GIL) "
    "waits while the scheduler thread runs Python before it is made to yield; auto: 200 when the "
    "model runs on a GPU, else Python's own (5000); 0: Python's own (utils/host_runtime.py)")

PD_COMPUTE_STREAM = EnvVar(
    "SGL_KVXFER_PD_COMPUTE_STREAM", "auto",
    "auto: a PD prefill server whose KV leaves from GPU memory runs its model on a CUDA stream of its "
    "own instead of the legacy default stream, which Mooncake's NVLink copies synchronize with "
    "(sgl_kvxfer/disagg/pack_stream.py); 0: the default stream")

WINDOW_MASS = EnvVar(
    "SGL_KVXFER_WINDOW_MASS", "1",
    "on CUDA, SpectrumKV's prefill importance capture sums each layer's window attention in one Triton "
    "launch (kernels/window_mass.py); 0: the torch path (its reference)")

ALL = (MODEL_CACHE, PROBE_CACHE, STARTUP_TIMEOUT, COMMIT, FUSED_ELEMENTWISE, CPU_KERNELS, KERNEL_CACHE, CPU_ISA,
       DECODE_LONGEST_FIRST, PROBE_PROSE, KV_TRANSFER_FAULT, KV_BUFFER, SCD_DATA, TIERED_DECODE_CONFIG, FUSEDKV_DATA,
       GC_FREEZE, SCHEDULER_THREADS, GIL_SWITCH_US, PD_COMPUTE_STREAM, WINDOW_MASS)
