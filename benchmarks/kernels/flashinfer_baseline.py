"""FlashInfer's paged decode as a baseline for our decode kernel (benchmarks/kernels/attention.py).

    python benchmarks/kernels/flashinfer_baseline.py [--quick] [--dtype float16 --no-fp8] [--out-dir DIR]
    python benchmarks/kernels/flashinfer_baseline.py --warm-jit [cc tc fp8]      # JIT builds only
    python benchmarks/kernels/flashinfer_baseline.py --plot-only benchmarks/results/flashinfer_decode_<dev>.json

Same points as attention.py: one layer, one decode step, every request of the batch at the same
context, page size 64, shapes Llama-3-8B (32 q / 8 kv heads, D 128) and SmolLM2 (9 / 3, D 64),
batch 1 / 8 / 32, contexts 1k .. 128k (B * ctx <= 4M tokens). Writes
flashinfer_decode_<device>[_float16].json + .png (bf16 by default; attention.py times fp16). KV in FlashInfer's HND paged
layout ([pages, Hkv, PAGE, D], our PagedFp16KVPool's), each request on random pages.

Variants (FlashInfer's FA2 kernels, JIT-built with the machine's nvcc on first use):
  flashinfer       BatchDecodeWithPagedKVCacheWrapper, CUDA-core decode kernel
  flashinfer_tc    the same wrapper with use_tensor_cores=True (its prefill kernel)
  flashinfer_fp8   CUDA-core decode over float8_e4m3fn K/V (q and o in --dtype), --fp8

Time: the wrapper planned once (outside the timing, as an engine plans once per batch), its
run() captured in a CUDA graph (use_cuda_graph=True wrapper, fixed buffers) and replayed; CUDA
events, L2 flushed before each call, median (attention.py's helpers). Bytes = K/V read + q read
+ o written.

For attention.py (the lead's merge): `flashinfer_decode_timings((Hq, Hkv, D), B, ctx, 64,
torch.bfloat16)` returns {variant: {"ms", "bytes", "graphed", ...}} for one point, or
{"error": "..."} where FlashInfer is missing or fails.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common.report import git_commit, write_json  # noqa: E402

# Timing helpers (graph capture with eager fallback; events, flush, median): this script's own
# method; attention.py times FlashInfer through common/bandwidth.py's rotated copies instead.
def _graphed(fn, cuda: bool = True):
    if not cuda:
        return fn, False
    try:
        fn()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        return g.replay, True
    except Exception as exc:  # noqa: BLE001
        print("graph capture failed, timing eager:", repr(exc)[:200], flush=True)
        torch.cuda.synchronize()
        return fn, False


def _median_ms(fn, flush, iters: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(iters):
        flush.zero_()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e))
    ts.sort()
    return ts[len(ts) // 2]


def copy_bandwidth(flush, nbytes: int = 1 << 30) -> float:
    a = torch.empty(nbytes, dtype=torch.uint8, device=flush.device)
    b = torch.empty_like(a)
    ms = _median_ms(lambda: b.copy_(a), flush, 10)
    return 2 * nbytes / (ms * 1e-3)


MODELS = {"llama3-8b": (32, 8, 128), "smollm2": (9, 3, 64)}
PAGE = 64
WORKSPACE_BYTES = 128 << 20
_FLUSH: dict = {}


def _flush_buffer(dev) -> torch.Tensor:
    key = str(dev)
    if key not in _FLUSH:
        _FLUSH[key] = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    return _FLUSH[key]


def build_paged_kv(B: int, ctx: int, Hkv: int, D: int, page_size: int, dtype, device, seed: int = 0):
    """Random K/V pages [B * cdiv(ctx, P) + 1, Hkv, P, D] (page 0 unused, like the pool's
    padding page) and FlashInfer's CSR over them: each request on random distinct pages."""
    g = torch.Generator(device=device).manual_seed(seed)
    n = -(-ctx // page_size)
    shape = (B * n + 1, Hkv, page_size, D)
    if dtype.itemsize == 1:  # fp8: random values through bf16
        k = torch.randn(shape, dtype=torch.bfloat16, device=device, generator=g).to(dtype)
        v = torch.randn(shape, dtype=torch.bfloat16, device=device, generator=g).to(dtype)
    else:
        k = torch.randn(shape, dtype=dtype, device=device, generator=g)
        v = torch.randn(shape, dtype=dtype, device=device, generator=g)
    indices = (torch.randperm(B * n, device=device, generator=g) + 1).to(torch.int32)
    indptr = torch.arange(0, B * n + 1, n, dtype=torch.int32, device=device)
    last = torch.full((B,), ctx - (n - 1) * page_size, dtype=torch.int32, device=device)
    return (k, v), indptr, indices, last


def decode_wrapper(B: int, n_pages: int, tensor_cores: bool, device, workspace=None):
    """A use_cuda_graph=True decode wrapper over fixed index buffers (FA2 kernels, HND)."""
    import flashinfer

    ws = workspace if workspace is not None else torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    return flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        ws, "HND", use_cuda_graph=True, use_tensor_cores=tensor_cores,
        paged_kv_indptr_buffer=torch.zeros(B + 1, dtype=torch.int32, device=device),
        paged_kv_indices_buffer=torch.zeros(n_pages, dtype=torch.int32, device=device),
        paged_kv_last_page_len_buffer=torch.zeros(B, dtype=torch.int32, device=device), backend="fa2")


def flashinfer_decode_timings(shape, batch: int, ctx: int, page_size: int = PAGE, dtype=torch.bfloat16,
                              fp8: bool = True, tensor_cores=(False, True), iters: int | None = None,
                              flush: torch.Tensor | None = None, device="cuda") -> dict:
    """FlashInfer paged decode at one point: shape (Hq, Hkv, D) or a MODELS name, `batch`
    requests of `ctx` tokens. Returns {variant: {"ms", "bytes", "graphed", "kv_dtype",
    "tensor_cores"}} for flashinfer (CUDA cores), flashinfer_tc (tensor cores) and, with fp8,
    flashinfer_fp8 (e4m3 K/V, CUDA cores); a variant that fails holds {"error": ...} instead;
    {"error": ...} alone when flashinfer does not import."""
    try:
        import flashinfer  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        return {"error": f"flashinfer not importable: {type(exc).__name__}: {exc}"}
    Hq, Hkv, D = MODELS[shape] if isinstance(shape, str) else shape
    dev = torch.device(device)
    flush = flush if flush is not None else _flush_buffer(dev)
    iters = iters or (10 if batch * ctx >= (1 << 20) else 20)
    q = torch.randn(batch, Hq, D, dtype=dtype, device=dev)
    workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
    out = {}
    variants = [("flashinfer" + ("_tc" if tc else ""), tc, dtype) for tc in tensor_cores]
    if fp8:
        variants.append(("flashinfer_fp8", False, torch.float8_e4m3fn))
    for name, tc, kv_dtype in variants:
        try:
            kv, indptr, indices, last = build_paged_kv(batch, ctx, Hkv, D, page_size, kv_dtype, dev)
            w = decode_wrapper(batch, indices.numel(), tc, dev, workspace)
            w.plan(indptr, indices, last, Hq, Hkv, D, page_size, q_data_type=dtype, kv_data_type=kv_dtype,
                   o_data_type=dtype)
            o = torch.empty_like(q)
            fn, graphed = _graphed(lambda: w.run(q, kv, out=o))
            ms = _median_ms(fn, flush, iters)
            kv_bytes = 2 * batch * ctx * Hkv * D * kv_dtype.itemsize
            out[name] = {"ms": ms, "bytes": kv_bytes + 2 * batch * Hq * D * dtype.itemsize, "graphed": graphed,
                         "kv_dtype": str(kv_dtype).replace("torch.", ""), "tensor_cores": tc}
            del kv, w, o
        except Exception as exc:  # noqa: BLE001 - a JIT build or a kernel that does not run
            out[name] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
            print(f"{name} {Hq}/{Hkv}/{D} B={batch} ctx={ctx}: {out[name]['error'][:300]}", flush=True)
        torch.cuda.empty_cache()
    return out


WARM_VARIANTS = {"cc": ((False,), False), "tc": ((True,), False), "fp8": ((), True)}  # tensor_cores, fp8


def warm_jit(dtype=torch.bfloat16, models=tuple(MODELS), variants=tuple(WARM_VARIANTS)) -> None:
    """Build (or load from $FLASHINFER_WORKSPACE_BASE/.cache/flashinfer) the modules of the
    sweep's variants (cc: CUDA-core decode, tc: tensor-core decode = the prefill module the
    flashinfer backend's extend uses too, fp8: e4m3-KV decode) on one tiny point per shape,
    printing each build's time. One process per (model, variant) builds them in parallel."""
    for m in models:
        for v in variants:
            tc, fp8 = WARM_VARIANTS[v]
            t = time.time()
            r = flashinfer_decode_timings(m, 1, 256, dtype=dtype, fp8=fp8, tensor_cores=tc, iters=1)
            print(f"JIT {m} {v}: {time.time() - t:.1f}s  " + ", ".join(
                f"{k}: {'ok' if 'ms' in x else x.get('error', '')[:1500]}" for k, x in r.items()
                if isinstance(x, dict)) + "".join(f"{k}: {x}" for k, x in r.items() if isinstance(x, str)),
                flush=True)


def run(args, on_row=None) -> dict:
    import flashinfer

    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    flush = _flush_buffer(dev)
    copy_bw = copy_bandwidth(flush)
    dtype = getattr(torch, args.dtype)
    print(f"device {props.name}  SMs {props.multi_processor_count}  copy {copy_bw/1e12:.2f} TB/s  "
          f"flashinfer {flashinfer.__version__}", flush=True)
    contexts = args.contexts or ([1024, 8192, 32768] if args.quick else [1024, 4096, 16384, 32768, 65536, 131072])
    batches = args.batches or ([1, 8] if args.quick else [1, 8, 32])
    models = {m: MODELS[m] for m in (args.models or MODELS)}
    rows = []

    def meta(partial):
        return {"benchmark": "decode attention, FlashInfer paged KV (baseline for attention.py)",
                "device": props.name, "sm_count": props.multi_processor_count, "torch": torch.__version__,
                "flashinfer": flashinfer.__version__, "commit": git_commit(),
                "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "quick": args.quick, "partial": partial,
                "params": {"page_size": PAGE, "dtype": args.dtype, "kernels": "FlashInfer FA2 (JIT), HND layout",
                           "timing": "CUDA graph replay, CUDA events, L2 flushed, median",
                           "bytes": "K/V read + q read + o written"},
                "copy_bandwidth_Bps": copy_bw, "results": rows}

    for model, shape in models.items():
        for B in batches:
            for ctx in contexts:
                if B * ctx > args.max_tokens:
                    continue
                res = {"model": model, "batch": B, "context": ctx, "Hq": shape[0], "Hkv": shape[1], "D": shape[2]}
                res.update(flashinfer_decode_timings(shape, B, ctx, PAGE, dtype, fp8=args.fp8, iters=args.iters,
                                                     flush=flush))
                for r in res.values():
                    if isinstance(r, dict) and "ms" in r:
                        r["GBps"] = r["bytes"] / (r["ms"] * 1e-3) / 1e9
                        r["pct_copy_bw"] = 100 * r["bytes"] / (r["ms"] * 1e-3) / copy_bw
                print(f"{model} B={B} ctx={ctx}: " + "  ".join(
                    f"{k}={v['ms']*1e3:.0f}us/{v['pct_copy_bw']:.0f}%" for k, v in res.items()
                    if isinstance(v, dict) and "ms" in v), flush=True)
                rows.append(res)
                if on_row is not None:
                    on_row(meta(True))
    return meta(False)


def plot(data: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = data["results"]
    models = sorted({r["model"] for r in rows})
    batches = sorted({r["batch"] for r in rows})
    names = ["flashinfer", "flashinfer_tc", "flashinfer_fp8"]
    fig, axes = plt.subplots(len(models), len(batches), figsize=(5 * len(batches), 4 * len(models)), squeeze=False)
    for i, m in enumerate(models):
        for j, b in enumerate(batches):
            ax = axes[i][j]
            sel = sorted((r for r in rows if r["model"] == m and r["batch"] == b), key=lambda r: r["context"])
            for n in names:
                pts = [(r["context"], r[n]["pct_copy_bw"]) for r in sel if "ms" in r.get(n, {})]
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=n)
            ax.set_xscale("log", base=2)
            ax.set_ylim(0, 100)
            ax.set_title(f"{m}, batch {b}")
            ax.set_xlabel("context (tokens)")
            ax.set_ylabel("% of copy bandwidth")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle(f"FlashInfer {data['flashinfer']} decode, {data['params']['dtype']}, {data['device']} @ "
                 f"{data['commit'][:10]} (copy {data['copy_bandwidth_Bps']/1e12:.2f} TB/s)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="3 contexts x batch 1, 8")
    ap.add_argument("--models", nargs="+", default=None, choices=list(MODELS), help="default: all")
    ap.add_argument("--contexts", type=int, nargs="+", default=None)
    ap.add_argument("--batches", type=int, nargs="+", default=None)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--no-fp8", dest="fp8", action="store_false", help="skip the e4m3 KV variant")
    ap.add_argument("--iters", type=int, default=None, help="timed calls per point (default 10-20)")
    ap.add_argument("--max-tokens", type=int, default=1 << 22, help="skip B*ctx above this")
    ap.add_argument("--out-dir", default=None, help="default benchmarks/results")
    ap.add_argument("--warm-jit", nargs="*", choices=list(WARM_VARIANTS), default=None,
                    help="only build the JIT modules of these variants (default all), then exit")
    ap.add_argument("--plot-only", default=None)
    args = ap.parse_args()
    if args.plot_only:
        with open(args.plot_only) as f:
            plot(json.load(f), args.plot_only.replace(".json", ".png"))
        return
    if not torch.cuda.is_available():
        ap.error("FlashInfer needs a CUDA device")
    if args.warm_jit is not None:
        warm_jit(getattr(torch, args.dtype), tuple(args.models or MODELS), tuple(args.warm_jit or WARM_VARIANTS))
        return
    name = "flashinfer_decode_" + torch.cuda.get_device_name().replace(" ", "_").replace("/", "_") + (
        "" if args.dtype == "bfloat16" else f"_{args.dtype}") + ("_quick" if args.quick else "")
    data = run(args, on_row=lambda d: write_json(name, d, args.out_dir))
    path = write_json(name, data, args.out_dir)
    print("wrote", path)
    try:
        plot(data, path.replace(".json", ".png"))
        print("wrote", path.replace(".json", ".png"))
    except Exception as exc:  # noqa: BLE001
        print("plot failed:", repr(exc))


if __name__ == "__main__":
    main()
