"""Does int4 on the asked line cost more than int4 on as many other tokens? A check of a kv bed.

    python benchmarks/quality/int4_needle_probe.py [--model DIR] --context 1024 --items 24 \
        --beds 3:0 8:2 [--value-digits 10] [--device cpu] [--out probe.json]

A bed is NEAR_KEYS:NEAR_VALUES of the task suite's `kv` task (sgl_kvxfer/tasks/retrieval.py).
For each item (eval split, seeded, depths spread evenly over [0, 1]) the prompt under the chat
template, but its last token, is prefilled once with the engine's own model code
(sgl_kvxfer/scd/calib/forward.py); then the last prompt token, the answer and the end of turn
are fed over that cache (teacher forcing) with the cache's K/V at the codec's int4 (group =
head_dim, the engine default; the first --sinks tokens exact) on:

    fp16             nothing
    int4-needle      the asked "KEY: VALUE" line's tokens only
    int4-random      as many tokens, a random run elsewhere (not the line, not the sinks)
    int4-all         every token
    int4-all-but-needle  every token but the asked line (what a ranking that finds the line keeps)

and scores the answer: `em` (every answer token and the end of turn the argmax: what greedy
decoding returns exactly) and `nll` (mean over those tokens). A bed punishes int4 on the right
tokens when int4-needle costs more than int4-random, and int4-all more than int4-all-but-needle.
The JSON (rewritten after every bed) holds every item's numbers and a per-bed summary.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

CONDITIONS = ("fp16", "int4-needle", "int4-random", "int4-all", "int4-all-but-needle")


def parse_bed(text: str) -> tuple[int, int]:
    try:
        near_keys, near_values = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a bed is NEAR_KEYS:NEAR_VALUES (ints), got {text!r}") from None
    if not (0 <= near_keys <= 16 and 0 <= near_values <= 11):
        raise argparse.ArgumentTypeError(f"near keys in [0, 16] and near values in [0, 11], got {text!r}")
    return near_keys, near_values


def masks(n: int, span: tuple[int, int], sinks: int, rng: random.Random) -> dict[str, torch.Tensor]:
    """Condition -> bool [n]: which cached positions are int4."""
    lo, hi = span
    width = hi - lo
    needle = torch.zeros(n, dtype=torch.bool)
    needle[lo:hi] = True
    # a run of the same width elsewhere: a start whose run misses the sinks and the line
    starts = [s for s in range(sinks, n - width + 1) if s + width <= lo or s >= hi]
    other = torch.zeros(n, dtype=torch.bool)
    if starts:
        s = rng.choice(starts)
        other[s:s + width] = True
    body = torch.arange(n) >= sinks
    return {"fp16": torch.zeros(n, dtype=torch.bool), "int4-needle": needle, "int4-random": other,
            "int4-all": body, "int4-all-but-needle": body & ~needle}


@torch.no_grad()
def score_item(runner, prompt: list[int], answer: list[int], span, sinks: int, group: int,
               rng: random.Random) -> dict[str, dict]:
    from sgl_kvxfer.scd.calib.forward import KVCache, left_pad
    from sgl_kvxfer.spectrum.layer_budget import LOW
    from sgl_kvxfer.spectrum_calib.layer_profile import roundtrip

    ctx, feed = prompt[:-1], [prompt[-1], *answer[:-1]]
    ids, valid, pos = left_pad([ctx], device=runner.device)
    cache, _ = runner.prefill_cache(ids, pos, valid)
    low_k = [roundtrip(k, LOW, True, group, 64) for k in cache.k]
    low_v = [roundtrip(v, LOW, False, group, 64) for v in cache.v]
    cids = torch.tensor([feed], device=runner.device)
    cpos = torch.arange(len(ctx), len(ctx) + len(feed), device=runner.device)[None]
    cvalid = torch.ones_like(cids, dtype=torch.bool)
    gold = torch.tensor(answer, device=runner.device)
    out = {}
    for name, m in masks(len(ctx), span, sinks, rng).items():
        sel = m.to(runner.device)[None, :, None, None]
        ks = [torch.where(sel, lk, k) for lk, k in zip(low_k, cache.k)]
        vs = [torch.where(sel, lv, v) for lv, v in zip(low_v, cache.v)]
        logits = runner.forward(cids, cpos, cvalid, past=KVCache(ks, vs, valid), logits="all").logits[0].float()
        logp = torch.log_softmax(logits, -1)
        out[name] = {"em": bool((logits.argmax(-1) == gold).all()),
                     "nll": float(-logp.gather(1, gold[:, None]).mean())}
    return out


def summarize(rows: list[dict]) -> dict:
    s = {}
    for c in CONDITIONS:
        ems = [r[c]["em"] for r in rows]
        s[c] = {"em_pct": 100.0 * sum(ems) / max(1, len(ems)),
                "nll": sum(r[c]["nll"] for r in rows) / max(1, len(rows))}
    base = s["fp16"]["nll"]
    s["nll_cost_needle_minus_random"] = s["int4-needle"]["nll"] - s["int4-random"]["nll"]
    s["em_gain_keeping_needle"] = s["int4-all-but-needle"]["em_pct"] - s["int4-all"]["em_pct"]
    s["nll_cost_int4_all"] = s["int4-all"]["nll"] - base
    return s


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model dir (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--beds", nargs="+", type=parse_bed, default=[(3, 0), (8, 2)], metavar="NEAR_KEYS:NEAR_VALUES")
    ap.add_argument("--value-digits", type=int, default=10)
    ap.add_argument("--context", type=int, default=1024, help="context tokens of each item")
    ap.add_argument("--items", type=int, default=24, help="items per bed (depths spread over [0, 1])")
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda"))
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--out", default=None, help="JSON to write (default: none)")
    args = ap.parse_args(argv)
    if not 4 <= args.value_digits <= 12:
        ap.error("--value-digits must be in [4, 12]")
    if not 64 <= args.context <= 32768 or not 1 <= args.items <= 10000 or not 0 <= args.sinks <= 64 \
            or not 0 <= args.seed < 2 ** 31:
        ap.error("--context in [64, 32768], --items in [1, 10000], --sinks in [0, 64], --seed in [0, 2**31)")
    if any(nv >= args.value_digits for _, nv in args.beds):
        ap.error("a bed's near values must be fewer than --value-digits")
    from sgl_kvxfer import tasks
    from sgl_kvxfer.models.loader import load_model, load_tokenizer, resolve_model_path, resolve_tokenizer_path
    from sgl_kvxfer.scd.calib.forward import LlamaRunner
    from retrieval_tiers import needle_span

    model_dir = resolve_model_path(args.model)
    model, arch = load_model(model_dir, "auto", getattr(torch, args.dtype), args.device, 0)
    tok = load_tokenizer(resolve_tokenizer_path(model_dir))
    runner = LlamaRunner(model)
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    t0 = time.time()
    result = {"model": model_dir, "device": args.device, "dtype": args.dtype, "context": args.context,
              "value_digits": args.value_digits, "items": args.items, "sinks": args.sinks,
              "group_size": arch.head_dim, "argv": sys.argv[1:] if argv is None else argv, "beds": {}}
    for near_keys, near_values in args.beds:
        rng, rows = random.Random(args.seed), []
        for i in range(args.items):
            depth = i / max(1, args.items - 1)
            ex = tasks.generate("kv", "eval", 1, seed=args.seed, tokenizer=tok, start=i,
                                context_tokens=args.context, depth=depth, value_digits=args.value_digits,
                                near_keys=near_keys, near_values=near_values)[0]
            prompt = tasks.chat_prompt_ids(tok, ex)
            span = needle_span(tok, prompt, ex)
            if span is None:
                continue
            answer = tok(ex.answer, add_special_tokens=False)["input_ids"] + eos
            rows.append({"depth": ex.meta["depth"], "span": list(span),
                         **score_item(runner, prompt, answer, span, args.sinks, arch.head_dim, rng)})
        key = f"{near_keys}:{near_values}"
        result["beds"][key] = {"near_keys": near_keys, "near_values": near_values, "rows": rows,
                               "summary": summarize(rows)}
        s = result["beds"][key]["summary"]
        print(f"bed {key} ({len(rows)} items): " + "  ".join(
            f"{c} em {s[c]['em_pct']:.0f}% nll {s[c]['nll']:.3f}" for c in CONDITIONS), flush=True)
        print(f"  int4 on the line minus int4 on as many other tokens: nll {s['nll_cost_needle_minus_random']:+.3f}; "
              f"keeping the line out of int4-all: em {s['em_gain_keeping_needle']:+.1f} points", flush=True)
        result["wall_s"] = round(time.time() - t0, 1)
        if args.out:  # after every bed: a run cut short keeps the beds it finished
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
            print(f"-> {args.out}", flush=True)
    return result


if __name__ == "__main__":
    main()
