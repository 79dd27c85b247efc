"""NIAH depth x budget retrieval through the engine, plus the int4 probe and per-layer KV cosine.

    python benchmarks/quality/niah.py --quick                       # CPU run
    python benchmarks/quality/niah.py --device cuda                 # 4096 tokens, 19 depths, 4 budgets
    python benchmarks/quality/niah.py --plot-only benchmarks/results/niah_<tag>.json

A trial is one chat turn: ~`--tokens` of prose with a 7-digit passcode sentence at relative
depth d, then the retrieval question (spectrum/niah.py); greedy decoding of 24 tokens; success
iff the passcode appears in the answer. The prompt's KV is tiered when its prefill ends, so the
answer is decoded against the compressed cache (what a PD decode worker would hold).
Methods: `spectrumkv` = the probe's policy (greedy, int4 as the probe decided), `sink-protect`
(same int4), `greedy-3tier` (int4 forced on), `adaptive-2tier`, and the keep/drop baselines
`pdtrim` and `sws`; `fp16` is the untiered engine.
"""
from __future__ import annotations

import argparse
import random
import tempfile
import time

import torch

from _harness import (add_common_args, device_tag, load_for_plot, load_texts, make_engines, metadata, run_then_plot,
                      save_plot, tier_stats, write)

METHODS = {  # name -> (policy, int4: True / False / None = the probe's decision)
    "spectrumkv": ("greedy", None), "sink-protect": ("sink-protect", None), "greedy-3tier": ("greedy", True),
    "adaptive-2tier": ("adaptive-2tier", False), "pdtrim": ("pdtrim", False), "sws": ("sws", False)}


def build_trials(tokenizer, texts, depths, tokens: int, per_depth: int = 1, seed: int = 0):
    """`per_depth` trials (own passcode and filler) at each depth, depth-major order."""
    from sgl_kvxfer.scheduler.int4_probe import chat_prompt_ids
    from sgl_kvxfer.spectrum.niah import build_niah_prompt, make_passcode

    count = lambda s: len(tokenizer.encode(s, add_special_tokens=False))  # noqa: E731
    trials = []
    for i, depth in enumerate(d for d in depths for _ in range(per_depth)):
        rng = random.Random(seed * 1000 + i)
        start = rng.randrange(len(texts))
        while True:
            code = make_passcode(rng)
            prompt = build_niah_prompt(texts, code, depth, tokens, count, start)
            if prompt.count(code) == 1:
                break
        trials.append({"depth": depth, "passcode": code, "ids": chat_prompt_ids(tokenizer, prompt)})
    return trials


def run_point(engine, trials, tag: str):
    from sgl_kvxfer.spectrum.niah import niah_success

    engine.flush_cache()
    rids = [f"{tag}-{i}" for i in range(len(trials))]
    outs = engine.generate(input_ids=[t["ids"] for t in trials], rid=rids,
                           sampling_params={"max_new_tokens": 24, "temperature": 0})
    return [bool(niah_success(o["text"], t["passcode"])) for o, t in zip(outs, trials)], \
        [o["text"] for o in outs], set(rids)


def probe_baseline(engine, probe_tokens: int) -> list[bool]:
    """The probe's own 3 trials on the untiered engine."""
    from sgl_kvxfer.scheduler.int4_probe import run_engine_trial
    from sgl_kvxfer.spectrum.niah import build_probe_trials, load_filler_texts, niah_success

    tok = engine.tokenizer
    trials = build_probe_trials(load_filler_texts(), 3, target_tokens=probe_tokens,
                                count_tokens=lambda s: len(tok.encode(s, add_special_tokens=False)))
    engine.flush_cache()
    return [bool(niah_success(run_engine_trial(engine.scheduler, tok, t.prompt), t.passcode)) for t in trials]


def kv_cosine(engine, ids: list[int], group_size: int) -> dict:
    """Per-layer mean cosine between the cached K/V vectors and their int4 / int8 round trips."""
    from sgl_kvxfer.kernels.tier_codec import dequantize, quantize

    engine.flush_cache()
    engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 0})
    slots, _ = engine.scheduler.kv.tree.match_prefix(ids)
    pool, out = engine.runner.kv_pool, {"int4_k": [], "int4_v": [], "int8_k": [], "int8_v": []}
    for layer in range(pool.num_layers):
        k, v = pool.get_kv(layer, slots)
        for name, x in (("k", k), ("v", v)):
            x = x.float()
            for bits in (4, 8):
                y = dequantize(*quantize(x, bits, group_size), bits, group_size, torch.float32)
                out[f"int{bits}_{name}"].append(float(torch.nn.functional.cosine_similarity(x, y, dim=-1).mean()))
    return out


def run(args) -> str:
    from sgl_kvxfer.scheduler.int4_probe import resolve_engine_int4

    depths = [0.1, 0.5, 0.9] if args.quick else [round(0.05 * (i + 1), 2) for i in range(19)]
    budgets = args.budgets or ([0.3, 0.5] if args.quick else [0.3, 0.4, 0.5, 0.7])
    methods = args.methods or (["spectrumkv", "pdtrim"] if args.quick else list(METHODS))
    if args.quick and not args.max_total_tokens:
        args.max_total_tokens = 48000
    t0 = time.time()
    base, tiered = make_engines(args, {"kv_tier_budget": 0.5, "kv_int4": "on", "kv_tier_staging": 0.4})
    tiering, texts = tiered.scheduler.tiering, load_texts(args.prose)
    # The probe, through the tiered engine: 3 NIAH trials, greedy at cost budget 0.3, int4 on
    # (--kv-int4 auto; on / off skip it).
    with tempfile.TemporaryDirectory(prefix="int4_probe_") as fresh:
        res = resolve_engine_int4(tiering, tiered.scheduler, tiered.tokenizer, cache_dir=args.probe_cache or fresh,
                                  mode=args.kv_int4)
    probe = {"int4_enabled": res.enabled, "source": res.source,
             "outcomes": res.result.outcomes if res.result else None,
             "responses": res.result.responses if res.result else None}
    probe["tokens"] = tiered.runner.config.kv_int4_probe_tokens
    # is a failure the int4 tier's or the model's?
    probe["fp16_outcomes"] = probe_baseline(base, probe["tokens"]) if res.result else None
    print("probe:", probe, f"({time.time() - t0:.0f}s)", flush=True)
    per_depth = 1 if args.quick else args.trials_per_depth
    trials = build_trials(base.tokenizer, texts, depths, args.tokens, per_depth)
    ok, texts_fp16, _ = run_point(base, trials, "fp16")
    print("fp16:", sum(ok), "/", len(ok), flush=True)
    grid = {"fp16": {"1.0": ok}}
    rows, answers = [], {"fp16": texts_fp16}
    for method in methods:
        policy, int4 = METHODS[method]
        int4 = res.enabled if int4 is None else int4
        grid[method] = {}
        for b in budgets:
            t = time.time()
            with tiering.using(policy=policy, budget=b, unit=args.unit, int4_allowed=int4):
                ok, answers[f"{method}@{b}"], rids = run_point(tiered, trials, f"{method}-{b}")
            grid[method][str(b)] = ok
            rows.append({"method": method, "policy": policy, "int4": int4, "budget": b,
                         "accuracy": 100.0 * sum(ok) / len(ok), **tier_stats(tiering.records, rids)})
            print(f"{method:15s} b={b:.2f} acc {rows[-1]['accuracy']:5.1f}% mix "
                  f"{[round(f, 3) for f in rows[-1]['tier_fractions']]} ({time.time() - t:.0f}s)", flush=True)
    cos = kv_cosine(base, trials[len(trials) // 2]["ids"], tiered.runner.kv_pool.group_size)
    print("int4 cosine K %.4f V %.4f (mean over layers)" % (sum(cos["int4_k"]) / len(cos["int4_k"]),
                                                            sum(cos["int4_v"]) / len(cos["int4_v"])))
    payload = {**metadata(args, base, {"depths": depths, "budgets": budgets, "methods": methods,
                                       "trials_per_depth": per_depth}),
               "probe": probe, "fp16_accuracy": 100.0 * sum(grid["fp16"]["1.0"]) / len(trials),
               "results": rows, "grid": grid, "answers": answers, "kv_cosine": cos, "wall_s": time.time() - t0}
    path = write(args.out_dir, f"niah_{device_tag(base)}{'_quick' if args.quick else ''}", payload)
    print("wrote", path)
    return path


def plot(path: str) -> str:
    plt, data = load_for_plot(path)
    depths, budgets, methods = data["params"]["depths"], data["params"]["budgets"], data["params"]["methods"]
    fig, axes = plt.subplots(1, len(methods) + 1, figsize=(2.2 * len(methods) + 4.5, 4.2),
                             gridspec_kw={"width_ratios": [1] * len(methods) + [2]})
    fp16 = data["grid"]["fp16"]["1.0"]
    k = data["params"].get("trials_per_depth", 1)  # trials are depth-major: depth i = [i*k, (i+1)*k)
    for ax, method in zip(axes, methods):
        cols = [data["grid"][method][str(b)] for b in budgets] + [fp16]
        img = [[sum(col[i * k:(i + 1) * k]) / k for col in cols] for i in range(len(depths))]
        ax.imshow(img, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
        ax.set_xticks(range(len(budgets) + 1), [str(b) for b in budgets] + ["fp16"], fontsize=7)
        ax.set_yticks(range(len(depths)), [f"{d:.2f}" for d in depths], fontsize=6)
        ax.set_title(method, fontsize=9)
        ax.set_xlabel("budget", fontsize=8)
    axes[0].set_ylabel("needle depth")
    cos, ax = data["kv_cosine"], axes[-1]
    for key, style in (("int4_k", "-o"), ("int4_v", "-s"), ("int8_k", ":"), ("int8_v", ":")):
        ax.plot(cos[key], style, ms=3, label=key.replace("_", " ").upper())
    ax.set_xlabel("layer")
    ax.set_ylabel("cosine vs cached KV")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    p = data["probe"]
    fig.suptitle(f"NIAH {data['params']['tokens']} tokens x {k}/depth, SmolLM2-135M; "
                 f"probe@{p.get('tokens', 4096)} {p['outcomes']} "
                 f"(fp16 {p.get('fp16_outcomes')}) -> int4 "
                 f"{'on' if p['int4_enabled'] else 'off'}; fp16 acc {data['fp16_accuracy']:.0f}%; "
                 f"{data['device']} @ {data['commit'][:10]}", fontsize=8)
    return save_plot(fig, path)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap)
    ap.add_argument("--tokens", type=int, default=4096, help="user-message length in tokens")
    ap.add_argument("--trials-per-depth", type=int, default=3, help="trials (passcode + filler) per depth")
    ap.add_argument("--budgets", type=float, nargs="*", default=None)
    ap.add_argument("--methods", nargs="*", default=None, choices=list(METHODS))
    ap.add_argument("--unit", default="bytes", choices=["bytes", "cost"])
    ap.add_argument("--probe-cache", default=None, help="probe cache dir (default: a fresh one, so it runs)")
    ap.add_argument("--kv-int4", default="auto", choices=["auto", "on", "off"],
                    help="int4 for spectrumkv / sink-protect: auto runs the int4 probe (and its 3 trials on the "
                         "untiered engine) as an engine would; on / off skip it")
    args = ap.parse_args()
    run_then_plot(args, run, plot)


if __name__ == "__main__":
    main()
