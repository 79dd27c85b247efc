"""Decode-layer linears with their RMSNorm (and SwiGLU) fused in, vs the unfused kernels, under
CUDA graphs (CUDA only).

Per decode layer the model runs two norm-led linears:
    unfused: rmsnorm(+res) -> qkv GEMM          rmsnorm(+res) -> gate_up GEMM -> silu_mul   (5 kernels)
    fused:   norm_linear(qkv)                   norm_linear(gate_up, swiglu)                 (2 kernels)
For each model shape and batch size M, the sequence for all L layers (distinct weights, so they
stream from HBM as in the model) is captured in one CUDA graph and replayed; the result is
microseconds per layer, kernel gaps included. The fused kernel runs at its default config
(`kernels/fused_norm_linear.default_config`) and at every config of a sweep; the JSON keeps the
best per (shape, M, op) so the default table can be checked against it.

    python benchmarks/kernels/norm_linear.py                     # SmolLM2 and Llama-3-8B shapes
    python benchmarks/kernels/norm_linear.py --shapes smollm2 --batches 64 256 --no-sweep
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common.report import RESULTS_DIR, device_name, git_commit, write_json  # noqa: E402

SHAPES = {  # hidden K, qkv rows, intermediate, layers
    "smollm2": (576, 960, 1536, 30),
    "llama8b": (4096, 6144, 14336, 32),
}


def sweep_configs(M: int):
    from sgl_kvxfer.kernels.fused_norm_linear import NormLinearConfig

    top_m = max(16, 1 << (max(M, 1) - 1).bit_length())
    for bm, bn, bk, stages in itertools.product((16, 32, 64, 128), (32, 64, 128), (64, 128), (2, 3)):
        if bm > top_m:
            continue
        for warps in ((4, 8) if bn * bm >= 64 * 64 else (4,)):
            yield NormLinearConfig(bm, bn, bk, warps, stages)


def graphed_us_per_layer(fn, layers: int, replays: int) -> float:
    """Capture fn(l) for every layer l in one graph; median-free mean over `replays` replays."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for l in range(layers):  # warm-up: JIT and cuBLAS handles outside the capture
            fn(l)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for l in range(layers):
            fn(l)
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / replays / layers


def bench_shape(name: str, batches, sweep: bool, replays: int, dtype) -> list[dict]:
    from sgl_kvxfer.kernels.fused_norm_linear import default_config, fused_norm_linear
    from sgl_kvxfer.kernels.fused_rmsnorm import fused_rmsnorm
    from sgl_kvxfer.kernels.fused_silu_mul import fused_silu_mul

    K, n_qkv, inter, L = SHAPES[name]
    dev = "cuda"
    w_qkv = [torch.randn(n_qkv, K, device=dev, dtype=dtype) * K**-0.5 for _ in range(L)]
    w_gu = [torch.randn(2 * inter, K, device=dev, dtype=dtype) * K**-0.5 for _ in range(L)]
    nw = torch.ones(K, device=dev, dtype=dtype)
    rows = []
    for M in batches:
        x = torch.randn(M, K, device=dev, dtype=dtype)
        res = torch.randn_like(x)
        ops = {"qkv": (w_qkv, False), "gate_up": (w_gu, True)}
        for op, (ws, swiglu) in ops.items():
            def unfused(l, ws=ws, swiglu=swiglu):
                h, _ = fused_rmsnorm(x, nw, 1e-5, res)
                y = F.linear(h, ws[l])
                return fused_silu_mul(y) if swiglu else y

            def fused(l, cfg=None, ws=ws, swiglu=swiglu):
                return fused_norm_linear(x, nw, 1e-5, ws[l], None, res, swiglu=swiglu, config=cfg)

            row = {"shape": name, "M": M, "op": op,
                   "unfused_us": graphed_us_per_layer(unfused, L, replays),
                   "fused_default_us": graphed_us_per_layer(fused, L, replays),
                   "default_config": vars(default_config(M, ws[0].shape[0] // (2 if swiglu else 1), K, swiglu))}
            if sweep:
                best = None
                for cfg in sweep_configs(M):
                    try:
                        us = graphed_us_per_layer(lambda l, cfg=cfg: fused(l, cfg), L, replays)
                    except Exception as e:  # noqa: BLE001  (out of shared memory / registers)
                        print(f"  skip {cfg}: {type(e).__name__}", flush=True)
                        continue
                    if best is None or us < best[0]:
                        best = (us, cfg)
                row["best_us"], row["best_config"] = best[0], vars(best[1])
            print(f"{name:8s} M={M:4d} {op:8s} unfused {row['unfused_us']:7.2f} us  fused(default) "
                  f"{row['fused_default_us']:7.2f} us" + (f"  best {row['best_us']:7.2f} us {row['best_config']}"
                                                          if sweep else ""), flush=True)
            rows.append(row)
    return rows


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = sorted({r["shape"] for r in rows})
    fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 4), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        for op, style in (("qkv", "-"), ("gate_up", "--")):
            sel = [r for r in rows if r["shape"] == shape and r["op"] == op]
            ms = [r["M"] for r in sel]
            ax.plot(ms, [r["unfused_us"] for r in sel], "o" + style, color="tab:gray", label=f"{op} unfused")
            ax.plot(ms, [r["fused_default_us"] for r in sel], "o" + style, color="tab:blue", label=f"{op} fused")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch rows M")
        ax.set_ylabel("us per layer (graphed)")
        ax.set_title(shape)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32, 64, 128, 256])
    p.add_argument("--no-sweep", action="store_true", help="time only the default config")
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--out-dir", default=RESULTS_DIR)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("norm_linear.py needs CUDA")
    rows = []
    for shape in args.shapes:
        rows += bench_shape(shape, args.batches, not args.no_sweep, args.replays, torch.bfloat16)
    name = "norm_linear_" + device_name("cuda").replace(" ", "_")
    payload = {"benchmark": "norm_linear", "device": device_name("cuda"), "commit": git_commit(),
               "params": vars(args), "dtype": "bfloat16", "rows": rows}
    print("wrote", write_json(name, payload, args.out_dir))
    plot(rows, os.path.join(args.out_dir, name + ".png"))


if __name__ == "__main__":
    main()
