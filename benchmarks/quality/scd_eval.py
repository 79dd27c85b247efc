"""SCD quality on the task suite: one table at matched bytes per token, the rank sweep's Pareto
front, per-layer drift of each specialist, and bandwidth-adaptive rank choice vs fixed ranks.

    python benchmarks/quality/scd_eval.py --artifacts DIR [--n 100] [--rates 1 5 25 100 200]
        [--consumer-tasks qa=qa,kv=kv,code=code] [--task-param kv.context_tokens=1024] [--quick]

Each consumer (a specialist) is scored on its task's eval split (sgl_kvxfer/tasks; default: the
task named like the consumer) by every method of benchmarks/quality/scd_harness.py: oracle (its
own prefill), base (the producer answering itself), raw producer KV, int8 / int4 producer KV,
Reuse-only, DroidSpeak (raw KV, the k layers most sensitive to raw reuse recomputed; k = the
SCD patch count), SCD; the diagnostic scd-oracle-patch (SCD's Reuse layers, its Patch layers
restored to the consumer's own K/V: the bound of perfect aligners; --no-diagnostics leaves it
out; marked "diagnostic", no bytes per token, left out of the Pareto front and the matched-bytes
rows); then SCD and Reuse-only at every lower nested rank level of the
artifacts (calibrate --rank-levels), and at every level with their codes quantised on the wire
(--code-quant: "scd:int4@16:48", ...; the rank sweep, one consumer at a time, each started only
when the time its methods took says it ends within --time-budget-s). Per method: task score, KL and top-1
agreement against the oracle on the gold answer tokens, bytes per token, rebuild time.

The JSON is rewritten after each consumer's methods and each consumer's sweep; SIGINT (`timeout -s
INT`) writes what finished, marked "interrupted", and exits 130.

Adaptive codes: per eval item and link rate, TTFT = the producer's prefill + wire time of the
level's bytes + the level's rebuild + the consumer's first step, from batch-1 timings measured
here (scaled by prompt length); the adaptive policy (sgl_kvxfer/scd/rank_policy.py) picks a
level per item, each fixed policy always sends its level; with --min-level R_K:R_V also the
policy with that floor (--scd-min-rank), as `adaptive_floor`; with artifacts whose manifest holds
the calibration's level agreement, also the policy with `--scd-min-rank auto`'s floor
(rank_policy.quality_floor), as `adaptive_quality`. Each adaptive row is compared with the fastest
fixed level and the best-scoring one, and with the fastest fixed level within a point of the best
score (`vs_fastest_within_a_point`). Writes NAME.json and NAME.png.

    python benchmarks/quality/scd_eval.py --adaptive-from RESULT.json --min-level 16:48 [--rates ...]

recomputes the adaptive rows alone from a finished eval's measured timings and per-item scores
(no models: the prompts' lengths come from the task generator and the producer's tokenizer,
--producer or the embedded SmolLM2's) into scd_adaptive_<device>.json.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts", "train"))

from benchmarks.common.report import RESULTS_DIR, device_name, git_commit, write_json  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifacts", default=None,
                    help="the SCD artifacts to evaluate (required but with --adaptive-from)")
    ap.add_argument("--adaptive-from", default=None, metavar="RESULT.json",
                    help="recompute the adaptive rows from this eval result's timings and item scores (no models)")
    ap.add_argument("--min-level", default=None, metavar="R_K:R_V",
                    help="also model the adaptive policy with this floor level (--scd-min-rank)")
    ap.add_argument("--producer", default=None, help="producer model dir (default: the manifest's source)")
    ap.add_argument("--consumer", action="append", default=[], metavar="NAME=PATH",
                    help="consumer model dir (default: the manifest's sources)")
    ap.add_argument("--consumer-tasks", default="", help="NAME=TASK[+TASK],... (default: the task named like each consumer)")
    ap.add_argument("--n", type=int, default=100, help="eval items per task")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--task-param", action="append", default=[], metavar="TASK.PARAM=VALUE")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--drift-prompts", type=int, default=32)
    ap.add_argument("--timing-repeats", type=int, default=5)
    ap.add_argument("--rates", type=float, nargs="+", default=[1, 5, 25, 100, 200], help="link rates, Gbit/s")
    ap.add_argument("--wire-frac", type=float, default=0.25, help="the adaptive policy's wire budget (rank_policy.py)")
    ap.add_argument("--droid-k", type=int, default=None)
    ap.add_argument("--code-quant", nargs="*", default=["int4", "int8"], choices=["int4", "int8"],
                    help="also sweep SCD and Reuse-only with their codes at these quantised wire dtypes, every level")
    ap.add_argument("--diagnostics", action=argparse.BooleanOptionalAction, default=True,
                    help="also score the diagnostic rows (scd_harness.DIAGNOSTICS; not wire methods)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto", help="auto: bf16 on CUDA, float32 on CPU")
    ap.add_argument("--out-dir", default=RESULTS_DIR)
    ap.add_argument("--name", default=None, help="result name (default scd_eval_<device>)")
    ap.add_argument("--time-budget-s", type=float, default=0.0, help="skip the rank sweep's remaining levels past this")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (CPU smoke run)")
    args = ap.parse_args(argv)
    if args.quick:
        args.n, args.drift_prompts, args.timing_repeats, args.batch_size = 3, 2, 1, 4
    if min(args.n, args.batch_size, args.drift_prompts, args.timing_repeats) < 1 or min(args.rates) <= 0:
        ap.error("--n, --batch-size, --drift-prompts, --timing-repeats >= 1; --rates > 0")
    if not 0 < args.wire_frac < 1e6:
        ap.error("--wire-frac must be > 0")
    if (args.artifacts is None) == (args.adaptive_from is None):
        ap.error("one of --artifacts (an eval) or --adaptive-from (the adaptive rows of a finished one)")
    return args


def main(argv=None) -> str:
    args = parse_args(argv)
    if args.adaptive_from:
        return adaptive_from(args)
    import torch
    from task_data import parse_task_params
    from tqdm import tqdm

    from scd_harness import DIAGNOSTICS, Harness, drift
    from scd_plots import plot
    from sgl_kvxfer import tasks
    from sgl_kvxfer.scd.calib.calibrate import parse_consumer_arg

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    dtype = {"auto": torch.bfloat16 if device.startswith("cuda") else torch.float32, "bfloat16": torch.bfloat16,
             "float32": torch.float32}[args.dtype]
    t0, wall = time.perf_counter(), {}
    h = Harness(args.artifacts, args.producer, dict(parse_consumer_arg(c, args.producer) for c in args.consumer),
                device, dtype, args.droid_k)
    wall["load"] = time.perf_counter() - t0
    tparams = parse_task_params(args.task_param)
    ctasks = {n: [n] for n in h.consumers if n in tasks.task_names()}
    for part in filter(None, args.consumer_tasks.split(",")):
        n, _, ts = part.partition("=")
        ctasks[n] = ts.split("+")
    missing = [n for n in h.consumers if n not in ctasks]
    if missing:
        raise SystemExit(f"no task for consumers {missing}: pass --consumer-tasks NAME=TASK")
    m = h.m
    variants = [(meth, meth, None) for meth in h.methods + (h.diagnostics if args.diagnostics else [])]
    sweep = [(f"{meth}@{a}:{b}", meth, (a, b)) for a, b in m.rank_levels for meth in ("scd", "reuse")
             if meth != "reuse" or h.reuse_art]
    # quantised codes: every level, the top included, int4 first (the bytes under 1/8 of raw KV)
    sweep += [(f"{meth}:{q}" + (f"@{a}:{b}" if (a, b) != m.levels[-1] else ""), f"{meth}:{q}", (a, b))
              for q in args.code_quant for a, b in m.levels for meth in ("scd", "reuse") if f"{meth}:{q}" in h.quant]
    payload = {"benchmark": "scd_eval", "device": device_name(device), "commit": git_commit(),
               "dtype": str(dtype).replace("torch.", ""), "params": vars(args), "artifacts": os.path.abspath(args.artifacts),
               "manifest": {k: v for k, v in m.to_dict().items() if k not in ("producer", "consumers")},
               "models": {"producer": m.producer.to_dict(), "consumers": [c.to_dict() for c in m.consumers]},
               "consumer_tasks": ctasks, "droidspeak_layers": list(h.droid_layers),
               # each task's generation cap: a score is only as good as the cap that produced it
               "max_answer_tokens": {t: tasks.get_task(t).max_answer_tokens for ts in ctasks.values() for t in ts},
               "levels": [list(x) for x in m.levels], "results": {}, "drift": {}, "timings": {},
               "diagnostics": {k: v for k, v in DIAGNOSTICS.items() if args.diagnostics}}
    name = args.name or f"scd_eval_{payload['device'].split(' (')[0].replace(' ', '_')}"
    examples, lengths = eval_items(h.tokenizer, ctasks, args.n, args.seed, tparams)

    def save():
        payload["summary"] = summarize(payload, h, variants + sweep)
        payload["adaptive"] = adaptive(payload, m.levels, [m.bytes_per_token_at(lv) for lv in m.levels], lengths, args)
        payload["wall_s"] = {k: round(v, 2) for k, v in {**wall, "total": time.perf_counter() - t0}.items()}
        path = write_json(name, payload, args.out_dir)
        plot(payload, path[:-5] + ".png")
        return path

    try:
        t = time.perf_counter()
        for cname, c in h.consumers.items():
            exs = examples[cname]
            bar = tqdm(total=len(exs), desc=f"{cname}: methods", unit="q")
            payload["results"][cname] = compact(h.evaluate(c, exs, variants, args.batch_size, bar.update))
            bar.close()
            prompts = [tasks.chat_prompt_ids(h.tokenizer, ex) for ex in exs[:args.drift_prompts]]
            payload["drift"][cname] = drift(h, c, prompts, min(args.batch_size, 8))  # full-vocab logits: small batches
            mid = sorted(range(len(exs)), key=lambda i: lengths[cname][i])[len(exs) // 2]
            payload["timings"][cname] = h.timings(c, tasks.chat_prompt_ids(h.tokenizer, exs[mid]), variants + sweep,
                                                  args.timing_repeats)
            wall["methods"] = time.perf_counter() - t
            save()  # each consumer's rows are on disk before the next starts, the table before the sweep
        t = time.perf_counter()
        per_consumer = wall["methods"] / max(1, len(h.consumers))
        for cname, c in h.consumers.items():  # every level at once, with the oracle again for KL / top-1
            est = per_consumer * (len(sweep) + 1) / len(variants)
            if args.time_budget_s and time.perf_counter() - t0 + est > args.time_budget_s:
                payload.setdefault("sweep_skipped", []).append(cname)
                continue
            rows = compact(h.evaluate(c, examples[cname], [("oracle", "oracle", None)] + sweep, args.batch_size))
            rows.pop("oracle")  # the table's oracle row stays the one measured with the methods
            payload["results"][cname].update(rows)
            wall["sweep"] = time.perf_counter() - t
            save()
    except KeyboardInterrupt:  # `timeout -s INT`: keep what finished
        payload["interrupted"] = True
        print(f"interrupted: wrote what finished to {save()}", flush=True)
        raise SystemExit(130)
    path = save()
    print("score (mean over consumers): " + ", ".join(f"{k} {v['score']:.3f}"
                                                      for k, v in payload["summary"]["methods"].items()))
    print(f"wrote {path}")
    return path


def compact(res: dict) -> dict:
    """Per variant: per-item headline scores, means of every metric, KL / top-1, rebuild time."""
    out = {}
    for label, o in res.items():
        scores = [x for x in o["scores"] if x is not None]
        # a consumer asked several tasks (--consumer-tasks NAME=qa+code) has items of different
        # metrics (f1 / em / pass): each metric is the mean over the items that have it
        keys = list(dict.fromkeys(k for x in scores for k in x))
        metrics = {k: sum(x[k] for x in scores if k in x) / sum(k in x for x in scores) for k in keys}
        out[label] = {"metrics": metrics, "item_scores": [next(iter(x.values())) for x in scores],
                      "kl": o["kl_sum"] / max(1, o["tokens"]), "top1": o["top1_sum"] / max(1, o["tokens"]),
                      "answer_tokens": o["tokens"],
                      "rebuild_ms_per_1k_tokens": 1e6 * o["rebuild_s"] / max(1, o["prefix_tokens"]),
                      "examples": o["preds"][:3]}
    return out


def _headline(r: dict) -> float:
    return sum(r["item_scores"]) / len(r["item_scores"]) if r["item_scores"] else 0.0


def summarize(p: dict, h, variants) -> dict:
    """Means over consumers; a variant missing for some consumer (a sweep cut short) is left out."""
    meths = {}
    for label, meth, level in variants:
        rows = [r[label] for r in p["results"].values() if label in r]
        if not rows or len(rows) < len(p["results"]):
            continue
        diag = meth in h.diagnostics  # not a wire method: no bytes, not on the front
        meths[label] = {"score": statistics.mean(_headline(r) for r in rows), **({"diagnostic": True} if diag else {}),
                        "per_consumer": {c: _headline(r[label]) for c, r in p["results"].items() if label in r},
                        "kl": statistics.mean(r["kl"] for r in rows), "top1": statistics.mean(r["top1"] for r in rows),
                        "bytes_per_token": None if diag else h.bytes_per_token(level)[meth],
                        "rebuild_ms_per_1k_tokens": statistics.mean(r["rebuild_ms_per_1k_tokens"] for r in rows)}
    raw = meths.get("raw", {}).get("bytes_per_token")
    for v in meths.values():
        v["bytes_vs_raw"] = v["bytes_per_token"] / raw if raw and v["bytes_per_token"] is not None else None
    points = sorted((v["bytes_per_token"], -v["score"], k) for k, v in meths.items()
                    if family(k) in ("scd", "reuse"))
    front, best = [], -1.0
    for b, s, k in points:
        if -s > best:
            best = -s
            front.append(k)
    return {"methods": meths, "pareto_scd_reuse": front, "matched_bytes": matched(meths)}


def family(label: str) -> str:
    """"scd:int4@16:48" -> "scd": the method a variant is, whatever its level and code dtype."""
    return label.split("@")[0].split(":")[0]


def matched(meths: dict) -> dict:
    """At the bytes of int4 producer KV and at 1/8 of raw KV: the best SCD and Reuse-only
    variant (any level, any code dtype) that sends no more, with its score against the oracle's."""
    out = {}
    oracle = meths.get("oracle", {}).get("score")
    raw = meths.get("raw", {}).get("bytes_per_token")
    caps = {"int4": meths.get("int4", {}).get("bytes_per_token"), "raw/8": raw / 8 if raw else None}
    for cap_name, cap in caps.items():
        if cap is None:
            continue
        row = {"bytes_per_token": cap}
        for fam in ("scd", "reuse"):
            cands = [(v["score"], k) for k, v in meths.items() if family(k) == fam and v["bytes_per_token"] <= cap]
            if cands:
                score, label = max(cands)
                row[fam] = {"variant": label, "score": score, "bytes_per_token": meths[label]["bytes_per_token"],
                            "score_vs_oracle": score / oracle if oracle else None}
        if cap_name == "int4":
            row["int4_score"] = meths["int4"]["score"]
        out[cap_name] = row
    return out


def eval_items(tokenizer, ctasks: dict, n: int, seed: int, tparams: dict) -> tuple[dict, dict]:
    """Per consumer: its tasks' eval items (n per task) and each item's prompt length in tokens."""
    from sgl_kvxfer import tasks

    examples = {c: [ex for t in ts for ex in tasks.generate(t, "eval", n, seed, tokenizer=tokenizer,
                                                             **tparams.get(t, {}))] for c, ts in ctasks.items()}
    lengths = {c: [len(tasks.chat_prompt_ids(tokenizer, ex)) for ex in exs] for c, exs in examples.items()}
    return examples, lengths


def adaptive(p: dict, levels, bpt: list[int], lengths: dict, args) -> dict:
    """Score and modelled TTFT per link rate: each fixed level, the adaptive choice, and with
    --min-level the adaptive choice with that floor. levels: the artifacts' (R_K, R_V) levels,
    ascending, the top last; bpt: their bytes per token."""
    from sgl_kvxfer.scd.rank_policy import AGREEMENT_SLACK, choose_level, level_index, quality_floor, wire_seconds

    levels = [tuple(x) for x in levels]
    labels = [f"scd@{a}:{b}" for a, b in levels[:-1]] + ["scd"]
    floor = level_index(levels, args.min_level, "--min-level") if args.min_level else None
    out = {"levels": [list(x) for x in levels], "bytes_per_token": bpt, "wire_frac": args.wire_frac, "rates": {}}
    if floor is not None:
        out["min_level"] = args.min_level
    if not all(all(lab in r for lab in labels) for r in p["results"].values()) or not p["timings"]:
        return {**out, "skipped": "the sweep has not run every level"}
    policies = {"adaptive": 0, **({"adaptive_floor": floor} if floor is not None else {})}
    agreement = (p.get("manifest") or {}).get("level_agreement") or []
    if len(agreement) == len(levels):  # the calibration measured it: the --scd-min-rank auto floor
        policies["adaptive_quality"] = quality_floor(agreement)
        out["level_agreement"] = agreement
        out["quality_floor"] = "{}:{}".format(*levels[policies["adaptive_quality"]])
    for rate in args.rates:
        acc = {lab: {"score": [], "ttft_ms": []} for lab in [*labels, *policies, "oracle"]}
        chosen = {name: [] for name in policies}
        for cname, ns in lengths.items():
            tm, res = p["timings"][cname], p["results"][cname]
            for i, n in enumerate(ns):
                scale = n / tm["tokens"]
                prefill = tm["prefill_s"] * scale
                ttft = [prefill + wire_seconds(b, n, rate) + tm["rebuild_s"][lab] * scale + tm["first_step_s"]
                        for lab, b in zip(labels, bpt)]
                for j, lab in enumerate(labels):
                    acc[lab]["score"].append(res[lab]["item_scores"][i])
                    acc[lab]["ttft_ms"].append(1e3 * ttft[j])
                for name, lowest in policies.items():
                    j = choose_level(bpt, n, rate, prefill, args.wire_frac, lowest)
                    chosen[name].append(j)
                    acc[name]["score"].append(res[labels[j]]["item_scores"][i])
                    acc[name]["ttft_ms"].append(1e3 * ttft[j])
                acc["oracle"]["score"].append(res["oracle"]["item_scores"][i])
                acc["oracle"]["ttft_ms"].append(1e3 * (tm["rebuild_s"]["oracle"] * scale + tm["first_step_s"]))
        row = {lab: {"score": statistics.mean(a["score"]), "ttft_ms": statistics.mean(a["ttft_ms"])}
               for lab, a in acc.items()}
        best_ttft = min(row[lab]["ttft_ms"] for lab in labels)
        best_score = max(row[lab]["score"] for lab in labels)
        # the fixed level a user who knew every level's score and TTFT at this rate would pick:
        # the fastest within a point of the best score
        pick = min((lab for lab in labels if row[lab]["score"] >= best_score - AGREEMENT_SLACK),
                   key=lambda lab: row[lab]["ttft_ms"])
        for name, picks in chosen.items():
            row[name]["level_counts"] = {labels[k]: picks.count(k) for k in sorted(set(picks))}
            row[name]["ttft_vs_best_fixed"] = row[name]["ttft_ms"] / best_ttft
            row[name]["score_minus_best_fixed"] = row[name]["score"] - best_score
            row[name]["vs_fastest_within_a_point"] = {
                "level": pick, "ttft_ratio": row[name]["ttft_ms"] / row[pick]["ttft_ms"],
                "score_minus": row[name]["score"] - row[pick]["score"]}
        out["rates"][f"{rate:g}"] = row
    return out


def adaptive_from(args) -> str:
    """The adaptive rows of a finished eval, recomputed from its JSON (module docstring)."""
    import json

    from task_data import parse_task_params

    from sgl_kvxfer.models.loader import load_tokenizer, resolve_model_path, resolve_tokenizer_path

    with open(args.adaptive_from) as f:
        src = json.load(f)
    old = src.get("adaptive") or {}
    if "levels" not in old or "bytes_per_token" not in old:
        raise SystemExit(f"{args.adaptive_from}: no adaptive levels in it (an scd_eval result is needed)")
    sp = src["params"]
    tok = load_tokenizer(resolve_tokenizer_path(resolve_model_path(args.producer)))
    tparams = parse_task_params(sp.get("task_param") or [])
    _, lengths = eval_items(tok, src["consumer_tasks"], sp["n"], sp["seed"], tparams)
    for c, ns in lengths.items():  # the same items the eval scored, or the scores would be misaligned
        scored = len(src["results"][c]["scd"]["item_scores"])
        if scored != len(ns):
            raise SystemExit(f"{args.adaptive_from}: {scored} scored items for {c}, the generator gives {len(ns)}")
    # "device": where the timings and scores were measured; this step is arithmetic on them
    payload = {"benchmark": "scd_adaptive", "device": src["device"], "recomputed_on": device_name("cpu"),
               "source": os.path.basename(args.adaptive_from),
               "source_commit": src.get("commit"), "params": {k: v for k, v in vars(args).items() if k != "out_dir"},
               "adaptive": adaptive(src, old["levels"], old["bytes_per_token"], lengths, args)}
    name = args.name or f"scd_adaptive_{src['device'].split(' (')[0].replace(' ', '_')}"
    path = write_json(name, payload, args.out_dir)
    for rate, row in payload["adaptive"].get("rates", {}).items():
        print(f"{rate:>5} Gbit/s: " + ", ".join(
            f"{k} {v['score']:.3f} / {v['ttft_ms']:.1f} ms" for k, v in row.items() if k.startswith("adaptive")))
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
