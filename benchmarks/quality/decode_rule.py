"""Justifies the decode-token rule (sgl_kvxfer/scheduler/tier_decode.py): demote generated tokens
older than the newest R, versus never demoting them, at the same prefill budget.

    python benchmarks/quality/decode_rule.py --quick
    python benchmarks/quality/decode_rule.py --device cuda

For each prompt (a prose prefix), greedy-decode N tokens with: the untiered engine (reference),
the tiered engine with demotion at R (default 64, and R = 16 as a stress point), and the tiered
engine with demotion off (R larger than N). Reported per variant: agreement of the generated
tokens with the reference (position-wise, and the first divergence), the NLL of the variant's
own text scored by the untiered engine (does the text stay as likely?), the first position where
it departs from the no-demotion run (same prefill tiers: isolates the decode rule), and the
resident KV of the finished sequence (cached prompt + generated tokens at their tiers) over fp16.
"""
from __future__ import annotations

import argparse
import time

from _harness import add_common_args, device_tag, load_texts, make_engines, metadata, write


def nll_under(engine, prompt, gen) -> float:
    engine.flush_cache()
    out = engine.generate(input_ids=prompt + gen, sampling_params={"max_new_tokens": 0}, return_logprob=True,
                          logprob_start_len=len(prompt) - 1)
    lps = [e[0] for e in out["meta_info"]["input_token_logprobs"] if e[0] is not None]
    return -sum(lps) / len(lps)


def resident_ratio(engine, ids) -> float:
    from sgl_kvxfer.spectrum.budget import assignment_bytes, fp16_bytes

    tree = engine.scheduler.kv.tree
    slots, node = tree.match_prefix(ids)
    tiers = tree.match_tiers(node)
    layout = engine.scheduler.tiering.layout
    return assignment_bytes(tiers, layout) / fp16_bytes(tiers.numel(), layout)


def run(args) -> str:
    n_prompts, n_new = (2, 48) if args.quick else (8, 256)
    n_prompts, n_new = args.prompts or n_prompts, args.new_tokens or n_new
    if args.quick and not args.max_total_tokens:
        args.max_total_tokens = 20000
    base, tiered = make_engines(args, {"kv_tier_budget": args.budget, "kv_int4": "on"})
    tok = base.tokenizer
    prompts = [tok.encode(t)[: args.prompt_tokens] for t in load_texts(args.prose)[: n_prompts * 3]
               if len(tok.encode(t)) > args.prompt_tokens][:n_prompts]
    sp = {"max_new_tokens": n_new, "temperature": 0, "ignore_eos": True}
    t0 = time.time()
    base.flush_cache()
    ref = [o["output_ids"] for o in base.generate(input_ids=prompts, sampling_params=sp)]
    variants = {"no demotion": 10 ** 9, "demote R=64": 64, "demote R=16": 16}
    rows, tiering, kept = [], tiered.scheduler.tiering, None
    for name, recent in variants.items():
        tiered.flush_cache()
        with tiering.using(budget=args.budget, decode_recent=recent):
            gens = [o["output_ids"] for o in tiered.generate(input_ids=prompts, sampling_params=sp)]
            resident = [resident_ratio(tiered, p + g[:-1]) for p, g in zip(prompts, gens)]
        kept = kept or gens  # "no demotion" runs first: the same prefill tiers, no decode demotion
        agree = [sum(a == b for a, b in zip(g, r)) / len(r) for g, r in zip(gens, ref)]
        first = [next((i for i, (a, b) in enumerate(zip(g, r)) if a != b), len(r)) for g, r in zip(gens, ref)]
        same = [next((i for i, (a, b) in enumerate(zip(g, k)) if a != b), len(k)) for g, k in zip(gens, kept)]
        nll = [nll_under(base, p, g) for p, g in zip(prompts, gens)]
        rows.append({"variant": name, "recent": recent, "agreement": sum(agree) / len(agree),
                     "first_divergence_mean": sum(first) / len(first), "nll_under_fp16": sum(nll) / len(nll),
                     "resident_ratio": sum(resident) / len(resident), "per_prompt_agreement": agree,
                     "first_divergence_vs_no_demotion": sum(same) / len(same)})
        print(f"{name:12s} agree {rows[-1]['agreement']:.3f} first-div {rows[-1]['first_divergence_mean']:.1f} "
              f"vs-no-demotion first-div {rows[-1]['first_divergence_vs_no_demotion']:.1f} "
              f"NLL {rows[-1]['nll_under_fp16']:.4f} resident {rows[-1]['resident_ratio']:.3f}", flush=True)
    ref_nll = sum(nll_under(base, p, g) for p, g in zip(prompts, ref)) / len(prompts)
    print(f"reference NLL {ref_nll:.4f}")
    payload = {**metadata(args, base, {"prompts": len(prompts), "new_tokens": n_new}), "reference_nll": ref_nll,
               "results": rows, "wall_s": time.time() - t0}
    path = write(args.out_dir, f"decode_rule_{device_tag(base)}{'_quick' if args.quick else ''}", payload)
    print("wrote", path)
    return path


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap)
    ap.add_argument("--budget", type=float, default=0.5)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--prompts", type=int, default=None, help="default 8 (quick 2)")
    ap.add_argument("--new-tokens", type=int, default=None, help="default 256 (quick 48)")
    args = ap.parse_args()
    if not args.plot_only:
        run(args)


if __name__ == "__main__":
    main()
