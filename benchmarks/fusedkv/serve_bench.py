"""FusedKV serving, side by side: KV pool bytes, prefill TTFT and decode TPOT of vanilla, FusedKV
and FusedKV-Lite models of one shape (dummy weights), through the offline Engine.

    pool     allocated bytes of the KV pool (every tensor it holds) per token: FusedKV / Lite 0.5x
    TTFT     generate(max_new_tokens=1) of one random prompt per length, one chunk, radix cache
             flushed before each run: one untimed run per length, then --ttft-repeats timed ones
             (median and spread). --ablate-skip also times FusedKV with its top half run over every
             prompt token (model.skip_prefill_rows = False): where the TTFT gain comes from
    TPOT     per point BATCHxCONTEXT: `batch` distinct random prompts of `context` tokens, prefilled
             once, then decode_timing.measure_tpot: warm-up, --repeats adjacent (n1, n2) pairs,
             median step with its spread; CUDA graphs as the engine defaults (on for CUDA)
    bytes    each TPOT against the bytes its step must read (weights + KV; a FusedKV top layer reads
             two source layers' K and V, a Lite one as much as a vanilla layer) at the copy bandwidth
             measured here: `faster_than_bytes_allow` flags a step no real run can take

Each variant's engine gets one pool sized for its largest point that fits the device (weights +
pool + headroom <= free memory); a point that does not fit a variant is recorded as skipped, with
the bytes it needs (FusedKV and Lite hold twice vanilla's tokens in the same bytes).

The JSON, fusedkv_serve_<preset>_<device>[_<variants>].json (the suffix when --variants is not all
three), is written after every variant; SIGINT writes what finished, the interrupted variant's
measured points included (`complete` false, `partial` true). `vs_vanilla` compares complete
variants only. Log lines carry the seconds since start.

    python benchmarks/fusedkv/serve_bench.py --preset llama-3-8b --points 1x8192 16x8192 64x8192 \\
        1x32768 16x32768 64x32768 --prompt-lens 8192 32768        # GPU (scripts/gpu/fusedkv_all.sh)
    python benchmarks/fusedkv/serve_bench.py --smoke               # CPU smoke run, into a temp dir
"""
from __future__ import annotations

import argparse
import gc
import os
import random
import re
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common.bandwidth import copy_bandwidth_Bps  # noqa: E402
from common.report import device_name, git_commit, triton_interpreter_for, write_json  # noqa: E402
from decode_timing import (HEADROOM_BYTES, SLACK, VARIANTS, device_free_bytes, engine_memory_kwargs,  # noqa: E402
                           kv_stored_bytes_per_token, measure_tpot, random_prompts, spread, step_roofline, sync,
                           weight_bytes, write_variant)

TARGETS = {"pool_ratio": 0.5, "ttft_ratio_max": 0.6, "ttft_min_prompt": 8192,
           "tpot_ratio_max": {"lite": 1.1, "fusedkv": 1.5}}
SMOKE = ["--preset", "tiny", "--device", "cpu", "--dtype", "float32", "--backend", "torch", "--prompt-lens", "48",
         "96", "--ttft-repeats", "2", "--points", "1x32", "2x32", "--n1", "2", "--n2", "6", "--repeats", "5",
         "--ablate-skip"]


def parse_point(text: str) -> tuple[int, int]:
    m = re.fullmatch(r"(\d+)x(\d+)", text)
    if not m or not (1 <= int(m[1]) <= 4096 and 1 <= int(m[2]) <= 1 << 20):
        raise argparse.ArgumentTypeError(f"a point is BATCHxCONTEXT with batch in [1, 4096], context in [1, 2^20]: {text!r}")
    return int(m[1]), int(m[2])


def measure_ttft(engine, lens: list[int], repeats: int, vocab: int) -> dict[int, dict]:
    out = {}
    for length in lens:
        prompt = [random.Random(length).randrange(10, vocab) for _ in range(length)]
        engine.flush_cache()
        timed_one(engine, prompt)  # untimed: Triton JIT / autotune for this length
        runs = []
        for _ in range(repeats):
            engine.flush_cache()
            runs.append(timed_one(engine, prompt))
        out[length] = {"ttft_s": spread(runs)["median"], "spread_s": spread(runs), "runs_s": runs}
    return out


def timed_one(engine, prompt) -> float:
    sync()
    t = time.perf_counter()
    engine.generate(input_ids=[prompt], sampling_params={"max_new_tokens": 1, "temperature": 0, "ignore_eos": True})
    sync()
    return time.perf_counter() - t


def plan_variant(args, arch, variant: str) -> tuple[list, list, int]:
    """(points that fit, skipped point rows, pool tokens) of one variant."""
    per_token = kv_stored_bytes_per_token(arch, args.dtype, variant)
    _, resident = weight_bytes(arch, args.dtype, variant)
    free = device_free_bytes(args.device)
    run, skipped, pool = [], [], max(args.prompt_lens, default=0) + 1024
    for batch, ctx in args.points:
        tokens = batch * (ctx + args.n2 + SLACK)
        need = resident + tokens * per_token + HEADROOM_BYTES
        if free is not None and need > free:
            skipped.append({"batch": batch, "context": ctx, "skipped": f"needs {need / 2**30:.1f} GiB (weights "
                            f"{resident / 2**30:.1f} + KV {tokens * per_token / 2**30:.1f} + headroom), "
                            f"{free / 2**30:.1f} GiB free"})
            continue
        run.append((batch, ctx))
        pool = max(pool, tokens)
    return run, skipped, pool


T0 = time.perf_counter()


def stamp() -> str:
    """Seconds since the script started, for the log: where a stage's time goes."""
    return f"[{time.perf_counter() - T0:6.1f} s]"


def run_variant(args, variant: str, model_dir: str, arch, vocab: int, copy_bw: float, row: dict) -> dict:
    """Measure one variant into `row` (filled in place: an interrupted variant keeps its finished
    points; `complete` is set last)."""
    from sgl_kvxfer import Engine
    from sgl_kvxfer.mem_cache.pool_bytes import allocated_bytes

    points, skipped, pool_tokens = plan_variant(args, arch, variant)
    max_b = max([b for b, _ in points], default=1)
    chunk = args.chunk or max(args.prompt_lens + [c for _, c in args.points])  # TTFT prompts in one chunk
    _, resident = weight_bytes(arch, args.dtype, variant)
    kw = dict(load_format="dummy", dtype=args.dtype, device=args.device, attention_backend=args.backend,
              max_total_tokens=pool_tokens, max_running_requests=max_b, chunked_prefill_size=chunk,
              max_prefill_tokens=max(chunk, max(args.prompt_lens, default=0)),
              **engine_memory_kwargs(args.device, resident, pool_tokens * kv_stored_bytes_per_token(arch, args.dtype, variant)))
    if args.device != "cpu":
        kw["cuda_graph_max_bs"] = max_b
    t0 = time.perf_counter()
    engine = Engine(model_dir, **kw)
    row.update(variant=variant, engine_kwargs=kw, engine_start_s=time.perf_counter() - t0, complete=False)
    try:
        runner, pool = engine.runner, engine.runner.kv_pool
        row.update(pool_tokens=pool.size, pool_allocated_bytes=allocated_bytes(pool),
                   kv_bytes_per_token=pool.bytes_per_token(),
                   pool_bytes_per_token_allocated=allocated_bytes(pool) / pool.size,
                   reconstruction_path=getattr(runner.attn_backend, "path", None),
                   cuda_graphs=runner.graph_runner is not None)
        print(f"{stamp()} {variant}: pool {row['pool_allocated_bytes'] / 2**30:.2f} GiB for {pool.size} tokens "
              f"({row['kv_bytes_per_token']:.0f} B/token), start {row['engine_start_s']:.1f} s", flush=True)
        row["ttft"] = measure_ttft(engine, args.prompt_lens, args.ttft_repeats, vocab)
        print(f"{stamp()}   TTFT " + ", ".join(f"{L}: {t['ttft_s'] * 1e3:.1f} ms" for L, t in row["ttft"].items()),
              flush=True)
        if variant == "fusedkv" and args.ablate_skip:
            runner.model.skip_prefill_rows = False
            row["ttft_no_skip"] = measure_ttft(engine, args.prompt_lens, args.ttft_repeats, vocab)
            print(f"{stamp()}   TTFT, top half over every token: " + ", ".join(
                f"{L}: {t['ttft_s'] * 1e3:.1f} ms" for L, t in row["ttft_no_skip"].items()), flush=True)
            runner.model.skip_prefill_rows = True
        row["tpot"] = list(skipped)
        for batch, ctx in points:
            prompts = random_prompts(batch, ctx, vocab, seed=batch * 100003 + ctx)
            engine.flush_cache()
            t = time.perf_counter()
            engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 1})  # prefill; radix hits after
            point = {"batch": batch, "context": ctx, "prefill_s": time.perf_counter() - t,
                     **measure_tpot(engine, prompts, args.n1, args.n2, args.repeats)}
            step_roofline(point, arch, args.dtype, variant, batch, ctx, args.n1, args.n2, copy_bw)
            row["tpot"].append(point)
            s = point["step_spread_s"]
            tp = "unmeasurable (noise > decode)" if point["tpot_s"] is None else f"{point['tpot_s'] * 1e3:.2f} ms"
            print(f"{stamp()}   TPOT b{batch} ctx {ctx}: {tp} (min {s['min'] * 1e3:.2f}, max {s['max'] * 1e3:.2f}, n={s['n']}); "
                  f"bytes allow >= {point['min_step_s'] * 1e3:.2f} ms"
                  + ("  FASTER THAN ITS BYTES ALLOW" if point["faster_than_bytes_allow"] else "")
                  + ("  (unstable)" if point["unstable"] else ""), flush=True)
        row["complete"] = True
    finally:
        engine.shutdown()
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return row


def ratios(rows: dict[str, dict]) -> dict:
    """Each variant vs vanilla (same length / same point), with the targets it meets."""
    rows = {v: r for v, r in rows.items() if r.get("complete")}
    base, out = rows.get("vanilla"), {}
    if base is None:
        return out
    btp = {(p["batch"], p["context"]): p.get("tpot_s") for p in base["tpot"]}
    for v, r in rows.items():
        if v == "vanilla":
            continue
        pool = r["pool_bytes_per_token_allocated"] / base["pool_bytes_per_token_allocated"]
        ttft = {L: r["ttft"][L]["ttft_s"] / base["ttft"][L]["ttft_s"] for L in r["ttft"] if L in base["ttft"]}
        tpot = {f"{p['batch']}x{p['context']}": p["tpot_s"] / btp[(p["batch"], p["context"])] for p in r["tpot"]
                if p.get("tpot_s") and btp.get((p["batch"], p["context"]))}
        long = [x for L, x in ttft.items() if L >= TARGETS["ttft_min_prompt"]]
        cap = TARGETS["tpot_ratio_max"][v]
        out[v] = {"pool_bytes_per_token": pool, "ttft": ttft, "tpot": tpot,
                  "meets": {"pool": abs(pool - TARGETS["pool_ratio"]) < 0.01,
                            "ttft": bool(long) and max(long) <= TARGETS["ttft_ratio_max"],
                            "tpot": bool(tpot) and max(tpot.values()) <= cap}}
        if "ttft_no_skip" in r:
            out[v]["ttft_no_skip"] = {L: r["ttft_no_skip"][L]["ttft_s"] / base["ttft"][L]["ttft_s"] for L in r["ttft"]
                                      if L in base["ttft"]}
    return out


def plot(path_png: str, title: str, rows: dict[str, dict]) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(14, 4.5))
    names = list(rows)
    for i, v in enumerate(names):
        lens = sorted(rows[v]["ttft"])
        med = [rows[v]["ttft"][L]["ttft_s"] * 1e3 for L in lens]
        err = [[m - rows[v]["ttft"][L]["spread_s"]["min"] * 1e3 for m, L in zip(med, lens)],
               [rows[v]["ttft"][L]["spread_s"]["max"] * 1e3 - m for m, L in zip(med, lens)]]
        axes[0].errorbar(lens, med, yerr=err, fmt="o-", color=f"C{i}", capsize=3, label=v)
        if "ttft_no_skip" in rows[v]:
            axes[0].plot(lens, [rows[v]["ttft_no_skip"][L]["ttft_s"] * 1e3 for L in lens], "x--", color=f"C{i}",
                         label=f"{v}, top half over every token")
    pts = sorted({(p["batch"], p["context"]) for r in rows.values() for p in r["tpot"]})
    w = 0.8 / max(1, len(names))
    for i, v in enumerate(names):
        by = {(p["batch"], p["context"]): p for p in rows[v]["tpot"]}
        for j, key in enumerate(pts):
            p = by.get(key)
            if not p or not p.get("tpot_s"):
                continue
            x, s = j + (i - (len(names) - 1) / 2) * w, p["step_spread_s"]
            axes[1].bar(x, p["tpot_s"] * 1e3, w, color=f"C{i}", label=v if j == 0 or key == pts[0] else None,
                        yerr=[[max(0, p["tpot_s"] - s["min"]) * 1e3], [max(0, s["max"] - p["tpot_s"]) * 1e3]], capsize=2)
            axes[1].plot([x - w / 2, x + w / 2], [p["min_step_s"] * 1e3] * 2, "k-", lw=1)
    axes[0].set(xlabel="prompt tokens", ylabel="TTFT ms (median, min..max)")
    axes[0].set_xscale("log", base=2)
    axes[0].legend(fontsize=7)
    axes[1].set_xticks(range(len(pts)), [f"b{b}\nctx {c}" for b, c in pts], fontsize=8)
    axes[1].set_ylim(bottom=0)
    axes[1].set(ylabel="TPOT ms (median, min..max)", title="black line: bytes per step / copy bandwidth")
    handles, labels = axes[1].get_legend_handles_labels()
    axes[1].legend(dict(zip(labels, handles)).values(), dict(zip(labels, handles)).keys(), fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path_png, dpi=120)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="CPU smoke run into a temp dir: " + " ".join(SMOKE))
    p.add_argument("--preset", default="llama-3-8b")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--prompt-lens", type=int, nargs="*", default=[8192, 32768])
    p.add_argument("--ttft-repeats", type=int, default=5)
    p.add_argument("--ablate-skip", action="store_true", help="also time FusedKV's TTFT without the prefill skip")
    p.add_argument("--points", type=parse_point, nargs="+",
                   default=[parse_point(x) for x in ("1x8192", "16x8192", "64x8192", "1x32768", "16x32768", "64x32768")])
    p.add_argument("--n1", type=int, default=8)
    p.add_argument("--n2", type=int, default=40)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--chunk", type=int, default=None, help="--chunked-prefill-size (default: the longest prompt)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--backend", default="triton")
    p.add_argument("--out-dir", default=None, help="default benchmarks/results (--smoke: a fresh temp dir)")
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv)
    if args.smoke:
        args = p.parse_args(SMOKE + [a for a in argv if a != "--smoke"])
        args.smoke = True
        args.out_dir = args.out_dir or tempfile.mkdtemp(prefix="fusedkv_serve_smoke_")
    if args.n2 <= args.n1 or args.n1 < 1:
        p.error("need 1 <= --n1 < --n2 (both calls must decode)")
    if args.repeats < 5 or args.ttft_repeats < 1:
        p.error("--repeats must be >= 5 (the spread needs them), --ttft-repeats >= 1")
    triton_interpreter_for(args.device)

    from sgl_kvxfer.models.arch_config import ModelArchConfig
    from sgl_kvxfer.models.presets import PRESETS

    arch = ModelArchConfig.from_hf_dict(PRESETS[args.preset])
    vocab = arch.vocab_size
    device = device_name(args.device)
    copy_bw = copy_bandwidth_Bps(torch.device(args.device))
    print(f"{device}: copy bandwidth {copy_bw / 1e9:.1f} GB/s (read + write)", flush=True)
    tag = "cpu" if args.device == "cpu" else device.split(" (")[0].replace(" ", "_")
    if list(args.variants) != list(VARIANTS):  # a subset never overwrites the file of all three
        tag += "_" + "_".join(args.variants)
    rows, path = {}, None

    def save(partial: bool) -> str:
        # after every variant: a stage cut off by its timeout keeps the variants (and points) done
        rel = ratios(rows)
        flagged = [(v, p["batch"], p["context"]) for v, r in rows.items() for p in r.get("tpot", [])
                   if p.get("faster_than_bytes_allow")]
        payload = {"benchmark": "fusedkv_serve", "device": device, "commit": git_commit(), "torch": torch.__version__,
                   "params": {k: v for k, v in vars(args).items()}, "copy_bandwidth_Bps": copy_bw, "targets": TARGETS,
                   "partial": partial, "rows": rows, "vs_vanilla": rel, "faster_than_bytes_allow": flagged}
        return write_json(f"fusedkv_serve_{args.preset}_{tag}", payload, args.out_dir)

    try:
        with tempfile.TemporaryDirectory(prefix="fusedkv_serve_") as root:
            for variant in args.variants:
                rows[variant] = {"variant": variant}
                run_variant(args, variant, write_variant(args.preset, variant, root), arch, vocab, copy_bw,
                            rows[variant])
                path = save(partial=variant != args.variants[-1])
    except KeyboardInterrupt:
        print(f"{stamp()} interrupted: writing the variants and points that finished", flush=True)
        path = save(partial=True)
    rel = ratios(rows)
    for v, r in rel.items():
        print(f"{v} vs vanilla: pool {r['pool_bytes_per_token']:.3f}x, TTFT " +
              ", ".join(f"{L}: {x:.2f}x" for L, x in r["ttft"].items()) +
              ", TPOT " + ", ".join(f"{k}: {x:.2f}x" for k, x in r["tpot"].items()) + f"; meets {r['meets']}")
    flagged = [(v, p["batch"], p["context"]) for v, r in rows.items() for p in r.get("tpot", [])
               if p.get("faster_than_bytes_allow")]
    if flagged:
        print(f"WARNING: faster than their bytes allow (a timing error, not a speed-up): {flagged}", flush=True)
    if path is None:
        path = save(partial=True)
    print("wrote", path)
    rows = {v: r for v, r in rows.items() if r.get("complete")}
    title = f"vanilla / FusedKV / FusedKV-Lite, {args.preset} shape, dummy weights, {args.dtype}, {device}"
    if rows and plot(path[:-5] + ".png", title, rows):
        print("wrote", path[:-5] + ".png")
    return path


if __name__ == "__main__":
    main()
