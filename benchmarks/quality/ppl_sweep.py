"""Compressed-prefix perplexity sweep through the engine (protocol: benchmarks/quality/README.md).

    python benchmarks/quality/ppl_sweep.py --quick                      # CPU smoke run
    python benchmarks/quality/ppl_sweep.py --device cuda --units bytes cost   # the full sweep
    python benchmarks/quality/ppl_sweep.py --plot-only benchmarks/results/ppl_sweep_<tag>.json

Per window of the eval prose: request 1 prefills `context` tokens with max_new_tokens=0 (the
scheduler tiers them and caches them); request 2 sends context + continuation with
return_logprob and logprob_start_len = context, so the prefix is a radix hit at its tiers and
only the continuation is scored. PPL = exp(mean NLL over every scored token); the change is
100 * (PPL_method - PPL_fp16) / PPL_fp16 against the untiered engine (b = 1.0).
"""
from __future__ import annotations

import argparse
import math
import time

from _harness import (ALL_METHODS, add_common_args, device_tag, load_for_plot, load_texts, make_engines, metadata,
                      run_then_plot, save_plot, tier_stats, write)

FULL_BUDGETS = [round(0.25 + 0.05 * i, 2) for i in range(11)] + [1.0]


def eval_windows(tokenizer, texts, context: int, chunk: int, max_windows: int, per_doc: int) -> list[list[int]]:
    """Non-overlapping windows of context + chunk + 1 tokens, at most `per_doc` per document."""
    size, out = context + chunk + 1, []
    for text in texts:
        ids = tokenizer.encode(text)
        for w in range(min(len(ids) // size, per_doc)):
            out.append(ids[w * size:(w + 1) * size])
            if len(out) == max_windows:
                return out
    return out


def score(engine, windows, context: int, tag: str) -> tuple[float, int, set[str], float]:
    """(total NLL, scored tokens, rids of the context prefills, resident KV bytes / fp16 bytes
    after the context prefill) for one configuration."""
    engine.flush_cache()
    rids = [f"{tag}-ctx-{i}" for i in range(len(windows))]
    engine.generate(input_ids=[w[:context] for w in windows], sampling_params={"max_new_tokens": 0}, rid=rids)
    info = engine.get_server_info()
    outs = engine.generate(input_ids=windows, sampling_params={"max_new_tokens": 0}, return_logprob=True,
                           logprob_start_len=context, rid=[f"{tag}-cont-{i}" for i in range(len(windows))])
    nll, count = 0.0, 0
    for o in outs:
        if o["meta_info"]["cached_tokens"] != context:
            raise RuntimeError(f"{tag}: context was not a full radix hit ({o['meta_info']['cached_tokens']})")
        lps = [e[0] for e in o["meta_info"]["input_token_logprobs"] if e[0] is not None]
        nll, count = nll - sum(lps), count + len(lps)
    extra = info.get("extra") or {}
    resident = info["kv_bytes_per_token"] / extra["kv_full_bytes_per_token"] if extra else 1.0
    return nll, count, set(rids), resident


def run(args) -> str:
    budgets = args.budgets or ([0.3, 0.5, 0.75] if args.quick else FULL_BUDGETS)
    methods = args.methods or (["greedy", "sink-protect", "pdtrim", "sws"] if args.quick else list(ALL_METHODS))
    units = args.units
    if args.quick and not args.max_total_tokens:
        args.max_total_tokens = 40000
    base, tiered = make_engines(args, {"kv_tier_budget": 0.5, "kv_tier_policy": "balanced", "kv_int4": "on",
                                       "kv_tier_staging": 0.4})
    windows = eval_windows(base.tokenizer, load_texts(args.prose), args.context, args.chunk,
                           args.windows or (2 if args.quick else 16), args.per_doc)
    print(f"{len(windows)} windows of {args.context} + {args.chunk}; methods {methods}; budgets {budgets}; "
          f"units {units}", flush=True)
    t0 = time.time()
    nll, count, _, _ = score(base, windows, args.context, "fp16")
    ref = math.exp(nll / count)
    print(f"fp16 (untiered) PPL {ref:.4f} over {count} tokens ({time.time() - t0:.0f}s)", flush=True)
    rows, tiering = [], tiered.scheduler.tiering
    meta = metadata(args, base, {"budgets": budgets, "methods": methods, "units": units, "windows": len(windows)})
    unit_tag = "" if units == ["bytes"] else "_" + "_".join(units)  # one file per unit set
    name = f"ppl_sweep_{device_tag(base)}{unit_tag}{'_quick' if args.quick else ''}"

    def save(done: bool) -> str:  # after every point, so a run cut short keeps what it measured
        return write(args.out_dir, name, {**meta, "protocol": "compressed-prefix PPL (benchmarks/quality/README.md)",
                                          "fp16_ppl": ref, "scored_tokens": count, "complete": done,
                                          "results": rows, "wall_s": time.time() - t0})

    for unit in units:
        for method in methods:
            for b in budgets:
                t = time.time()
                with tiering.using(policy=method, budget=b, unit=unit, int4_allowed=True):
                    nll, count, rids, resident = score(tiered, windows, args.context, f"{method}-{unit}-{b}")
                ppl = math.exp(nll / count)
                row = {"unit": unit, "method": method, "budget": b, "ppl": ppl, "delta_pct": 100 * (ppl - ref) / ref,
                       "tokens": count, "resident_ratio": resident, **tier_stats(tiering.records, rids)}
                rows.append(row)
                print(f"{unit:5s} {method:15s} b={b:.2f} PPL {ppl:.4f} ({row['delta_pct']:+.2f}%) "
                      f"bytes {row['byte_ratio']:.3f} resident {resident:.3f} "
                      f"mix {[round(f, 3) for f in row['tier_fractions']]} fallback {row['fallback_tokens']} "
                      f"({time.time() - t:.0f}s)", flush=True)
                save(False)
    path = save(True)
    print("wrote", path)
    return path


def plot(path: str) -> str:
    plt, data = load_for_plot(path)
    units = data["params"]["units"]
    fig, axes = plt.subplots(1, len(units), figsize=(7 * len(units), 5), squeeze=False)
    for ax, unit in zip(axes[0], units):
        for method in data["params"]["methods"]:
            pts = sorted((r["budget"], r["delta_pct"]) for r in data["results"]
                         if r["unit"] == unit and r["method"] == method)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=method)
        ax.axhline(0.0, color="k", lw=0.6)
        ax.set_yscale("symlog", linthresh=1.0)
        ax.set_xlabel(f"budget b ({'resident bytes incl. scales' if unit == 'bytes' else 'Eq. 3 cost'})")
        ax.set_ylabel("PPL change vs fp16 (%)")
        ax.set_title(f"SmolLM2-135M, ctx {data['params']['context']} + {data['params']['chunk']}, "
                     f"{data['params']['windows']} windows, fp16 PPL {data['fp16_ppl']:.3f}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"{data['device']} @ {data['commit'][:10]}", fontsize=8)
    return save_plot(fig, path)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=256, help="scored continuation tokens per window")
    ap.add_argument("--windows", type=int, default=None, help="eval windows (default 16; quick 2)")
    ap.add_argument("--per-doc", type=int, default=2, help="at most this many windows per document")
    ap.add_argument("--budgets", type=float, nargs="*", default=None)
    ap.add_argument("--methods", nargs="*", default=None, choices=ALL_METHODS)
    ap.add_argument("--units", nargs="*", default=["bytes"], choices=["bytes", "cost"])
    args = ap.parse_args()
    run_then_plot(args, run, plot)


if __name__ == "__main__":
    main()
