"""The extend (chunked prefill) attention kernel over a long cached prefix, per autotune config:
the paged fp16 pool's layout against the tiered pool's fp16 rows.

    python benchmarks/kernels/extend_prefix.py [--prefixes 0 8192 30720] [--chunk 2048]
        [--heads 32 8 128] [--device cuda] [--out-dir DIR]

A prefill chunk of `--chunk` new tokens attends to a cached prefix of each `--prefixes` length
(one request, the Llama-3-8B heads by default, bf16), stored as

    pages   the paged fp16 pool (`--attention-backend triton` at b = 1.0): pages of 64 tokens,
            each kv head's 64 rows contiguous (page-head blocks), dense tables in page order
    rows    the tiered pool's fp16 store (b < 1): one row of all kv heads per slot (page size 1),
            filled tables over consecutive slots, as a fresh store hands them out
    scattered  the same store, the prefix's slots a random permutation (a prompt's rows after
            other prompts' rows were freed in an order of their own)
    rows_dense the rows layout's slots in the dense table form (no per-slot fill to load)

and `kernels/extend_attention.py` runs it at every config of its autotuner, one at a time (the
jitted kernel at that config, as `TunedLauncher` launches a tuned one): the one fp16 launch
(`int_tiers=False`, as the paged pool's backend runs it) and, with `--int-pass`, the tiered
backend's two launches (the fp16 pass writing each row's log2-sum-exp, then the int pass, whose
programs find no int token here and return). Eager launches timed by
common/bandwidth.py's `time_rotating` (CUDA events, `--iters` timed after 3 warm-ups), median and
spread in ms; every config's output is checked
against the first config's (they differ only in summation order).

The summary names, per layout and prefix, the fastest config, and the time at a long prefix of
the config that is fastest with no prefix: the config a key tuned on a prompt's first chunk
keeps (the extend kernel tunes per `prefix_bucket` of the batch's longest prefix, so a long
prefix gets its own). On CPU it runs under Triton's interpreter at toy sizes (`--device cpu`),
a check of the plumbing, not a speed result.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common.bandwidth import time_rotating  # noqa: E402
from common.report import device_name, triton_interpreter_for, write_json  # noqa: E402

LAYOUTS = ("pages", "rows", "scattered", "rows_dense")
PAGE = 64


def build(layout: str, prefix: int, num_kv_heads: int, head_dim: int, dtype, device):
    """A layer holding `prefix` random fp16 tokens in `layout`, and its tables (one request)."""
    from sgl_kvxfer.kernels.paged_layout import TieredBlockTables, allocate_tiered_layer

    i32 = dict(dtype=torch.int32, device=device)
    if layout == "pages":
        n = max(1, -(-prefix // PAGE))
        layer = allocate_tiered_layer((n, 1, 1), (PAGE, 16, 16), num_kv_heads, head_dim, head_dim, dtype, device,
                                      fill=0.0)
        tables = TieredBlockTables((torch.arange(n, **i32)[None], torch.zeros(1, 1, **i32), torch.zeros(1, 1, **i32)),
                                   tuple(torch.tensor([x], **i32) for x in (prefix, 0, 0)))
    elif layout == "rows_dense":
        n = max(1, prefix)
        layer = allocate_tiered_layer((n, 1, 1), (1, 16, 16), num_kv_heads, head_dim, head_dim, dtype, device,
                                      fill=0.0)
        zeros = torch.zeros(1, 1, **i32)
        tables = TieredBlockTables((torch.arange(n, **i32)[None], zeros, zeros),
                                   tuple(torch.tensor([x], **i32) for x in (prefix, 0, 0)))
    elif layout in ("rows", "scattered"):
        n = max(1, prefix)
        layer = allocate_tiered_layer((n, 1, 1), (1, 16, 16), num_kv_heads, head_dim, head_dim, dtype, device,
                                      fill=0.0)
        zeros = torch.zeros(1, 1, **i32)
        fills = torch.ones(1, n, **i32) if prefix else torch.zeros(1, 1, **i32)
        slots = torch.arange(n, **i32) if layout == "rows" else \
            torch.randperm(n, generator=torch.Generator().manual_seed(n)).to(**i32)
        tables = TieredBlockTables((slots[None], zeros, zeros),
                                   tuple(torch.tensor([x], **i32) for x in (prefix, 0, 0)),
                                   fills=(fills, zeros, zeros),
                                   num_pages=tuple(torch.tensor([x], **i32) for x in (prefix, 0, 0)))
    else:
        raise ValueError(f"unknown layout {layout!r}: {LAYOUTS}")
    fp16 = layer.pages[0]
    g = torch.Generator(device=device).manual_seed(prefix + 1)
    fp16.k.copy_(torch.randn(fp16.k.shape, generator=g, device=device).to(dtype))
    fp16.v.copy_(torch.randn(fp16.v.shape, generator=g, device=device).to(dtype))
    return layer, tables


def measure(args) -> list[dict]:
    from sgl_kvxfer.kernels import extend_attention as ea

    hq, hkv, d = args.heads
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float16
    g = torch.Generator(device=args.device).manual_seed(0)
    q, k, v = (torch.randn(args.chunk, h, d, generator=g, device=args.device).to(dtype) for h in (hq, hkv, hkv))
    indptr = torch.tensor([0, args.chunk], dtype=torch.int32, device=args.device)
    configs = list(ea._extend_fp16_kernel.configs)
    rows = []
    tuned = ea._launch_fp16
    passes = [False, True] if args.int_pass else [False]
    blocks_first = ea.BLOCKS_FIRST
    try:
        for layout in args.layouts:
            for prefix in args.prefixes:
                layer, tables = build(layout, prefix, hkv, d, dtype, args.device)
                first_out = None
                for int_tiers, order in [(i, o) for i in (passes if layout != "pages" else [False])
                                         for o in args.grid_orders]:
                    ea.BLOCKS_FIRST = order == "blocks"
                    for config in configs:
                        options = config.all_kwargs()

                        def launch(key, grid, *a, _options=options, **kw):
                            ea._extend_fp16_kernel.fn[grid](*a, **kw, **_options)

                        ea._launch_fp16 = launch

                        def run(_int_tiers=int_tiers):
                            return ea.extend_attention_tiered(q, k, v, indptr, layer, tables, max_extend_len=args.chunk,
                                                              int_tiers=_int_tiers, check=False)

                        timed = time_rotating([run], torch.device(args.device), iters=args.iters, warmup=3,
                                              graph=False)
                        out = run().float()
                        first_out = out if first_out is None else first_out
                        diff = float((out - first_out).abs().max())
                        if not diff <= 0.05:  # configs change only the summation order (NaN fails too)
                            raise RuntimeError(f"{layout} prefix {prefix}: {config} differs from {configs[0]} "
                                               f"by {diff}")
                        name = layout + ("+int" if int_tiers else "") + ("" if order == "blocks" else "@req")
                        row = {"layout": name, "prefix": prefix, "config": str(config), "options": options,
                               "ms": timed["ms"], "min_ms": timed["ms_min"], "max_ms": timed["ms_max"],
                               "max_abs_diff_vs_first_config": diff}
                        rows.append(row)
                        print(f"{name:9s} prefix {prefix:6d} {row['ms']:8.3f} ms [{row['min_ms']:.3f}, "
                              f"{row['max_ms']:.3f}] {config}", flush=True)
                del layer, tables
    finally:
        ea._launch_fp16, ea.BLOCKS_FIRST = tuned, blocks_first
    return rows


def summarize(rows: list[dict]) -> dict:
    """Per layout and prefix: the fastest config and its ms, and the ms of the config fastest
    at the smallest prefix (what a key tuned on a first chunk keeps); rows vs pages at each
    prefix, both at their fastest config."""
    out: dict = {"best": {}, "first_chunk_pick": {}}
    for layout in sorted({r["layout"] for r in rows}):
        mine = [r for r in rows if r["layout"] == layout]
        lo = min(r["prefix"] for r in mine)
        first = min((r for r in mine if r["prefix"] == lo), key=lambda r: r["ms"])["config"]
        for prefix in sorted({r["prefix"] for r in mine}):
            at = [r for r in mine if r["prefix"] == prefix]
            best = min(at, key=lambda r: r["ms"])
            kept = next(r for r in at if r["config"] == first)
            out["best"][f"{layout} @{prefix}"] = {"config": best["config"], "ms": best["ms"]}
            out["first_chunk_pick"][f"{layout} @{prefix}"] = {"config": first, "ms": kept["ms"],
                                                               "vs_best": kept["ms"] / best["ms"]}
    for key, best in out["best"].items():
        layout, at = key.split(" ")
        if layout != "pages" and f"pages {at}" in out["best"]:
            out.setdefault(f"{layout.replace('+', '_').replace('@', '_')}_vs_pages", {})[at] = \
                best["ms"] / out["best"][f"pages {at}"]["ms"]
    return out


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    prefixes = sorted({r["prefix"] for r in rows})
    configs = sorted({r["config"] for r in rows}, key=[r["config"] for r in rows].index)
    fig, axes = plt.subplots(1, len(prefixes), figsize=(4.5 * len(prefixes), 4), squeeze=False)
    for ax, prefix in zip(axes[0], prefixes):
        for i, layout in enumerate(sorted({r["layout"] for r in rows})):
            ms = [next((r["ms"] for r in rows if r["layout"] == layout and r["prefix"] == prefix
                        and r["config"] == c), float("nan")) for c in configs]
            ax.bar([j + 0.4 * i for j in range(len(configs))], ms, width=0.4, label=layout)
        ax.set_xticks([j + 0.2 for j in range(len(configs))], [f"c{j}" for j in range(len(configs))])
        ax.set_title(f"prefix {prefix}")
        ax.set_ylabel("ms (median)")
    axes[0][0].legend()
    fig.suptitle(title + "\n" + "; ".join(f"c{j}: {c}" for j, c in enumerate(configs)), fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prefixes", type=int, nargs="+", default=[0, 8192, 30720])
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--heads", type=int, nargs=3, default=[32, 8, 128], metavar=("HQ", "HKV", "D"))
    p.add_argument("--layouts", nargs="+", default=["pages", "rows"], choices=LAYOUTS)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--grid-orders", nargs="+", default=["blocks"], choices=["blocks", "requests"],
                   help="the untiled grid's order: query blocks first (the kernel's BLOCKS_FIRST) or requests "
                        "first (layout name '@req')")
    p.add_argument("--int-pass", action="store_true",
                   help="also time rows / scattered with the int pass after the fp16 one (layout name '+int')")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out-dir", default=None)
    args = p.parse_args(argv)
    if args.chunk < 1 or args.iters < 1 or min(args.prefixes) < 0:
        p.error("--chunk and --iters take positive integers, --prefixes non-negative ones")
    hq, hkv, d = args.heads
    if hq % hkv or d < 16 or d & (d - 1):
        p.error("--heads: HQ a multiple of HKV, D a power of two >= 16")
    triton_interpreter_for(args.device)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda: no GPU here (use --device cpu for the plumbing at toy sizes)")
    rows = measure(args)
    summary = summarize(rows)
    print("summary:", summary, flush=True)
    dev = device_name(args.device)
    path = write_json(f"extend_prefix_{dev.replace(' ', '_')}", {
        "benchmark": "extend_prefix", "device": dev, "params": vars(args), "rows": rows, "summary": summary,
    }, args.out_dir)
    plot(rows, path[:-5] + ".png", f"extend attention, {args.chunk} new tokens over a prefix ({dev})")
    print("wrote", path, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
