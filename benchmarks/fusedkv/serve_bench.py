"""FusedKV serving, side by side: KV pool bytes, prefill TTFT and decode TPOT of vanilla,
FusedKV and FusedKV-Lite models of one shape, through the offline Engine.

Each variant is the preset's config.json (+ a `fusedkv` section: bottom half stores KV, random
fusion weights from the config's init) with dummy weights, served by one Engine with the same
pool capacity in tokens (equal context), so the pool bytes compare directly:

    pool     allocated bytes of the KV pool (every tensor it holds) and bytes per token
    TTFT     generate(max_new_tokens=1) of one random prompt of each length, prefilled in one
             chunk, radix cache flushed before each timed run (median of --ttft-repeats, after
             a warm-up run per length). --ablate-skip also times FusedKV with its top half run
             over every prompt token (model.skip_prefill_rows = False): where the TTFT comes from
    TPOT     `batch` prompts of --decode-context tokens: step = (T(n2) - T(n1)) / (n2 - n1) of
             generate(max_new_tokens=n1 / n2) over radix-cached prompts (benchmarks/throughput/
             e2e_decode.py's method), medians of --decode-repeats; CUDA graphs as the engine
             defaults (on for CUDA)

Targets (issue 21, the paper's figures): pool 0.50x of vanilla; TTFT <= 0.6x of vanilla at
prompts >= 8k; TPOT within 1.1x (Lite) and 1.5x (FusedKV). The JSON records each ratio and
whether it meets its target.

    python benchmarks/fusedkv/serve_bench.py --preset llama-3-8b --prompt-lens 4096 8192 16384 \
        --decode-context 8192 --decode-batch 1 16 --ablate-skip          # GPU (scripts/gpu/fusedkv_bench.sh)
    python benchmarks/fusedkv/serve_bench.py --smoke                     # CPU smoke run
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common.report import device_name, git_commit, triton_interpreter_for, write_json  # noqa: E402

VARIANTS = ("vanilla", "fusedkv", "lite")
TARGETS = {"pool_ratio": 0.5, "ttft_ratio_max": 0.6, "ttft_min_prompt": 8192,
           "tpot_ratio_max": {"lite": 1.1, "fusedkv": 1.5}}
SMOKE = ["--preset", "tiny", "--device", "cpu", "--dtype", "float32", "--backend", "torch", "--prompt-lens", "48",
         "96", "--ttft-repeats", "1", "--decode-context", "32", "--decode-batch", "2", "--n1", "1", "--n2", "3",
         "--decode-repeats", "1", "--ablate-skip"]


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def write_variant(preset: str, variant: str, root: str) -> str:
    """The preset's config.json (+ a fusedkv section) and a dummy tokenizer in root/variant."""
    from sgl_kvxfer.models.presets import PRESETS, write_dummy_tokenizer, write_preset_config

    d = write_preset_config(preset, os.path.join(root, variant))
    if variant != "vanilla":
        path = os.path.join(d, "config.json")
        with open(path) as f:
            cfg = json.load(f)
        cfg["fusedkv"] = {"variant": variant}  # storage layers: the bottom half (the default)
        with open(path, "w") as f:
            json.dump(cfg, f, indent=2)
    return write_dummy_tokenizer(d, PRESETS[preset]["vocab_size"])


def timed(engine, prompts, n: int) -> float:
    params = {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}
    sync()
    t = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    sync()
    assert all(o["meta_info"]["completion_tokens"] == n for o in outs)
    return time.perf_counter() - t


def measure_ttft(engine, args, vocab: int) -> dict[int, dict]:
    out = {}
    for length in args.prompt_lens:
        prompt = [random.Random(length).randrange(10, vocab) for _ in range(length)]
        engine.flush_cache()
        timed(engine, [prompt], 1)  # warm-up: Triton JIT / autotune for this length
        runs = []
        for _ in range(args.ttft_repeats):
            engine.flush_cache()
            runs.append(timed(engine, [prompt], 1))
        out[length] = {"ttft_s": statistics.median(runs), "runs_s": runs}
    return out


def measure_tpot(engine, args, vocab: int) -> dict[int, dict]:
    out = {}
    for batch in args.decode_batch:
        rng = random.Random(batch)
        prompts = [[rng.randrange(10, vocab) for _ in range(args.decode_context)] for _ in range(batch)]
        engine.flush_cache()
        timed(engine, prompts, 1)  # prefill; later calls are radix hits
        t1, t2 = [], []
        for _ in range(args.decode_repeats):
            t1.append(timed(engine, prompts, args.n1))
            t2.append(timed(engine, prompts, args.n2))
        step = (statistics.median(t2) - statistics.median(t1)) / (args.n2 - args.n1)
        out[batch] = {"tpot_s": step, "n1_s": t1, "n2_s": t2}
    return out


def run_variant(args, variant: str, model_dir: str, pool_tokens: int, vocab: int) -> dict:
    from sgl_kvxfer import Engine
    from sgl_kvxfer.mem_cache.pool_bytes import allocated_bytes

    max_b = max(args.decode_batch)
    chunk = max(args.prompt_lens + [args.decode_context])
    kw = dict(load_format="dummy", dtype=args.dtype, device=args.device, attention_backend=args.backend,
              max_total_tokens=pool_tokens, max_running_requests=max_b, chunked_prefill_size=chunk,
              max_prefill_tokens=max(chunk, 32768))  # the decode batch's prompts: a few 32k-token prefills
    if args.device != "cpu":
        kw["cuda_graph_max_bs"] = max_b
    t0 = time.perf_counter()
    engine = Engine(model_dir, **kw)
    start_s = time.perf_counter() - t0
    runner = engine.runner
    pool = runner.kv_pool
    row = {"variant": variant, "engine_kwargs": kw, "engine_start_s": start_s,
           "pool_tokens": pool.size, "pool_allocated_bytes": allocated_bytes(pool),
           "kv_bytes_per_token": pool.bytes_per_token(),
           "reconstruction_path": getattr(runner.attn_backend, "path", None),
           "cuda_graphs": runner.graph_runner is not None}
    print(f"{variant}: pool {row['pool_allocated_bytes'] / 2**30:.2f} GiB for {pool.size} tokens "
          f"({row['kv_bytes_per_token']:.0f} B/token), start {start_s:.1f} s", flush=True)
    row["ttft"] = measure_ttft(engine, args, vocab)
    if variant == "fusedkv" and args.ablate_skip:
        runner.model.skip_prefill_rows = False
        row["ttft_no_skip"] = measure_ttft(engine, args, vocab)
        runner.model.skip_prefill_rows = True
    row["tpot"] = measure_tpot(engine, args, vocab)
    for length, t in row["ttft"].items():
        extra = f" (no skip {row['ttft_no_skip'][length]['ttft_s'] * 1e3:.1f} ms)" if "ttft_no_skip" in row else ""
        print(f"  TTFT {length}: {t['ttft_s'] * 1e3:.1f} ms{extra}", flush=True)
    for batch, t in row["tpot"].items():
        print(f"  TPOT batch {batch} ctx {args.decode_context}: {t['tpot_s'] * 1e3:.2f} ms", flush=True)
    engine.shutdown()
    del engine, runner, pool
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return row


def ratios(rows: dict[str, dict]) -> dict:
    """Each variant vs vanilla, with the targets it meets."""
    base, out = rows.get("vanilla"), {}
    if base is None:
        return out
    for v, r in rows.items():
        if v == "vanilla":
            continue
        pool = r["pool_allocated_bytes"] / base["pool_allocated_bytes"]
        ttft = {L: r["ttft"][L]["ttft_s"] / base["ttft"][L]["ttft_s"] for L in r["ttft"]}
        tpot = {b: r["tpot"][b]["tpot_s"] / base["tpot"][b]["tpot_s"] for b in r["tpot"]}
        long = [x for L, x in ttft.items() if L >= TARGETS["ttft_min_prompt"]]
        cap = TARGETS["tpot_ratio_max"][v]
        out[v] = {"pool": pool, "ttft": ttft, "tpot": tpot,
                  "meets": {"pool": abs(pool - TARGETS["pool_ratio"]) < 0.01,
                            "ttft": bool(long) and 0 < max(long) <= TARGETS["ttft_ratio_max"],
                            "tpot": 0 < min(tpot.values()) and max(tpot.values()) <= cap}}
        if "ttft_no_skip" in r:
            out[v]["ttft_no_skip"] = {L: r["ttft_no_skip"][L]["ttft_s"] / base["ttft"][L]["ttft_s"] for L in r["ttft"]}
    return out


def plot(path_png: str, title: str, rows: dict[str, dict], rel: dict) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    names = list(rows)
    axes[0].bar(names, [rows[v]["pool_allocated_bytes"] / 2**30 for v in names], color=["C0", "C1", "C2"][:len(names)])
    for i, v in enumerate(names):
        if v in rel:
            axes[0].text(i, rows[v]["pool_allocated_bytes"] / 2**30, f"{rel[v]['pool']:.2f}x", ha="center", va="bottom")
    axes[0].set_ylabel(f"KV pool GiB ({rows[names[0]]['pool_tokens']} tokens)")
    for i, v in enumerate(names):
        lens = sorted(rows[v]["ttft"])
        axes[1].plot(lens, [rows[v]["ttft"][L]["ttft_s"] * 1e3 for L in lens], "o-", color=f"C{i}", label=v)
        if "ttft_no_skip" in rows[v]:
            axes[1].plot(lens, [rows[v]["ttft_no_skip"][L]["ttft_s"] * 1e3 for L in lens], "x--", color=f"C{i}",
                         label=f"{v}, top half over every token")
        batches = sorted(rows[v]["tpot"])
        xs = [j + 0.27 * (i - 1) for j in range(len(batches))]
        axes[2].bar(xs, [rows[v]["tpot"][b]["tpot_s"] * 1e3 for b in batches], 0.27, color=f"C{i}", label=v)
        if v in rel:
            for x, b in zip(xs, batches):
                axes[2].text(x, rows[v]["tpot"][b]["tpot_s"] * 1e3, f"{rel[v]['tpot'][b]:.2f}x", ha="center",
                             va="bottom", fontsize=7)
    axes[1].set_xlabel("prompt tokens")
    axes[1].set_ylabel("TTFT ms")
    axes[1].legend(fontsize=7)
    batches = sorted(rows[names[0]]["tpot"])
    axes[2].set_xticks(range(len(batches)), [f"batch {b}" for b in batches])
    axes[2].set_ylabel("TPOT ms")
    axes[2].legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path_png, dpi=120)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="CPU smoke run: " + " ".join(SMOKE))
    p.add_argument("--preset", default="llama-3-8b")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--prompt-lens", type=int, nargs="+", default=[4096, 8192, 16384])
    p.add_argument("--ttft-repeats", type=int, default=3)
    p.add_argument("--ablate-skip", action="store_true", help="also time FusedKV's TTFT without the prefill skip")
    p.add_argument("--decode-context", type=int, default=8192)
    p.add_argument("--decode-batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--n1", type=int, default=16)
    p.add_argument("--n2", type=int, default=80)
    p.add_argument("--decode-repeats", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--backend", default="triton")
    p.add_argument("--out-dir", default=None)
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv)
    if args.smoke:
        args = p.parse_args(SMOKE + [a for a in argv if a != "--smoke"])
        args.smoke = True
    if args.n2 <= args.n1:
        p.error("--n2 must exceed --n1")
    triton_interpreter_for(args.device)

    from sgl_kvxfer.models.presets import PRESETS

    vocab = PRESETS[args.preset]["vocab_size"]
    # equal capacity for every variant: the longest prompt, or every decode request to its end
    pool_tokens = max(max(args.prompt_lens), max(args.decode_batch) * (args.decode_context + args.n2 + 64)) + 1024
    device = device_name(args.device)
    rows = {}
    with tempfile.TemporaryDirectory(prefix="fusedkv_serve_") as root:
        for variant in args.variants:
            rows[variant] = run_variant(args, variant, write_variant(args.preset, variant, root), pool_tokens, vocab)
    rel = ratios(rows)
    for v, r in rel.items():
        print(f"{v} vs vanilla: pool {r['pool']:.3f}x, TTFT " + ", ".join(f"{L}: {x:.2f}x" for L, x in r["ttft"].items())
              + ", TPOT " + ", ".join(f"b{b}: {x:.2f}x" for b, x in r["tpot"].items()) + f"; meets {r['meets']}")
    payload = {"benchmark": "fusedkv_serve", "device": device, "commit": git_commit(), "torch": torch.__version__,
               "params": vars(args), "targets": TARGETS, "rows": rows, "vs_vanilla": rel}
    tag = "cpu" if args.device == "cpu" else device.split(" (")[0].replace(" ", "_")
    path = write_json(f"fusedkv_serve_{args.preset}_{tag}", payload, args.out_dir)
    print("wrote", path)
    title = f"vanilla / FusedKV / FusedKV-Lite, {args.preset} shape, dummy weights, {args.dtype}, {device}"
    if plot(path[:-5] + ".png", title, rows, rel):
        print("wrote", path[:-5] + ".png")
    return path


if __name__ == "__main__":
    main()
