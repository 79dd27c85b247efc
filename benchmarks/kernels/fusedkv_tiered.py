"""fusedkv_tiered_decode's launch shapes at a served point: one reconstruction layer's decode
over a tiered pool, per TieredLaunch (key positions per step, warps, stages, split waves).

The stores hold --layers stacked storage layers; each request's ids are laid out as the pool
lays them out: --sinks first tokens and --recent last tokens in fp16 rows, the rest spread over
the fp16 / int8 / int4 stores by --mix (fractions of the tokens in between, each token's tier
drawn at random, ids of one tier in position order). On a GPU each config's --calls launches
are captured in one CUDA graph, as the engine's decode runs them; after --warmup-s of replays,
each repeat times one replay of every config in turn (CUDA events; the LSE merge of split-K
included), and the same launches issued eagerly from the host beside it (`us_eager`: above `us`
where the host's launch cost, not the kernel, sets the rate); per config the median of
--repeats such timings with min / max, the bytes the launch must read (both sources' K and V of
every live token, codes and scales, plus q), GB/s and the fraction of a device-to-device copy's
bandwidth (common/bandwidth.py) measured in the same run. Every config's output is checked against the default launch's (a config that computes
something else fails); a config that cannot launch (shared memory beyond the device's) is listed
under `skipped`. --group-size (default head_dim, as the engine's pools) sets the int stores'
channels per scale and zero.

    python benchmarks/kernels/fusedkv_tiered.py                        # SmolLM2 heads, 8 x 2048, b = 0.5 (int8)
    python benchmarks/kernels/fusedkv_tiered.py --mix 0.2:0.3:0.5       # some of each store
    python benchmarks/kernels/fusedkv_tiered.py --device cpu --batch 2 --context 80 --layers 2 --sources 0,1 \\
        --page 16 --repeats 1 --calls 1 --configs 32:4:2 16:2:1      # CPU smoke run (Triton's interpreter)
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import asdict

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common.bandwidth import copy_bandwidth_Bps  # noqa: E402
from common.report import RESULTS_DIR, device_name, git_commit, triton_interpreter_for, write_json  # noqa: E402

DEFAULT_CONFIGS = [f"{t}:{w}:{s}" for t in (32, 64, 128) for w in (2, 4, 8) for s in (2, 3)] + \
    ["32:4:2:2", "32:4:2:8", "64:4:2:2", "64:4:2:8", "64:4:3:8"]  # split waves beside the default (4)


def parse_launch(text: str):
    """'tile:warps:stages[:split_waves]' -> TieredLaunch."""
    from sgl_kvxfer.kernels.fusedkv_tiered_decode import TieredLaunch

    parts = [int(x) for x in text.split(":")]
    if len(parts) not in (3, 4):
        raise argparse.ArgumentTypeError(f"a config is tile:warps:stages[:split_waves], got {text!r}")
    return TieredLaunch(*parts)


def build(args, gen: torch.Generator):
    """(q, stores, slots, seq_lens, weights, bytes read by one launch)."""
    from sgl_kvxfer.kernels.fusedkv_attention import pack_fusion_weights
    from sgl_kvxfer.kernels.fusedkv_tiered_decode import TieredStores
    from sgl_kvxfer.kernels.paged_layout import int_tier_pages
    from sgl_kvxfer.kernels.tier_codec import TIER_INT4, TIER_INT8

    dev, B, T, H, D, L, P = args.device, args.batch, args.context, args.kv_heads, args.head_dim, args.layers, args.page
    G = args.group_size or D
    fr = [float(x) for x in args.mix.split(":")]
    if len(fr) != 3 or min(fr) < 0 or sum(fr) <= 0:
        raise SystemExit(f"--mix is fp16:int8:int4 fractions, got {args.mix!r}")
    middle = max(0, T - args.sinks - args.recent)
    tiers = torch.zeros(B, T, dtype=torch.int64)
    tiers[:, args.sinks:args.sinks + middle] = torch.multinomial(torch.tensor(fr), B * middle, replacement=True,
                                                                 generator=gen).view(B, middle)
    counts = [int((tiers == t).sum()) for t in range(3)]
    pages = [max(1, -(-counts[t] // P) + B) for t in (1, 2)]  # whole pages per request, rounded up
    rows = counts[0] + 1  # row 0 is the dropped-token row
    dt = torch.float16
    rows_k = torch.randn(L, rows, H, D, generator=gen).to(dt).to(dev)
    rows_v = torch.randn(L, rows, H, D, generator=gen).to(dt).to(dev)
    ints = []
    for tier, n_pages in ((TIER_INT8, pages[0]), (TIER_INT4, pages[1])):
        tp = int_tier_pages(tier, L * n_pages, P, H, D, G, dev)
        n = L * n_pages * P
        idx = torch.arange(n, device=dev)
        for lo in range(0, n, 1 << 20):  # in chunks: the fp32 staging of a large store stays small
            sl = idx[lo:lo + (1 << 20)]
            tp.write(sl // P, sl % P, torch.randn(sl.numel(), H, D, device=dev) * 2, torch.randn(sl.numel(), H, D, device=dev))
        ints.append(tp)
    base8 = rows
    base4 = base8 + pages[0] * P
    stores = TieredStores(rows_k, rows_v, ints[0], ints[1], pages[0], pages[1], base8, base4, G)
    slots = torch.zeros(B, T, dtype=torch.int64)
    nxt = [1, 0, 0]
    for b in range(B):
        for tier, base in ((0, 0), (1, base8), (2, base4)):
            pos = (tiers[b] == tier).nonzero().flatten()
            if tier:  # a request's int ids start on a page of their own
                nxt[tier] = -(-nxt[tier] // P) * P
            slots[b, pos] = base + nxt[tier] + torch.arange(pos.numel())
            nxt[tier] += pos.numel()
    slots = slots.to(dev)
    lens = torch.full((B,), T, dtype=torch.int32, device=dev)
    q = torch.randn(B, args.q_heads, D, generator=gen).to(dt).to(dev)
    w = pack_fusion_weights(torch.rand(2, H, D, generator=gen) + 0.2, torch.rand(2, H, D, generator=gen)).to(dev)
    per_token = [2 * D, ints[0].width + 4 * (D // G), ints[1].width + 4 * (D // G)]  # codes + fp16 scale and zero
    read = sum(c * b for c, b in zip(counts, per_token)) * H * 2 * 2 + q.numel() * 2 + slots.numel() * 8
    return q, stores, slots, lens, w, read, counts


def time_launch(fn, calls: int, repeats: int, cuda: bool) -> list[float]:
    """Seconds per launch, one sample per repeat of `calls` back-to-back launches from the host
    (on a GPU this includes any host time per launch that exceeds the kernel's)."""
    fn()
    if not cuda:
        out = []
        for _ in range(repeats):
            t = time.perf_counter()
            for _ in range(calls):
                fn()
            out.append((time.perf_counter() - t) / calls)
        return out
    torch.cuda.synchronize()
    out = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(calls):
            fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) * 1e-3 / calls)
    return out


def capture_graph(fn, calls: int) -> torch.cuda.CUDAGraph:
    """`calls` launches of fn captured in one CUDA graph (as the engine's decode runs them): a
    replay costs the device time alone, whatever the host's launch cost."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm on a side stream first, as capture requires
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph


def time_graph(graph: torch.cuda.CUDAGraph, calls: int) -> float:
    """Seconds per launch of one replay of a graph of `calls` launches."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    graph.replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1e-3 / calls


def plot(path: str, rows: list[dict], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 0.32 * len(rows) + 1.5))
    names = [r["config"] for r in rows]
    us = [r["us"] for r in rows]
    err = [[r["us"] - r["us_min"] for r in rows], [r["us_max"] - r["us"] for r in rows]]
    ax.barh(names, us, xerr=err, color=["C1" if r["default"] else "C0" for r in rows])
    ax.invert_yaxis()
    ax.set_xlabel("us per launch (median, min..max); orange: the default launch")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--q-heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=15, help="stacked storage layers (SmolLM2 FusedKV: 15)")
    p.add_argument("--sources", default="9,11", help="the two source layers (k and v read from both)")
    p.add_argument("--page", type=int, default=64, help="tokens per int8 / int4 page (--kv-tier-page-size)")
    p.add_argument("--group-size", type=int, default=0,
                   help="channels per int scale / zero pair (0: head_dim, the engine's default)")
    p.add_argument("--sinks", type=int, default=4)
    p.add_argument("--recent", type=int, default=64, help="last tokens still in fp16 rows (staged)")
    p.add_argument("--mix", default="0:1:0", help="fp16:int8:int4 fractions of the other tokens (b = 0.5: all int8)")
    p.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS, help="tile:warps:stages[:split_waves]")
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--warmup-s", type=float, default=1.0, help="launches before timing (GPU clocks up)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cpu: Triton's interpreter (a smoke run, not a measurement)")
    p.add_argument("--out-dir", default=RESULTS_DIR)
    p.add_argument("--tag", default=None, help="suffix of the result's name")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.calls < 1:
        p.error("--repeats and --calls must be >= 1")
    triton_interpreter_for(args.device)  # before any kernel module is imported
    launches = [parse_launch(c) for c in args.configs]
    from sgl_kvxfer.kernels.fusedkv_tiered_decode import DEFAULT_LAUNCH, fusedkv_tiered_decode

    cuda = args.device.startswith("cuda")
    gen = torch.Generator().manual_seed(args.seed)
    q, stores, slots, lens, w, read, counts = build(args, gen)
    src = tuple(int(x) for x in args.sources.split(","))
    if len(src) != 2 or max(src) >= args.layers:
        p.error(f"--sources: two layer ids below --layers {args.layers}")
    run = lambda launch: fusedkv_tiered_decode(q, stores, src, src, slots, lens, w, launch=launch)  # noqa: E731
    want = run(DEFAULT_LAUNCH).float()
    bw = copy_bandwidth_Bps(torch.device("cuda")) if cuda else None  # read + write bytes / s
    ok, skipped = [], {}
    for text, launch in zip(args.configs, launches):  # compile, check, and drop what cannot launch
        try:
            got = run(launch).float()
        except Exception as e:  # noqa: BLE001  e.g. triton's OutOfResources (shared memory) for a shape
            skipped[text] = f"{type(e).__name__}: {str(e)[:200]}"
            print(f"{text:>12}: skipped ({skipped[text]})", flush=True)
            continue
        err = float((got - want).abs().max())
        if not torch.allclose(got, want, rtol=2e-2, atol=2e-2):
            raise SystemExit(f"config {text}: output differs from the default launch's (max abs err {err:.3g})")
        ok.append((text, launch, err))
    # on a GPU each config's launches are captured in a CUDA graph (device time, as the engine's
    # decode runs them); eager back-to-back launches are timed beside it (`us_eager`: where it is
    # well above `us`, the host's launch cost, not the kernel, sets the eager rate)
    graphs = {text: capture_graph(lambda launch=launch: run(launch), args.calls) for text, launch, _ in ok} \
        if cuda else {}
    # warm-up (clocks up), then the configs in turn within each repeat: a drift in the device's
    # clocks during the run spreads over every config rather than landing on the first ones
    warm_end = time.perf_counter() + (args.warmup_s if cuda else 0.0)
    while time.perf_counter() < warm_end:
        time_graph(graphs[ok[0][0]], args.calls)
    samples = {text: [] for text, _, _ in ok}
    eager = {text: [] for text, _, _ in ok}
    for _ in range(args.repeats):
        for text, launch, _ in ok:
            if cuda:
                samples[text].append(time_graph(graphs[text], args.calls))
            eager[text] += time_launch(lambda: run(launch), args.calls, 1, cuda)
    if not cuda:  # no graphs on the interpreter: the eager timings are all there is
        samples = eager
    rows = []
    for text, launch, err in ok:
        s = samples[text]
        med = statistics.median(s)
        row = {"config": text, "launch": asdict(launch),
               "default": launch == DEFAULT_LAUNCH, "us": med * 1e6, "us_min": min(s) * 1e6, "us_max": max(s) * 1e6,
               "us_eager": statistics.median(eager[text]) * 1e6,
               "GBps": read / med / 1e9, "of_copy_bw": read / med / bw if bw else None, "max_abs_err_vs_default": err}
        rows.append(row)
        print(f"{text:>12}: {row['us']:8.1f} us ({row['us_min']:.1f}..{row['us_max']:.1f}), {row['GBps']:7.1f} GB/s"
              + (f", {100 * row['of_copy_bw']:.0f}% of copy" if bw else "")
              + (f", eager {row['us_eager']:.1f} us" if cuda else "") + (" (default)" if row["default"] else ""),
              flush=True)
    best = min(rows, key=lambda r: r["us"])
    default = next((r for r in rows if r["default"]), None)
    device = device_name(args.device)
    tag = "cpu" if not cuda else device.split(" (")[0].replace(" ", "_")
    payload = {"benchmark": "fusedkv_tiered", "device": device, "commit": git_commit(), "params": vars(args),
               "tokens_per_store": dict(zip(("fp16", "int8", "int4"), counts)), "bytes_per_launch": read,
               "copy_bandwidth_Bps": bw, "rows": rows, "skipped": skipped, "best": best["config"],
               "best_vs_default": default["us"] / best["us"] if default else None}
    name = f"fusedkv_tiered_{tag}" + (f"_{args.tag}" if args.tag else "")
    path = write_json(name, payload, args.out_dir)
    plot(path[:-5] + ".png", rows, f"fusedkv_tiered_decode, B {args.batch} x {args.context}, Hq/Hkv/D "
         f"{args.q_heads}/{args.kv_heads}/{args.head_dim}, mix {args.mix}, {device}")
    print(f"best {best['config']} {best['us']:.1f} us" + (f", {payload['best_vs_default']:.2f}x the default" if default else ""))
    print("wrote", path)
    return path


if __name__ == "__main__":
    main()
