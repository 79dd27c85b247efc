"""The decode step's dense matmuls at serving batch sizes: time and read rate of each.

A decode step at small batch reads every weight once, so its dense part is memory-bound: each
projection of a layer (qkv_proj, o_proj, gate_up_proj, down_proj: the engine's fused shapes,
sgl_kvxfer/models/llama.py) and lm_head, at M rows (the batch), timed in CUDA graphs over enough
weight copies to keep them out of L2 (common/bandwidth.time_rotating). Per matmul and M:

    bytes = W (N x K) + x (M x K) + y (M x N), in the model dtype; GB/s = bytes / median time;
    of_copy = GB/s over a device-to-device copy's rate measured in the same run

and per M the whole dense step: layers x (the four projections) + lm_head, summed, against the
same bytes at the copy rate (`dense_step`). Variants, each on the same weights:

    linear   x @ W.T with W [N, K] row-major (the engine's nn.Linear product; torch.matmul with
             out=, so the graph allocates nothing)
    kn       x @ Wt with Wt [K, N] row-major (the transposed storage: another cuBLAS kernel)
    skinny   kernels/skinny_linear.py on W [N, K] (M <= 16 only): the launch of
             `default_config`, or with --skinny-configs each listed launch timed and the fastest
             kept (its row lists every launch's time under `sweep`)
    copy     a device copy moving W's bytes (half read, half written; M does not apply): the
             time a kernel of that size takes with no arithmetic, the floor for that projection

    python benchmarks/kernels/dense_linear.py --preset llama-3-8b --batches 1 8 32    # GPU
    python benchmarks/kernels/dense_linear.py --device cpu --preset tiny --batches 2  # CPU smoke run
    python benchmarks/kernels/dense_linear.py --batches 1 8 16 --variants linear skinny \
        --skinny-configs '[{"block_n": 32, "block_k": 256, "num_stages": 4, "num_warps": 4}, ...]'
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common.bandwidth import copy_bandwidth_Bps, rotation_copies, time_rotating  # noqa: E402
from common.report import device_name, triton_interpreter_for, write_json  # noqa: E402

VARIANTS = ("linear", "kn", "skinny", "copy")
DEFAULT_VARIANTS = ("linear", "kn")  # skinny when asked: under the CPU interpreter it is slow


def projections(preset: str) -> dict[str, tuple[int, int]]:
    """{name: (N, K)} of the engine's fused matmuls of one layer, and lm_head."""
    from sgl_kvxfer.models.presets import PRESETS

    c = PRESETS[preset]
    d = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    h, q, kv = c["hidden_size"], c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    return {"qkv_proj": (q + 2 * kv, h), "o_proj": (h, q), "gate_up_proj": (2 * c["intermediate_size"], h),
            "down_proj": (h, c["intermediate_size"]), "lm_head": (c["vocab_size"], h)}


def time_matmul(variant: str, n: int, k: int, m: int, dtype: torch.dtype, device: torch.device,
                iters: int, max_bytes: int, skinny_config=None) -> dict:
    esize = torch.finfo(dtype).bits // 8
    w_bytes = n * k * esize
    copies = rotation_copies(w_bytes, device, max_bytes)
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(m, k, dtype=dtype, device=device, generator=g)
    shape = (k, n) if variant == "kn" else (n, k)
    ws = [torch.randn(*shape, dtype=dtype, device=device, generator=g) * 0.02 for _ in range(copies)]
    outs = [torch.empty(m, n, dtype=dtype, device=device) for _ in range(copies)]
    if variant == "linear":
        calls = [lambda w=w, o=o: torch.matmul(x, w.t(), out=o) for w, o in zip(ws, outs)]
        ref = F.linear(x.float(), ws[0].float())
    elif variant == "skinny":
        from sgl_kvxfer.kernels.skinny_linear import skinny_linear

        calls = [lambda w=w, o=o: skinny_linear(x, w, config=skinny_config, out=o) for w, o in zip(ws, outs)]
        ref = F.linear(x.float(), ws[0].float())
    else:
        calls = [lambda w=w, o=o: torch.matmul(x, w, out=o) for w, o in zip(ws, outs)]
        ref = x.float() @ ws[0].float()
    t = time_rotating(calls, device, iters)
    err = (outs[0].float() - ref).abs().max().item() / max(ref.abs().max().item(), 1e-6)
    nbytes = w_bytes + (m * k + m * n) * esize
    del ws, outs
    return {**t, "bytes": nbytes, "Bps": nbytes / (t["ms"] * 1e-3), "rel_err": err}


def time_copy(n: int, k: int, dtype: torch.dtype, device: torch.device, iters: int, max_bytes: int) -> dict:
    """A device copy that moves W's bytes (reads half of them, writes the other half), timed the
    same way as the matmuls: what a kernel of that size costs with no arithmetic at all."""
    esize = torch.finfo(dtype).bits // 8
    half = n * k // 2
    copies = rotation_copies(2 * half * esize, device, max_bytes)
    srcs = [torch.empty(half, dtype=dtype, device=device).fill_(i) for i in range(copies)]
    dsts = [torch.empty(half, dtype=dtype, device=device) for _ in range(copies)]
    t = time_rotating([lambda s=s, d=d: d.copy_(s) for s, d in zip(srcs, dsts)], device, iters)
    nbytes = 2 * half * esize
    del srcs, dsts
    return {**t, "bytes": nbytes, "Bps": nbytes / (t["ms"] * 1e-3), "rel_err": 0.0}


def time_variant(variant: str, n: int, k: int, m: int, dtype: torch.dtype, device: torch.device, iters: int,
                 max_bytes: int, skinny_configs: list | None) -> dict:
    """time_matmul, and for the skinny variant with configs: each launch timed, the fastest's
    row returned with every launch's time under `sweep` (and its launch under `config`)."""
    if variant == "copy":
        return time_copy(n, k, dtype, device, iters, max_bytes)
    if variant != "skinny":
        return time_matmul(variant, n, k, m, dtype, device, iters, max_bytes)
    from sgl_kvxfer.kernels.skinny_linear import default_config

    configs = skinny_configs or [default_config(n, k)]
    sweep, best = [], None
    for c in configs:
        try:
            r = time_matmul(variant, n, k, m, dtype, device, iters, max_bytes, skinny_config=c)
        except Exception as e:  # a launch the GPU cannot hold (shared memory): listed, not fatal
            if len(configs) == 1 or "OutOfResources" not in type(e).__name__:
                raise
            sweep.append({**dataclasses.asdict(c), "skipped": f"{type(e).__name__}: {e}"[:200]})
            torch.cuda.empty_cache()
            continue
        sweep.append({**dataclasses.asdict(c), "ms": r["ms"], "ms_min": r["ms_min"], "ms_max": r["ms_max"],
                      "rel_err": r["rel_err"]})
        r["config"] = dataclasses.asdict(c)
        if best is None or r["ms"] < best["ms"]:
            best = r
    if len(sweep) > 1:
        best["sweep"] = sweep
    return best


def plot(payload: dict, path: str) -> None:
    """Per variant: each matmul's share of the copy rate over M, and the dense step's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = list(dict.fromkeys(r["variant"] for r in payload["rows"]))
    fig, axes = plt.subplots(1, len(variants), figsize=(5 * len(variants), 3.8), squeeze=False)
    for ax, v in zip(axes[0], variants):
        for name in dict.fromkeys(r["matmul"] for r in payload["rows"]):
            pts = [(r["m"], r["of_copy"]) for r in payload["rows"] if r["variant"] == v and r["matmul"] == name]
            ax.plot(*zip(*pts), marker="o", label=name)
        pts = [(s["m"], s["of_copy"]) for s in payload["dense_step"] if s["variant"] == v]
        ax.plot(*zip(*pts), marker="s", color="black", lw=2, label="dense step")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("M (batch rows)")
        ax.set_ylabel("read rate / copy rate")
        ax.set_title(v, fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"{payload['device']} @ {str(payload['commit'])[:10]}, {payload['params']['preset']}, copy "
                 f"{payload['copy_bandwidth_Bps'] / 1e12:.2f} TB/s", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="llama-3-8b")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS), choices=VARIANTS)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--max-gib", type=float, default=8.0, help="most GiB of weight copies a matmul rotates over")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--name", default=None)
    p.add_argument("--skinny-configs", default=None,
                   help="JSON list of SkinnyConfig fields, or a file holding one: the skinny variant times "
                        "each launch and keeps the fastest")
    p.add_argument("--out-dir", default=None)
    args = p.parse_args(argv)
    if args.iters < 5:
        p.error("--iters >= 5 (the spread needs repeats)")
    from sgl_kvxfer.models.presets import PRESETS

    triton_interpreter_for(args.device)  # before the kernel module is imported
    from sgl_kvxfer.kernels.skinny_linear import MAX_ROWS, SkinnyConfig

    try:
        text = args.skinny_configs
        if text and not text.lstrip().startswith("["):
            with open(text) as f:
                text = f.read()
        skinny_configs = [SkinnyConfig(**c) for c in json.loads(text)] if text else None
    except (OSError, ValueError, TypeError) as e:
        p.error(f"--skinny-configs: a JSON list of SkinnyConfig fields ({e})")
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    layers = PRESETS[args.preset]["num_hidden_layers"]
    copy_bps = copy_bandwidth_Bps(device)
    print(f"{device_name(args.device)}: copy {copy_bps / 1e9:.1f} GB/s", flush=True)
    rows, steps = [], []
    for m in args.batches:
        for variant in args.variants:
            step_s, step_bytes = 0.0, 0
            for name, (n, k) in projections(args.preset).items():
                if variant == "skinny" and m > MAX_ROWS:  # the kernel's rows: one BLOCK_M tile
                    continue
                r = time_variant(variant, n, k, m, dtype, device, args.iters, int(args.max_gib * 2**30),
                                 skinny_configs)
                r.update(matmul=name, n=n, k=k, m=m, variant=variant, of_copy=r["Bps"] / copy_bps)
                rows.append(r)
                times = 1 if name == "lm_head" else layers
                step_s += times * r["ms"] * 1e-3
                step_bytes += times * r["bytes"]
                print(f"M {m:3d} {variant:6s} {name:13s} [{n} x {k}]: {r['ms'] * 1e3:8.1f} us "
                      f"[{r['ms_min'] * 1e3:.1f}-{r['ms_max'] * 1e3:.1f}], {r['Bps'] / 1e9:7.1f} GB/s, "
                      f"{r['of_copy']:.0%} of copy", flush=True)
            if not step_bytes:
                continue
            steps.append({"m": m, "variant": variant, "dense_s": step_s, "bytes": step_bytes,
                          "roofline_s": step_bytes / copy_bps, "of_copy": step_bytes / copy_bps / step_s})
            print(f"M {m:3d} {variant:6s} dense step: {step_s * 1e3:.3f} ms against {step_bytes / copy_bps * 1e3:.3f} "
                  f"ms at the copy rate ({steps[-1]['of_copy']:.0%})", flush=True)
    name = args.name or f"dense_linear_{args.preset}_{device_name(args.device).replace(' ', '_')}"
    payload = {"benchmark": "dense_linear", "device": device_name(args.device), "torch": torch.__version__,
               "params": vars(args), "copy_bandwidth_Bps": copy_bps, "rows": rows, "dense_step": steps}
    path = write_json(name, payload, args.out_dir)
    with open(path) as f:
        plot(json.load(f), path[:-5] + ".png")
    print("wrote", path, "and its .png")
    return path


if __name__ == "__main__":
    main()
