"""Host time per launch of the prefill path's kernels (CUDA): what a prefill step pays per layer
before the GPU sees any work.

For each op at a SmolLM2-135M prefill shape (T tokens), the host seconds per call over --calls
calls, unsynchronized (the GPU queues the work; no call here waits for it), median of --repeats:
aten ops for calibration (an in-place add, torch.empty, a linear), our Triton wrappers
(RMSNorm, SiLU*mul, RoPE + KV store, extend attention), and the bare `kernel[grid](...)` launch
of the RMSNorm kernel. With --cprofile, one more loop of RMSNorm launches under cProfile shows
where inside Triton's launcher the time goes.

    python benchmarks/kernels/launch_overhead.py --tokens 16384
    python benchmarks/kernels/launch_overhead.py --device cpu --tokens 64 --calls 2 --repeats 1   # CPU smoke run

On CPU (`--device cpu`, the default without CUDA) every Triton "launch" runs the kernel in
Triton's interpreter, so the numbers are the interpreter's run time: a check that the benchmark
runs, not a measurement.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common.report import RESULTS_DIR, device_name, git_commit, triton_interpreter_for, write_json  # noqa: E402


def per_call_us(fn, calls: int, repeats: int, device: str = "cuda") -> float:
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    fn()
    sync()
    samples = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - t) / calls * 1e6)
        sync()  # drain outside the timed loop
    return statistics.median(samples)


def build_ops(T: int, dev: str = "cuda"):
    from sgl_kvxfer.kernels import fused_rmsnorm as rn
    from sgl_kvxfer.kernels.extend_attention import extend_attention_tiered
    from sgl_kvxfer.kernels.fused_silu_mul import fused_silu_mul
    from sgl_kvxfer.kernels.paged_layout import TierPages, TieredBlockTables, TieredKVLayer, allocate_tiered_layer
    from sgl_kvxfer.kernels.rope_store import rope_store_kv
    from sgl_kvxfer.kernels.tier_codec import TIER_FP16

    dt = torch.bfloat16
    H, I, HQ, HKV, D, PAGE, B = 576, 1536, 9, 3, 64, 64, max(T // 320, 1)
    x = torch.randn(T, H, dtype=dt, device=dev)
    res = torch.randn_like(x)
    w = torch.randn(H, dtype=dt, device=dev)
    lin = torch.nn.Linear(H, (HQ + 2 * HKV) * D, bias=False, device=dev, dtype=dt)
    gu = torch.randn(T, 2 * I, dtype=dt, device=dev)
    qkv = torch.randn(T, (HQ + 2 * HKV) * D, dtype=dt, device=dev)
    cos = torch.randn(T, 1, D // 2, dtype=dt, device=dev)
    sin = torch.randn_like(cos)
    npages = T // PAGE + B + 2
    kp = torch.zeros(npages, HKV, PAGE, D, dtype=dt, device=dev)
    vp = torch.zeros_like(kp)
    slots = torch.arange(T, dtype=torch.int64, device=dev)
    empty = allocate_tiered_layer((1, 1, 1), PAGE, HKV, D, 32, dt, dev, fill=0.0)
    layer = TieredKVLayer((TierPages(TIER_FP16, kp, vp), empty[1], empty[2]), D, 32)
    per = T // B
    indptr = torch.arange(0, (B + 1) * per, per, dtype=torch.int32, device=dev)
    zeros_t = torch.zeros((B, 1), dtype=torch.int32, device=dev)
    zeros_l = torch.zeros(B, dtype=torch.int32, device=dev)
    tables = TieredBlockTables((zeros_t, zeros_t, zeros_t), (zeros_l, zeros_l, zeros_l))
    q = torch.randn(B * per, HQ, D, dtype=dt, device=dev)
    kn = torch.randn(B * per, HKV, D, dtype=dt, device=dev)
    vn = torch.randn_like(kn)
    kern = rn._fused_rmsnorm_kernel
    out = torch.empty_like(x)
    return {
        "aten add_ (calibration)": lambda: x.add_(0),
        "torch.empty": lambda: torch.empty((T, H), dtype=dt, device=dev),
        "nn.Linear qkv": lambda: lin(x),
        "fused_rmsnorm (wrapper)": lambda: rn.fused_rmsnorm(x, w, 1e-5, res),
        "rmsnorm kernel[grid] (bare launch)": lambda: kern[(T,)](
            x, res, w, out, out, x.stride(0), res.stride(0), out.stride(0), out.stride(0), H, 1e-5,
            HAS_RESIDUAL=True, BLOCK_H=1024, num_warps=4),
        "fused_silu_mul (wrapper)": lambda: fused_silu_mul(gu),
        "rope_store_kv (wrapper)": lambda: rope_store_kv(qkv, cos, sin, slots, kp, vp, HQ, HKV, return_kv=True),
        "extend_attention_tiered (wrapper)": lambda: extend_attention_tiered(
            q, kn, vn, indptr, layer, tables, max_extend_len=per, check=False),
    }, kern, (x, res, w, out, H)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--cprofile", action="store_true")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cpu: Triton's interpreter (a smoke run, not a measurement)")
    p.add_argument("--out-dir", default=RESULTS_DIR, help="where the JSON goes")
    args = p.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("no CUDA device: pass --device cpu (tiny shapes)")
    triton_interpreter_for(args.device)
    ops, kern, (x, res, w, out, H) = build_ops(args.tokens, args.device)
    rows = {}
    for name, fn in ops.items():
        rows[name] = per_call_us(fn, args.calls, args.repeats, args.device)
        print(f"{rows[name]:8.1f} us/call  {name}", flush=True)
    device = device_name(args.device)
    payload = {"benchmark": "launch_overhead", "device": device, "host_cpu": device_name("cpu"),
               "commit": git_commit(), "params": vars(args), "us_per_call": rows}
    if args.cprofile:
        import cProfile
        import io
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.calls):
            kern[(args.tokens,)](x, res, w, out, out, x.stride(0), res.stride(0), out.stride(0), out.stride(0),
                                 H, 1e-5, HAS_RESIDUAL=True, BLOCK_H=1024, num_warps=4)
        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(15)
        payload["cprofile_bare_launch"] = text.getvalue()
        print(text.getvalue())
    print("wrote", write_json("launch_overhead_" + device.split(" (")[0].replace(" ", "_"), payload, args.out_dir))


if __name__ == "__main__":
    main()
