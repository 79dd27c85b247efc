"""A decode step's tiered block tables (mem_cache/tiered_rows.tier_block_tables), kernel vs torch.

Once per decode step the tiered backend turns the batch's req_to_token rows into per-tier page
tables: mask, sort each row (int32 keys), then run-length encode each int tier's pages, either
in one launch (kernels/tier_tables.py, what CUDA runs) or with the torch reference's dozen ops.
Both are timed here side by side in CUDA graphs (as the decode graph replays them), on rows of
a tiered pool's ids at a b = 0.5-like mix (64 fp16 tokens per request, the rest ~93% int8 /
~7% int4 in whole pages), per (batch, context):

    sort      the mask and the int32 sort alone (shared by both)
    kernel    sort + tier_tables
    torch     sort + tier_tables_reference

    python benchmarks/kernels/block_tables.py --points 8:16384 8:32768 32:16384     # GPU
    python benchmarks/kernels/block_tables.py --device cpu --points 2:256 --iters 5  # CPU smoke run
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common.bandwidth import time_rotating  # noqa: E402
from common.report import device_name, triton_interpreter_for, write_json  # noqa: E402

PAGE = 256


def pool_rows(batch: int, context: int, device: torch.device, seed: int = 0):
    """(slots int64 [B, L], seq_lens [B], b8, b4, end): each request 64 fp16 ids, then int8 and
    int4 pages in shuffled page order, the last int page of each tier partial."""
    g = torch.Generator().manual_seed(seed)
    n16 = 64
    n4 = (context - n16) * 7 // 100
    n8 = context - n16 - n4
    pages8, pages4 = -(-n8 // PAGE), -(-n4 // PAGE)
    b8 = batch * n16 + 2
    b4 = b8 + batch * pages8 * PAGE
    end = b4 + batch * pages4 * PAGE
    rows = []
    for b in range(batch):
        ids16 = 1 + b * n16 + torch.arange(n16)
        p8 = b * pages8 + torch.randperm(pages8, generator=g)
        p4 = b * pages4 + torch.randperm(pages4, generator=g)
        ids8 = (b8 + p8[:, None] * PAGE + torch.arange(PAGE)).flatten()[:n8]
        ids4 = (b4 + p4[:, None] * PAGE + torch.arange(PAGE)).flatten()[:n4]
        rows.append(torch.cat([ids16, ids8, ids4])[torch.randperm(context, generator=g)])
    slots = torch.stack(rows).to(device)
    return slots, torch.full((batch,), context, device=device), b8, b4, end


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--points", nargs="+", default=["8:16384", "8:32768", "32:16384"], help="BATCH:CONTEXT")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--name", default=None)
    p.add_argument("--out-dir", default=None)
    args = p.parse_args(argv)
    if args.iters < 5:
        p.error("--iters >= 5 (the spread needs repeats)")
    triton_interpreter_for(args.device)
    from sgl_kvxfer.kernels.tier_tables import tier_tables, tier_tables_reference

    device = torch.device(args.device)
    rows = []
    for point in args.points:
        batch, context = (int(x) for x in point.split(":"))
        slots, lens, b8, b4, end = pool_rows(batch, context, device)
        cols = torch.arange(context, device=device)

        def keys():
            live = (cols[None, :] < lens[:, None]) & (slots != 0)
            return torch.where(live, slots, end).to(torch.int32).sort(dim=1).values

        k = keys()
        got, want = tier_tables(k, b8, b4, end, PAGE), tier_tables_reference(k, b8, b4, end, PAGE)
        same = all(torch.equal(a, b) for f in ("tables", "lens", "fills", "num_pages")
                   for a, b in zip(getattr(got, f), getattr(want, f)))
        row = {"batch": batch, "context": context, "tables_equal": same}
        for name, fn in (("sort", keys), ("kernel", lambda: tier_tables(keys(), b8, b4, end, PAGE)),
                         ("torch", lambda: tier_tables_reference(keys(), b8, b4, end, PAGE))):
            row[name] = time_rotating([fn], device, args.iters)
        row["torch_over_kernel"] = row["torch"]["ms"] / row["kernel"]["ms"]
        rows.append(row)
        print(f"batch {batch} x {context}: sort {row['sort']['ms'] * 1e3:.1f} us, sort + kernel "
              f"{row['kernel']['ms'] * 1e3:.1f} us [{row['kernel']['ms_min'] * 1e3:.1f}-{row['kernel']['ms_max'] * 1e3:.1f}], "
              f"sort + torch {row['torch']['ms'] * 1e3:.1f} us [{row['torch']['ms_min'] * 1e3:.1f}-"
              f"{row['torch']['ms_max'] * 1e3:.1f}] ({row['torch_over_kernel']:.2f}x); tables equal: {same}", flush=True)
    name = args.name or f"block_tables_{device_name(args.device).replace(' ', '_')}"
    payload = {"benchmark": "block_tables", "device": device_name(args.device), "torch": torch.__version__,
               "params": {**vars(args), "page": PAGE}, "rows": rows}
    path = write_json(name, payload, args.out_dir)
    with open(path) as f:
        _plot(json.load(f), path[:-5] + ".png")  # as written: commit and command filled in
    print("wrote", path, "and its .png")
    return path


def _plot(payload: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = payload["rows"]
    labels = [f"{r['batch']} x {r['context']}" for r in rows]
    fig, ax = plt.subplots(figsize=(1.8 + 1.6 * len(rows), 3.6))
    for i, (name, color) in enumerate((("sort", "grey"), ("kernel", "tab:blue"), ("torch", "tab:orange"))):
        xs = [j + (i - 1) * 0.27 for j in range(len(rows))]
        ax.bar(xs, [r[name]["ms"] * 1e3 for r in rows], width=0.27, color=color, label=name if name == "sort"
               else f"sort + {name}")
    ax.set_xticks(range(len(rows)), labels)
    ax.set_xlabel("batch x context")
    ax.set_ylabel("us per decode step")
    ax.set_title(f"tiered block tables, {payload['device']} @ {str(payload.get('commit'))[:10]}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
