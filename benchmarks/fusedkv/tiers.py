"""FusedKV under SpectrumKV tiers: resident KV bytes and perplexity at each tier budget, for a
FusedKV model and the vanilla model it was converted from, through the engine.

FusedKV stores the bottom half of the layers' KV; SpectrumKV stores those tokens at fp16 / int8
/ int4 within a byte budget b. The two compose: at b = 0.5 the resident KV is about half of
FusedKV's fp16 pool, a quarter of the vanilla model's (the target: 0.25x).

Protocol (benchmarks/quality/ppl_sweep.py's compressed prefix): per window of the eval text,
request 1 prefills `--context` tokens (max_new_tokens=0; the scheduler tiers them at b and the
radix cache keeps them), request 2 sends context + `--continuation` tokens with
logprob_start_len = context, so only the continuation is scored, over the tiered prefix.
PPL = exp(mean NLL). Resident bytes: /get_server_info's kv_bytes_per_token after the context
prefills, over the vanilla model's fp16 (model dtype) bytes per token. Decode speed (--decode-batch
> 0): that many random prompts of --decode-context tokens, prefilled (and tiered) once, then
decode_timing.measure_tpot (warm-up, >= 5 (n1, n2) pairs, median step and spread) in the same engine.
Eval text: --eval-data (jsonl, tokenized by the model's tokenizer) or --eval-tokens (a token file of
sgl_kvxfer/fusedkv/data.py made with the same tokenizer).

    python benchmarks/fusedkv/tiers.py --fusedkv-model DIR --eval-tokens .cache/fusedkv/prose_eval.u16.xz \
        --device cuda                                                   # a converted model (docs/fusedkv.md)
    python benchmarks/fusedkv/tiers.py --smoke                          # CPU: random tiny models, dummy weights
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common.report import device_name, git_commit, write_json  # noqa: E402
from decode_timing import kernel_breakdown, measure_tpot, random_prompts  # noqa: E402

SMOKE = ["--base-model", "@tiny", "--fusedkv-model", "@tiny", "--load-format", "dummy", "--device", "cpu",
         "--dtype", "float32", "--context", "64", "--continuation", "16", "--windows", "2", "--decode-batch", "2",
         "--decode-context", "48", "--n1", "2", "--n2", "6", "--kernel-breakdown"]


def tiny_models(root: str) -> tuple[str, str]:
    """A vanilla and a FusedKV model dir of the `tiny` preset (dummy weights, random token text)."""
    from sgl_kvxfer.models.presets import PRESETS, write_dummy_tokenizer, write_preset_config

    dirs = []
    for name, section in (("vanilla", None), ("fusedkv", {"variant": "fusedkv"})):
        d = write_preset_config("tiny", os.path.join(root, name))
        if section:
            path = os.path.join(d, "config.json")
            with open(path) as f:
                cfg = json.load(f)
            with open(path, "w") as f:
                json.dump({**cfg, "fusedkv": section}, f)
        dirs.append(write_dummy_tokenizer(d, PRESETS["tiny"]["vocab_size"]))
    return dirs[0], dirs[1]


def windows(tokenizer, path: str | None, size: int, count: int, vocab: int, tokens: str | None = None) -> list[list[int]]:
    """`count` non-overlapping windows of `size` tokens of the eval text (random ids without one)."""
    if tokens is not None:
        import lzma

        import numpy as np

        with open(tokens, "rb") as f:
            ids = np.frombuffer(lzma.decompress(f.read()), dtype=np.uint16 if ".u16." in tokens else np.uint32)
        out = [ids[i:i + size].tolist() for i in range(0, ids.size - size + 1, size)][:count]
        if len(out) < count:
            raise SystemExit(f"{tokens}: {len(out)} windows of {size} tokens, {count} asked")
        return out
    if path is None:
        g = torch.Generator().manual_seed(0)
        return torch.randint(3, vocab, (count, size), generator=g).tolist()
    out = []
    with open(path) as f:
        for line in f:
            ids = tokenizer.encode(json.loads(line)["text"])
            out += [ids[i:i + size] for i in range(0, len(ids) - size + 1, size)]
            if len(out) >= count:
                return out[:count]
    if not out:
        raise SystemExit(f"{path}: no text of {size} tokens")
    return out


def score(engine, wins: list[list[int]], context: int, tag: str) -> dict:
    engine.flush_cache()
    engine.generate(input_ids=[w[:context] for w in wins], sampling_params={"max_new_tokens": 0},
                    rid=[f"{tag}-ctx-{i}" for i in range(len(wins))])
    info = engine.get_server_info()
    outs = engine.generate(input_ids=wins, sampling_params={"max_new_tokens": 0}, return_logprob=True,
                           logprob_start_len=context, rid=[f"{tag}-cont-{i}" for i in range(len(wins))])
    nll, n, cached = 0.0, 0, []
    for o in outs:
        lps = [e[0] for e in o["meta_info"]["input_token_logprobs"] if e[0] is not None]
        nll, n = nll - sum(lps), n + len(lps)
        cached.append(o["meta_info"]["cached_tokens"])
    extra = info.get("extra") or {}
    if min(cached) < context:
        print(f"WARNING {tag}: a context was not a full radix hit (cached {min(cached)} of {context})", flush=True)
    return {"ppl": math.exp(nll / max(n, 1)), "scored_tokens": n, "cached_tokens_min": min(cached),
            "full_prefix_hits": min(cached) >= context,
            "kv_bytes_per_token": float(info["kv_bytes_per_token"]),
            "kv_vanilla_bytes_per_token": (extra.get("fusedkv") or {}).get("kv_vanilla_bytes_per_token"),
            "kv_tier_slots": extra.get("kv_tier_slots")}


def run(args, base_dir: str, fkv_dir: str, on_row) -> dict:
    """Every (model, budget) row; on_row(result so far) after each (a stage cut off by its timeout
    keeps the rows that finished)."""
    from sgl_kvxfer import Engine

    rows, wins = [], None
    for name, model_dir in (("vanilla", base_dir), ("fusedkv", fkv_dir)):
        for budget in args.budgets:
            # a tiered pool stages new tokens in an fp16 store of ~1/4 of its memory: room for
            # every window there, so no cached context is evicted before it is scored
            kw = dict(load_format=args.load_format, dtype=args.dtype, device=args.device,
                      max_total_tokens=4 * max(args.windows * (args.context + args.continuation + 64),
                                               args.decode_batch * (args.decode_context + args.n2 + 192)) + 4096,
                      chunked_prefill_size=args.context)
            if args.attention_backend:
                kw["attention_backend"] = args.attention_backend
            if args.device != "cpu":  # decode graphs for the timed batch only: each engine captures its own
                kw["cuda_graph_max_bs"] = max(1, args.decode_batch)
            if budget < 1.0:
                kw.update(kv_tier_budget=budget, kv_int4=args.kv_int4, kv_tier_policy=args.kv_tier_policy)
            t0 = time.perf_counter()
            with Engine(model_dir, **kw) as engine:
                if wins is None:
                    wins = windows(engine.tokenizer, args.eval_data, args.context + args.continuation, args.windows,
                                   engine.runner.arch.vocab_size, args.eval_tokens)
                r = score(engine, wins, args.context, f"{name}-{budget}")
                if args.decode_batch:
                    prompts = random_prompts(args.decode_batch, args.decode_context, engine.runner.arch.vocab_size, 11)
                    engine.flush_cache()
                    engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 1})
                    r["decode"] = {"batch": args.decode_batch, "context": args.decode_context,
                                   **measure_tpot(engine, prompts, args.n1, args.n2, args.repeats)}
                    if args.kernel_breakdown:
                        r["decode"]["kernels"] = k = kernel_breakdown(engine, prompts, args.n1, args.n2,
                                                                      args.device != "cpu")
                        print(f"{name} b={budget:g} per step: " + ", ".join(
                            f"{g} {s * 1e6:.0f} us" for g, s in k["groups_s"].items()), flush=True)
            r["row_s"] = time.perf_counter() - t0
            rows.append({"model": name, "kv_tier_budget": budget, **r})
            tpot = (r.get("decode") or {}).get("tpot_s")
            print(f"{name} b={budget:g}: PPL {r['ppl']:.3f}, {r['kv_bytes_per_token']:.0f} B/token"
                  + (f", TPOT {tpot * 1e3:.2f} ms at batch {args.decode_batch} x {args.decode_context}" if tpot else "")
                  + f" ({r['row_s']:.1f} s)", flush=True)
            on_row(derive(rows, len(wins)))
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return derive(rows, len(wins))


def derive(rows: list[dict], n_windows: int) -> dict:
    """Ratios of every row against the vanilla model at b = 1.0 (in place) and the result."""
    vanilla_fp16 = next((r["kv_bytes_per_token"] for r in rows if r["model"] == "vanilla" and r["kv_tier_budget"] == 1.0),
                        None)
    if vanilla_fp16 is None:  # no b = 1.0 run: the FusedKV engine reports what the vanilla pool takes
        vanilla_fp16 = next((r["kv_vanilla_bytes_per_token"] for r in rows if r["kv_vanilla_bytes_per_token"]), None)
    base_ppl = {r["kv_tier_budget"]: r["ppl"] for r in rows if r["model"] == "vanilla"}
    base_tpot = next(((r.get("decode") or {}).get("tpot_s") for r in rows
                      if r["model"] == "vanilla" and r["kv_tier_budget"] == 1.0), None)
    for r in rows:
        if vanilla_fp16:
            r["resident_vs_vanilla_fp16"] = r["kv_bytes_per_token"] / vanilla_fp16
        if 1.0 in base_ppl:
            r["ppl_vs_vanilla_fp16_pct"] = 100 * (r["ppl"] - base_ppl[1.0]) / base_ppl[1.0]
        tpot = (r.get("decode") or {}).get("tpot_s")
        if tpot and base_tpot:
            r["tpot_vs_vanilla_fp16"] = tpot / base_tpot
    return {"rows": rows, "vanilla_fp16_bytes_per_token": vanilla_fp16, "windows": n_windows}


def plot(path_png: str, title: str, rows: list[dict]) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for i, name in enumerate(("vanilla", "fusedkv")):
        pts = sorted((r["resident_vs_vanilla_fp16"], r["ppl"], r["kv_tier_budget"]) for r in rows if r["model"] == name)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=f"C{i}", label=name)
        for x, y, b in pts:
            ax.annotate(f"b={b:g}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xlabel("resident KV bytes / vanilla fp16")
    ax.set_ylabel("continuation PPL")
    ax.legend()
    ax.set_title(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path_png, dpi=120)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="CPU smoke run: " + " ".join(SMOKE))
    p.add_argument("--fusedkv-model", help="FusedKV model dir (e.g. build_model.py's output); @tiny: random")
    p.add_argument("--base-model", default="smollm2-135m", help="the vanilla model it came from; @tiny: random")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--eval-data", default=None, help="jsonl with a 'text' field (none: random ids)")
    p.add_argument("--eval-tokens", default=None, help="a token file (.u16.xz / .u32.xz) of the model's tokenizer")
    p.add_argument("--decode-batch", type=int, default=8, help="decode timing: requests (0: none)")
    p.add_argument("--decode-context", type=int, default=2048)
    p.add_argument("--n1", type=int, default=8)
    p.add_argument("--n2", type=int, default=40)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--kernel-breakdown", action="store_true",
                   help="also profile the decode step: device time per kernel and kernel group (torch.profiler)")
    p.add_argument("--budgets", type=float, nargs="+", default=[1.0, 0.5])
    p.add_argument("--kv-tier-policy", default="greedy")
    p.add_argument("--kv-int4", default="on", help="on: int4 allowed (no start-up probe); auto: the probe decides")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--continuation", type=int, default=128)
    p.add_argument("--windows", type=int, default=32)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--attention-backend", default=None)
    p.add_argument("--out-dir", default=None)
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv)
    if args.smoke:
        args = p.parse_args(SMOKE + [a for a in argv if a != "--smoke"])
        args.smoke = True
    if not args.fusedkv_model:
        p.error("--fusedkv-model is required (or --smoke)")
    if args.decode_batch < 0 or not 1 <= args.n1 < args.n2 or args.repeats < 5:
        p.error("need --decode-batch >= 0, 1 <= --n1 < --n2, --repeats >= 5")
    from common.report import triton_interpreter_for

    triton_interpreter_for(args.device)
    device = device_name(args.device)
    tag = "cpu" if args.device == "cpu" else device.split(" (")[0].replace(" ", "_")
    name = "tiny" if args.smoke else os.path.basename(os.path.normpath(args.fusedkv_model))
    state = {"result": {"rows": []}, "path": None}

    def save(result: dict, partial: bool = True) -> None:
        state["result"] = result
        payload = {"benchmark": "fusedkv_tiers", "device": device, "commit": git_commit(), "params": vars(args),
                   "target_resident_vs_vanilla_fp16_at_b05": 0.25, "partial": partial, **result}
        state["path"] = write_json(f"fusedkv_tiers_{name}_{tag}", payload, args.out_dir)

    try:
        with tempfile.TemporaryDirectory(prefix="fusedkv_tiers_") as root:
            base, fkv = args.base_model, args.fusedkv_model
            if "@tiny" in (base, fkv):
                base, fkv = tiny_models(root)
            save(run(args, base, fkv, save), partial=False)
    except KeyboardInterrupt:
        print("interrupted: writing the rows that finished", flush=True)
        save(state["result"])
    path = state["path"]
    print("wrote", path)
    rows = [r for r in state["result"]["rows"] if "resident_vs_vanilla_fp16" in r]
    if rows and plot(path[:-5] + ".png", f"FusedKV x SpectrumKV tiers, {name}, {device}", rows):
        print("wrote", path[:-5] + ".png")
    return path

if __name__ == "__main__":
    main()
