"""Decode attention at serving shapes, as CUDA-graph decode runs it: which launch plan is fastest.

    python benchmarks/kernels/decode_plan.py [--batch 256 --ctx-min 160 --ctx-max 640]
    python benchmarks/kernels/decode_plan.py --device cpu --batch 2 --ctx-min 16 --ctx-max 64 \
        --max-seq 128 --splits 1 2 --configs 4:1 --iters 1             # CPU smoke run

One layer of SmolLM2-135M heads (9 q / 3 kv, head_dim 64) by default, bf16, page 64, every
request at its own length (uniform in [ctx-min, ctx-max]; the offline benchmark's prompts plus
half its output), block tables as wide as the whole context (the graph plan's fixed width) and
even splits, through the paged fp16 pool's decode (kernels/paged_fp16_pool_decode.py). Swept:
splits per request (S16), pages per loop step, request order and launch configs (warps:stages,
--configs; default the kernel's own). Time: CUDA events around a graphed call,
L2 flushed before each, median of --iters; bandwidth = K/V bytes read / time, against a
device-to-device copy measured in the same run. On CPU (`--device cpu`, the default without
CUDA) the kernel runs in Triton's interpreter, eagerly, timed with perf_counter: a check that
the benchmark runs, not a measurement.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common.bandwidth import copy_bandwidth_Bps, time_rotating  # noqa: E402
from common.report import RESULTS_DIR, device_name, git_commit, triton_interpreter_for, write_json  # noqa: E402

def build(args, dev):
    """K/V pages [pages + 1, Hkv, PAGE, D] (page 0 unused), a table of the graph plan's width and
    the requests' lengths."""
    B, P, Hkv, D = args.batch, args.page, args.kv_heads, args.head_dim
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(args.ctx_min, args.ctx_max + 1, (B,), generator=g)
    need = [math.ceil(int(n) / P) for n in lens]
    width = math.ceil(args.max_seq / P)
    k = torch.randn(sum(need) + 1, Hkv, P, D, generator=g).to(torch.bfloat16).to(dev)
    v = torch.randn(sum(need) + 1, Hkv, P, D, generator=g).to(torch.bfloat16).to(dev)
    perm = torch.randperm(sum(need), generator=g) + 1
    table = torch.zeros(B, width, dtype=torch.int32)
    at = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[at : at + n]
        at += n
    return k, v, table.to(dev), lens.to(torch.int32).to(dev), int(lens.sum())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--ctx-min", type=int, default=160)
    p.add_argument("--ctx-max", type=int, default=640)
    p.add_argument("--q-heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--page", type=int, default=64)
    p.add_argument("--max-seq", type=int, default=8192)
    p.add_argument("--splits", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--pages-per-iter", type=int, nargs="+", default=[1],
                   help="fp16 pages per kernel loop step to sweep")
    p.add_argument("--order", nargs="+", default=["none"], choices=["none", "longest"],
                   help="request order of the kernel's programs to sweep: batch order, or longest first "
                        "(paged_fp16_pool_decode.longest_first_order, computed once per batch, outside the timing)")
    p.add_argument("--configs", nargs="+", default=None, metavar="WARPS:STAGES",
                   help="launch configs to sweep (default: the kernel's own), e.g. 4:1 2:1")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--tag", default=None, help="suffix for the result file name")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cpu: Triton's interpreter, perf_counter timing (a smoke run, not a measurement)")
    p.add_argument("--out-dir", default=RESULTS_DIR, help="where the JSON and PNG go")
    p.add_argument("--plot-only", default=None, metavar="JSON", help="re-plot an existing result")
    args = p.parse_args()
    if args.plot_only:
        with open(args.plot_only) as f:
            data = json.load(f)
        plot(args.plot_only[: -len(".json")] + ".png", data["rows"], data["params"])
        return
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("no CUDA device: pass --device cpu (tiny shapes)")
    triton_interpreter_for(args.device)

    from sgl_kvxfer.kernels import paged_fp16_pool_decode as fp

    dev = torch.device(args.device)
    copy_bw = copy_bandwidth_Bps(dev)
    k, v, table, lens, tokens = build(args, dev)
    nbytes = tokens * args.kv_heads * args.head_dim * 2 * 2
    q = torch.randn(args.batch, args.q_heads, args.head_dim, dtype=torch.bfloat16, device=dev)
    sweep = [(int(w), int(st)) for w, st in (c.split(":") for c in args.configs)] if args.configs else \
        [(fp.NUM_WARPS, fp.NUM_STAGES)]
    default_plan = fp.plan_fp16_splits(table.shape[1], args.batch, args.kv_heads, dev)
    ref = None
    rows = []
    for (warps, stages), s16, ppi, order in itertools.product(sweep, args.splits, args.pages_per_iter, args.order):
        plan = (math.ceil(table.shape[1] / s16), s16)
        perm = fp.longest_first_order(lens) if order == "longest" else None

        def call(plan=plan, ppi=ppi, perm=perm, warps=warps, stages=stages):
            return fp.paged_fp16_pool_decode(q, k, v, table, lens, split_plan=plan, check=False, even_splits=True,
                                             pages_per_iter=ppi, request_order=perm, num_warps=warps,
                                             num_stages=stages)
        out = call()
        ref = out if ref is None else ref
        diff = (out.float() - ref.float()).abs().max().item()
        # one call per replay: the KV of a real shape (>= 32k tokens) is far beyond L2
        timing = time_rotating([call], dev, args.iters)
        ms, graphed = timing["ms"], timing["graphed"]
        row = {"config": f"{warps} warps, {stages} stages", "S16": s16, "pages_per_iter": ppi, "order": order,
               "ms": ms, "pct_copy_bw": 100 * nbytes / (ms * 1e-3) / copy_bw, "graphed": graphed,
               "max_abs_diff": diff}
        rows.append(row)
        print(f"{row['config']:20s} S16={s16} ppi={ppi} order={order}: {1e3 * ms:7.1f} us "
              f"({row['pct_copy_bw']:.0f}% of copy bw, diff {diff:.1e})", flush=True)
    best = min(rows, key=lambda r: r["ms"])
    print("best:", best, "| the planner's default:", default_plan)
    device = device_name(args.device)
    payload = {"benchmark": "decode_plan", "device": device, "commit": git_commit(),
               "params": vars(args), "tokens": tokens, "kv_bytes": nbytes, "copy_bandwidth_Bps": copy_bw,
               "default_plan": default_plan, "rows": rows, "best": best}
    tag = f"_{args.tag}" if args.tag else ""
    path = write_json(f"decode_plan_{device.split(' (')[0].replace(' ', '_')}{tag}", payload, args.out_dir)
    plot(path[: -len(".json")] + ".png", rows, vars(args))
    print("wrote", path)


def plot(path_png, rows, params: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.8))
    configs = sorted({r["config"] for r in rows})
    ppis = sorted({r.get("pages_per_iter", 1) for r in rows})
    orders = sorted({r.get("order", "none") for r in rows})
    for cfg, ppi, order in itertools.product(configs, ppis, orders):
        pts = [(r["S16"], 1e3 * r["ms"]) for r in rows if r["config"] == cfg
               and r.get("pages_per_iter", 1) == ppi and r.get("order", "none") == order]
        if pts:
            ax.plot(*zip(*pts), marker="o" if order == "none" else "s",
                    label=f"{cfg}, {ppi} page(s)/step" + ("" if order == "none" else ", longest first"))
    ax.set_xscale("log", base=2)
    ax.set_xlabel("splits per request (S16)")
    ax.set_ylabel("us per layer")
    ax.set_title(f"decode attention, heads {params['q_heads']}/{params['kv_heads']}/{params['head_dim']}, "
                 f"B={params['batch']}, ctx {params['ctx_min']}-{params['ctx_max']}, page {params['page']}",
                 fontsize=9)
    ax.legend(fontsize=5)
    fig.tight_layout()
    fig.savefig(path_png, dpi=120)


if __name__ == "__main__":
    main()
