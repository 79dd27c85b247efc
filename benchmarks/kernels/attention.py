"""Decode attention over the tiered paged KV vs torch SDPA (flash) on dense fp16 KV.

    python benchmarks/kernels/attention.py [--quick] [--out-dir benchmarks/results]
    python benchmarks/kernels/attention.py --plot-only benchmarks/results/attention_<dev>.json
    python benchmarks/kernels/attention.py --device cpu --models smollm2 --contexts 128 \
        --batches 1 --iters 1                                         # CPU smoke run

On CPU (`--device cpu`, the default without CUDA) the kernels run in Triton's interpreter and
are timed with perf_counter, eagerly: that checks that the benchmark runs end to end, and its
times say nothing about the kernels.

One layer, one decode step, every request of the batch at the same context length.
Variants: sdpa_fp16 (baseline, dense [B, Hkv, ctx, D], enable_gqa), paged_fp16 (our kernel,
all tokens fp16), int8, int4 (all tokens), mix_b0.5 = 20% fp16 / 40% int8 / 40% int4 (a
3-tier mix of budget 0.5; the paper's greedy map gives all-int8 there, which `int8` already
covers), mix_b0.3 = greedy map (Eq. 14): 0% / 20% / 80%.

Time: CUDA events around each call, L2 flushed before each, median of N. Bytes = bytes the
kernel must read (K+V payload incl. fp16 scales/zeros, q) + bytes written (o); bandwidth =
bytes / time, compared with a device-to-device copy measured in the same run, counted the
same way (read + write bytes / time).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common.report import device_name, git_commit, triton_interpreter_for, write_json  # noqa: E402

MODELS = {"llama3-8b": (32, 8, 128), "smollm2": (9, 3, 64)}
PAGE = 64
GROUP = 32
VARIANTS = {  # name -> (f16, f8, f4) token fractions
    "paged_fp16": (1.0, 0.0, 0.0),
    "int8": (0.0, 1.0, 0.0),
    "int4": (0.0, 0.0, 1.0),
    "mix_b0.5": (0.2, 0.4, 0.4),
    "mix_b0.3": (0.0, 0.2, 0.8),
}
FLASHINFER_NOTE = ("not attempted: flashinfer is not installed on the device image; its JIT "
                   "needs carried wheels + nvcc 13.0 builds that do not fit this issue's "
                   "device-time budget (12 min for tests + benchmark)")


def _split_counts(ctx: int, fr) -> tuple:
    n16 = int(round(ctx * fr[0]))
    n8 = int(round(ctx * fr[1]))
    return (n16, n8, ctx - n16 - n8)


def _graphed(fn, cuda: bool = True):
    """Capture fn in a CUDA graph (decode runs graphed in serving; this also keeps Python
    launch overhead out of the small-context timings). Falls back to eager (and is eager
    without CUDA)."""
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
    """Median ms of fn with `flush` (a buffer as large as the cache) zeroed before each call:
    CUDA events on a CUDA flush buffer, else perf_counter."""
    cuda = flush.is_cuda
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(iters):
        flush.zero_()
        if cuda:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            ts.append(s.elapsed_time(e))
        else:
            t = time.perf_counter()
            fn()
            ts.append(1e3 * (time.perf_counter() - t))
    ts.sort()
    return ts[len(ts) // 2]


def copy_bandwidth(flush, nbytes: int = 1 << 30) -> float:
    """Device-to-device copy rate, read + write bytes per second (1 GiB each way by default)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=flush.device)
    b = torch.empty_like(a)
    ms = _median_ms(lambda: b.copy_(a), flush, 10)
    del a, b
    return 2 * nbytes / (ms * 1e-3)


def free_memory(dev: torch.device) -> int:
    if dev.type == "cuda":
        return torch.cuda.mem_get_info(dev)[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def build_layer(B, ctx, Hkv, D, fr, device):
    from sgl_kvxfer.kernels.paged_layout import TieredBlockTables, allocate_tiered_layer
    from sgl_kvxfer.kernels.testing import fill_random_pools

    counts = _split_counts(ctx, fr)
    npg = [math.ceil(c / PAGE) for c in counts]
    layer = allocate_tiered_layer(tuple(max(1, B * n) for n in npg), PAGE, Hkv, D, GROUP,
                                  torch.float16, device)
    fill_random_pools(layer)
    tables = []
    for t in range(3):
        perm = torch.randperm(max(1, B * npg[t]), device=device).to(torch.int32)
        tables.append(perm[:B * npg[t]].view(B, npg[t]) if npg[t] else
                      torch.zeros(B, 1, dtype=torch.int32, device=device))
    lens = tuple(torch.full((B,), c, dtype=torch.int32, device=device) for c in counts)
    return layer, TieredBlockTables(tuple(tables), lens), counts


def kernel_bytes(B, Hq, Hkv, D, counts) -> int:
    from sgl_kvxfer.kernels.tier_codec import payload_bytes

    kv = sum(c * payload_bytes(t, D, GROUP) for t, c in enumerate(counts)) * 2 * Hkv * B
    return kv + 2 * B * Hq * D * 2  # + q read + o written


def run(args, on_row=None) -> dict:
    import torch.nn.functional as F

    from sgl_kvxfer.kernels.decode_attention import decode_attention_tiered

    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    props = torch.cuda.get_device_properties(dev) if cuda else None
    dev_name, sms = (props.name, props.multi_processor_count) if cuda else (device_name("cpu"), None)
    free_bytes = free_memory(dev)
    flush = torch.empty((256 if cuda else 8) << 20, dtype=torch.uint8, device=dev)
    copy_bw = copy_bandwidth(flush, (1 << 30) if cuda else (64 << 20))
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    print(f"device {dev_name}  SMs {sms}  copy {copy_bw/1e12:.2f} TB/s", flush=True)
    contexts = args.contexts or ([1024, 8192, 32768] if args.quick else [1024, 4096, 16384, 32768, 65536, 131072])
    batches = args.batches or ([1, 8] if args.quick else [1, 8, 32])
    models = {m: MODELS[m] for m in (args.models or MODELS)}
    rows = []
    sdpa_note = "flash backend, enable_gqa=True"
    for model, (Hq, Hkv, D) in models.items():
        # autotune keys on the head shape only: tune once on a representative long decode
        layer, tables, _ = build_layer(1, min(32768, max(contexts)), Hkv, D, VARIANTS["mix_b0.5"], dev)
        t0 = time.time()
        decode_attention_tiered(torch.randn(1, Hq, D, dtype=torch.float16, device=dev), layer, tables)
        sync()
        print(f"{model}: autotune {time.time() - t0:.1f}s", flush=True)
        del layer, tables
        for B in batches:
            for ctx in contexts:
                dense_bytes = 2 * B * Hkv * ctx * D * 2
                if 2.5 * dense_bytes > 0.8 * free_bytes or B * ctx > args.max_tokens:
                    print(f"skip {model} B={B} ctx={ctx}: memory", flush=True)
                    continue
                iters = args.iters or (10 if B * ctx >= (1 << 20) else 20)
                q = torch.randn(B, Hq, D, dtype=torch.float16, device=dev)
                res = {"model": model, "batch": B, "context": ctx, "Hq": Hq, "Hkv": Hkv, "D": D}
                # ---- baseline: SDPA flash on dense fp16 KV
                k = torch.randn(B, Hkv, ctx, D, dtype=torch.float16, device=dev)
                v = torch.randn_like(k)
                q4 = q.unsqueeze(2)
                from torch.nn.attention import SDPBackend, sdpa_kernel

                for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                                SDPBackend.EFFICIENT_ATTENTION) + (() if cuda else (SDPBackend.MATH,)):
                    def sdpa(backend=backend):
                        with sdpa_kernel(backend):
                            return F.scaled_dot_product_attention(q4, k, v, enable_gqa=True)
                    try:
                        sdpa()
                        fn, graphed = _graphed(sdpa, cuda)
                        t = _median_ms(fn, flush, iters)
                        res["sdpa_fp16"] = {"ms": t, "bytes": dense_bytes + 4 * B * Hq * D,
                                            "backend": str(backend), "graphed": graphed}
                        sdpa_note = f"{backend}, enable_gqa=True, dense [B, Hkv, ctx, D] fp16"
                        break
                    except Exception as exc:  # noqa: BLE001
                        sdpa_note = f"{backend} failed: {exc!r}"[:300]
                        print(sdpa_note, flush=True)
                del k, v
                if cuda:
                    torch.cuda.empty_cache()
                # ---- our kernel, each tier mix
                for variant, fr in VARIANTS.items():
                    layer, tables, counts = build_layer(B, ctx, Hkv, D, fr, dev)
                    fn, graphed = _graphed(lambda: decode_attention_tiered(q, layer, tables), cuda)
                    t = _median_ms(fn, flush, iters, warmup=3 if cuda else 1)
                    res[variant] = {"ms": t, "bytes": kernel_bytes(B, Hq, Hkv, D, counts),
                                    "counts": counts, "graphed": graphed}
                    del layer, tables
                    if cuda:
                        torch.cuda.empty_cache()
                for name in ["sdpa_fp16", *VARIANTS]:
                    if name in res:
                        r = res[name]
                        r["GBps"] = r["bytes"] / (r["ms"] * 1e-3) / 1e9
                        r["pct_copy_bw"] = 100 * r["bytes"] / (r["ms"] * 1e-3) / copy_bw
                        if "sdpa_fp16" in res:
                            r["speedup_vs_sdpa"] = res["sdpa_fp16"]["ms"] / r["ms"]
                line = "  ".join(
                    f"{n}={res[n]['ms']*1e3:.0f}us/{res[n]['pct_copy_bw']:.0f}%"
                    for n in ["sdpa_fp16", *VARIANTS] if n in res)
                print(f"{model} B={B} ctx={ctx}: {line}", flush=True)
                rows.append(res)
                if on_row is not None:
                    on_row(meta(dev_name, sms, copy_bw, sdpa_note, rows, args.quick, partial=True))
                del q
    out = meta(dev_name, sms, copy_bw, sdpa_note, rows, args.quick)
    if args.ablation:
        out["ablation"] = ablation(flush, copy_bw)
    return out


def ablation(flush, copy_bw) -> list:
    """Quantized-tier knobs of decode_attention_tiered: prefetch, fast dequant, split waves."""
    from sgl_kvxfer.kernels.decode_attention import decode_attention_tiered

    dev = torch.device("cuda")
    out = []
    for model, B, ctx in (("llama3-8b", 1, 32768), ("llama3-8b", 8, 32768), ("smollm2", 8, 32768)):
        Hq, Hkv, D = MODELS[model]
        q = torch.randn(B, Hq, D, dtype=torch.float16, device=dev)
        for name in ("int8", "int4"):
            layer, tables, counts = build_layer(B, ctx, Hkv, D, VARIANTS[name], dev)
            nbytes = kernel_bytes(B, Hq, Hkv, D, counts)
            exact = decode_attention_tiered(q, layer, tables, prefetch=False, fast_dequant=False)
            for prefetch, fast, waves in ((False, False, 4), (True, False, 4), (False, True, 4),
                                          (True, True, 4), (True, True, 8), (False, True, 8)):
                knobs = dict(prefetch=prefetch, fast_dequant=fast, split_waves=waves)
                diff = (decode_attention_tiered(q, layer, tables, **knobs).float()
                        - exact.float()).abs().max().item()
                fn, _ = _graphed(lambda: decode_attention_tiered(q, layer, tables, **knobs))
                t = _median_ms(fn, flush, 10)
                r = {"model": model, "batch": B, "context": ctx, "variant": name, **knobs,
                     "ms": t, "pct_copy_bw": 100 * nbytes / (t * 1e-3) / copy_bw,
                     "max_abs_diff_vs_exact_path": diff}
                print("ablation", r, flush=True)
                out.append(r)
            del layer, tables
            torch.cuda.empty_cache()
    return out


def meta(device: str, sm_count, copy_bw, sdpa_note, rows, quick, partial=False) -> dict:
    return {
        "benchmark": "decode attention, tiered paged KV vs SDPA",
        "device": device, "sm_count": sm_count,
        "torch": torch.__version__, "triton": __import__("triton").__version__,
        "commit": git_commit(), "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "quick": quick, "partial": partial,
        "params": {"page_size": PAGE, "group_size": GROUP, "dtype": "float16",
                   "variants": VARIANTS, "timing": "CUDA graph replay, CUDA events, L2 flushed, median",
                   "bytes": "KV payload incl. scales/zeros + q + o",
                   "decode_defaults": "prefetch=True, fast_dequant=True, split_waves=4"},
        "copy_bandwidth_Bps": copy_bw,
        "sdpa": sdpa_note,
        "flashinfer": FLASHINFER_NOTE,
        "results": rows,
    }


def plot(data: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = data["results"]
    models = sorted({r["model"] for r in rows})
    batches = sorted({r["batch"] for r in rows})
    names = ["sdpa_fp16", *VARIANTS]
    fig, axes = plt.subplots(len(models), len(batches), figsize=(5 * len(batches), 4 * len(models)),
                             squeeze=False)
    for i, m in enumerate(models):
        for j, b in enumerate(batches):
            ax = axes[i][j]
            sel = sorted((r for r in rows if r["model"] == m and r["batch"] == b),
                         key=lambda r: r["context"])
            for n in names:
                pts = [(r["context"], r[n]["ms"] * 1e3) for r in sel if n in r]
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=n, ls="--" if n == "sdpa_fp16" else "-")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{m}, batch {b}")
            ax.set_xlabel("context (tokens)")
            ax.set_ylabel("decode attention time (us)")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle(f"{data['device']} @ {data['commit'][:10]}  (copy {data['copy_bandwidth_Bps']/1e12:.2f} TB/s)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="3 contexts x batch 1, 8")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="cpu: Triton's interpreter, perf_counter timing (a smoke run, not a measurement)")
    ap.add_argument("--models", nargs="+", default=None, choices=list(MODELS), help="default: all")
    ap.add_argument("--contexts", type=int, nargs="+", default=None, help="default: by --quick")
    ap.add_argument("--batches", type=int, nargs="+", default=None, help="default: by --quick")
    ap.add_argument("--iters", type=int, default=None, help="timed calls per point (default 10-20)")
    ap.add_argument("--out-dir", default=None, help="where the JSON and PNG go (default benchmarks/results)")
    ap.add_argument("--max-tokens", type=int, default=1 << 22, help="skip B*ctx above this")
    ap.add_argument("--plot-only", default=None, help="re-plot an existing JSON")
    ap.add_argument("--ablation", action="store_true", help="also sweep prefetch / split waves")
    args = ap.parse_args()
    if args.plot_only:
        with open(args.plot_only) as f:
            data = json.load(f)
        plot(data, args.plot_only.replace(".json", ".png"))
        return
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error("no CUDA device: pass --device cpu (tiny shapes)")
    if args.ablation and not args.device.startswith("cuda"):
        ap.error("--ablation needs CUDA")
    triton_interpreter_for(args.device)
    cuda_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else device_name("cpu").split(" (")[0]
    name = f"attention_{cuda_name.replace(' ', '_').replace('/', '_')}{'_quick' if args.quick else ''}"

    def dump(d):
        return write_json(name, d, args.out_dir)

    data = run(args, on_row=dump)
    path = dump(data)
    print("wrote", path)
    try:
        plot(data, path.replace(".json", ".png"))
        print("wrote", path.replace(".json", ".png"))
    except Exception as exc:  # noqa: BLE001
        print("plot failed:", repr(exc))


if __name__ == "__main__":
    main()
