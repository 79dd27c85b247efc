"""SCD quality: extractive-QA F1, held-out PPL, KL / TV against the oracle, per method and consumer;
rank sensitivity (F1 vs transferred bytes over an (r_K, r_V) grid, Pareto front).

    python benchmarks/quality/scd_eval.py --artifacts scd_artifacts/smollm2 [--quick]

Methods (benchmarks/quality/scd_harness.py): oracle (the consumer's own prefill), raw producer
KV, int4 producer KV (our tier codec, group 32), reuse (Reuse on every layer), droidspeak (raw
KV except the k layers most sensitive to raw reuse, recomputed by the consumer from the
producer's residual stream; k = the number of SCD patch layers), scd (Reuse + Patch).
QA: benchmarks/quality/scd_qa.py on the eval split (seeded). PPL / KL / TV: eval windows of
--ppl-prefix + --ppl-cont tokens, scored on the continuation. Reuse-only and the rank grid refit
from reuse_stats.safetensors (calibrate --save-stats). The grid stops at --time-budget-s.
Writes scd_eval_<device>.json (write_json) and .png into --out-dir.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from benchmarks.common.report import RESULTS_DIR, device_name, write_json  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifacts", required=True)
    ap.add_argument("--producer", default=None, help="producer model dir (default: the manifest's source)")
    ap.add_argument("--consumer", action="append", default=[], metavar="NAME=PATH",
                    help="consumer model dir or LoRA adapter (on the producer) (default: the manifest's sources)")
    ap.add_argument("--qa-per-corpus", type=int, default=150)
    ap.add_argument("--qa-seed", type=int, default=0)
    ap.add_argument("--max-new-tokens", type=int, default=12)
    ap.add_argument("--ppl-windows", type=int, default=12, help="per corpus")
    ap.add_argument("--ppl-prefix", type=int, default=512)
    ap.add_argument("--ppl-cont", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--grid-rk", default="4,8,16,32")
    ap.add_argument("--grid-rv", default="8,16,32,48")
    ap.add_argument("--grid-questions", type=int, default=100, help="QA items per grid point (a fixed subset)")
    ap.add_argument("--droid-k", type=int, default=None, help="DroidSpeak's recomputed layers (default: #patch layers)")
    ap.add_argument("--time-budget-s", type=float, default=300.0)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto", help="auto: bf16 on CUDA, float32 on CPU")
    ap.add_argument("--out-dir", default=RESULTS_DIR)
    ap.add_argument("--name", default=None, help="result name (default scd_eval_<device>)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (CPU smoke run)")
    args = ap.parse_args(argv)
    if args.quick:
        args.qa_per_corpus, args.ppl_windows, args.ppl_prefix, args.ppl_cont = 4, 1, 48, 16
        args.grid_rk, args.grid_rv, args.grid_questions, args.max_new_tokens = "4,8", "8", 4, 6
    return args


def main(argv=None) -> str:
    args = parse_args(argv)
    import torch
    from tqdm import tqdm

    from scd_harness import Harness
    from scd_qa import build_qa, f1
    from sgl_kvxfer.scd.calibrate import parse_consumer_arg
    from sgl_kvxfer.scd.data import corpus_path, read_texts, token_chunks

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    dtype = {"auto": torch.bfloat16 if device.startswith("cuda") else torch.float32, "bfloat16": torch.bfloat16,
             "float32": torch.float32}[args.dtype]
    t0, wall = time.perf_counter(), {}
    consumers = dict(parse_consumer_arg(c, args.producer) for c in args.consumer)
    h = Harness(args.artifacts, args.producer, consumers, device, dtype, args.droid_k)
    wall["load"] = time.perf_counter() - t0
    texts = {c: read_texts(corpus_path(c, "eval")) for c in ("code", "prose")}
    items = build_qa(texts, args.qa_per_corpus, args.qa_seed)
    prompts = h.qa_ids(items)

    t = time.perf_counter()
    bar = tqdm(total=len(prompts), desc="QA (all methods)", unit="q")
    answers = h.answer(prompts, h.methods, args.max_new_tokens, args.batch_size, progress=bar.update)
    bar.close()
    qa = {}
    for (cons, meth), outs in answers.items():
        scores = [f1(o, it.answer) for o, it in zip(outs, items)]
        by = {c: [s for s, it in zip(scores, items) if it.corpus == c] for c in texts}
        qa.setdefault(cons, {})[meth] = {"f1": _mean(scores), **{f"f1_{c}": _mean(v) for c, v in by.items()},
                                         "examples": [{"q": it.question, "answer": it.answer, "pred": o}
                                                      for o, it in list(zip(outs, items))[:3]]}
    wall["qa"] = time.perf_counter() - t

    t = time.perf_counter()
    windows = []
    for c in texts:
        windows += token_chunks(h.tokenizer, texts[c], args.ppl_prefix + args.ppl_cont, args.ppl_windows,
                                seed=args.qa_seed, max_per_doc=1)
    bar = tqdm(total=len(windows), desc="PPL / KL / TV", unit="window")
    acc = h.score(windows, args.ppl_prefix, h.methods, max(1, args.batch_size // 2), progress=bar.update)
    bar.close()
    ppl = {}
    for (cons, meth), a in acc.items():
        n = max(1, a["tokens"])
        ppl.setdefault(cons, {})[meth] = {"ppl": math.exp(a["nll_sum"] / n), "kl": a["kl_sum"] / n,
                                          "tv": a["tv_sum"] / n, "tokens": a["tokens"]}
    wall["ppl"] = time.perf_counter() - t

    sub = grid_subset(len(items), args.grid_questions)
    grid, skipped = rank_grid(h, args, items, prompts, f1, t0, sub)
    wall["grid"] = time.perf_counter() - t - wall["ppl"]
    wall["total"] = time.perf_counter() - t0
    bpt = h.bytes_per_token()
    mean_f1 = {meth: _mean([qa[c][meth]["f1"] for c in qa]) for meth in h.methods}
    # the same methods on the grid's question subset (the Pareto panel compares like with like)
    sub_f1 = {meth: _mean([_mean([f1(answers[(c, meth)][i], items[i].answer) for i in sub]) for c in qa])
              for meth in h.methods}
    payload = {
        "device": device_name(device), "torch_device": device, "dtype": str(dtype).replace("torch.", ""),
        "params": vars(args), "artifacts": os.path.abspath(args.artifacts),
        "manifest": {k: v for k, v in h.m.to_dict().items() if k not in ("producer", "consumers")},
        "models": {"producer": h.m.producer.to_dict(), "consumers": [c.to_dict() for c in h.m.consumers]},
        "protocol": "producer prefills prompt[:-1]; the method builds the consumer's prefix cache; the consumer "
                    "runs prompt[-1] and decodes greedily (QA) / scores the continuation (PPL, KL/TV vs oracle)",
        "qa_items": len(items), "qa_kinds": _count([f"{it.corpus}/{it.kind}" for it in items]),
        "droidspeak_layers": list(h.droid_layers), "bytes_per_token": bpt,
        "f1_mean_over_consumers": mean_f1,
        "scd_f1_vs_oracle": mean_f1["scd"] / mean_f1["oracle"] if mean_f1["oracle"] else None,
        "qa": qa, "ppl": ppl, "rank_grid": grid, "rank_grid_skipped": skipped,
        "rank_grid_questions": len(sub), "f1_on_grid_subset": sub_f1,
        "wall_s": {k: round(v, 2) for k, v in wall.items()},
    }
    name = args.name or f"scd_eval_{payload['device'].split(' (')[0].replace(' ', '_')}"
    path = write_json(name, payload, args.out_dir)
    plot(payload, path[:-5] + ".png")
    print(f"F1 (mean over consumers): " + ", ".join(f"{k} {v:.3f}" for k, v in mean_f1.items()))
    print(f"wrote {path}")
    return path


def grid_subset(n: int, k: int) -> list[int]:
    """k of n question indices, evenly strided (the items are grouped by corpus)."""
    k = max(1, min(k, n))
    return [int(i * n / k) for i in range(k)]


def rank_grid(h, args, items, prompts, f1, t0, sub):
    """Full SCD (calibrated patch layers + aligners) with Reuse refitted at each (r_k, r_v)."""
    from sgl_kvxfer.scd import ScdDecoder, ScdEncoder

    if h.stats is None:
        return [], ["no reuse_stats.safetensors (calibrate --save-stats)"]
    grid, skipped = [], []
    for rk in (int(x) for x in args.grid_rk.split(",")):
        for rv in (int(x) for x in args.grid_rv.split(",")):
            if time.perf_counter() - t0 > args.time_budget_s or rk > h.m.head_dim or rv > h.m.head_dim:
                skipped.append(f"r_k={rk},r_v={rv}")
                continue
            art = h.refit(rk, rv)
            enc = ScdEncoder(art)
            decs = {c.name: ScdDecoder(art, c.name) for c in h.consumers}
            res = h.answer([prompts[i] for i in sub], ["scd"], args.max_new_tokens, args.batch_size,
                           variant=lambda c: (enc, decs[c.name]))
            scores = [_mean([f1(o, items[i].answer) for o, i in zip(outs, sub)]) for outs in res.values()]
            grid.append({"r_k": rk, "r_v": rv, "bytes_per_token": art.manifest.bytes_per_token, "f1": _mean(scores),
                         "questions": len(sub)})
    front, best = [], -1.0
    for g in sorted(grid, key=lambda g: (g["bytes_per_token"], -g["f1"])):
        if g["f1"] > best:
            best = g["f1"]
            front.append(g)
    for g in grid:
        g["pareto"] = g in front
    return grid, skipped


def plot(p: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    meths = list(p["f1_mean_over_consumers"])
    cons = list(p["qa"])
    w = 0.8 / max(1, len(cons))
    for j, c in enumerate(cons):
        a.bar([i + j * w for i in range(len(meths))], [p["qa"][c][m]["f1"] for m in meths], w, label=c)
    a.set_xticks([i + w * (len(cons) - 1) / 2 for i in range(len(meths))], meths)
    a.set_ylabel("extractive QA F1")
    a.set_title(f"{p['qa_items']} questions, consumer = specialist", fontsize=9)
    a.legend(fontsize=8)
    if p["rank_grid"]:
        g = p["rank_grid"]
        b.scatter([x["bytes_per_token"] for x in g], [x["f1"] for x in g], c="gray", s=18, label="SCD (r_K, r_V) grid")
        front = sorted((x for x in g if x["pareto"]), key=lambda x: x["bytes_per_token"])
        b.plot([x["bytes_per_token"] for x in front], [x["f1"] for x in front], "o-", mfc="none", c="C0",
               label="Pareto front")
        for x in front:
            b.annotate(f"({x['r_k']},{x['r_v']})", (x["bytes_per_token"], x["f1"]), fontsize=7)
    bpt, f1m = p["bytes_per_token"], p["f1_on_grid_subset"]
    for m in meths:
        if m != "oracle":
            b.scatter([bpt[m]], [f1m[m]], marker="x", s=40, label=m)
    b.axhline(f1m["oracle"], ls="--", c="k", lw=1, label="oracle")
    b.set_xscale("log")
    b.set_xlabel("bytes transferred per token")
    b.set_ylabel(f"F1 (mean over consumers), {p['rank_grid_questions']} questions")
    b.legend(fontsize=7)
    fig.suptitle(f"SCD on {p['device']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _mean(x):
    x = list(x)
    return sum(x) / len(x) if x else 0.0


def _count(xs):
    out = {}
    for x in xs:
        out[x] = out.get(x, 0) + 1
    return out


if __name__ == "__main__":
    main()
