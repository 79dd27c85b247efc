"""Re-score a finished scd_eval result on the items whose gold answer fits a generation cap.

    python benchmarks/quality/score_within_cap.py RESULT.json --task code --cap 20 [--producer DIR] [--out OUT.json]

A scorer that generates at most CAP tokens cannot produce a gold answer longer than that (its
end of turn included), so on those items every method scores its truncation. This regenerates
the eval's items (scd_eval.eval_items with the result's `params`: n, seed and task parameters;
the producer's tokenizer: --producer, default the embedded SmolLM2's), counts each gold answer's tokens with
its end of turn as training does (tasks.train_ids), and averages each method's stored per-item
scores (`results.<consumer>.<method>.item_scores`) over the items of TASK that fit in CAP.
No models run. Items of the consumer's other tasks, if any, are left out.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts", "train"))


def rescore(result: dict, tokenizer, task: str, cap: int) -> dict:
    """{consumer: {"items": fitting count, "of": n, "methods": {method: mean score on them}}} for
    every consumer whose tasks include TASK."""
    from scd_eval import eval_items
    from task_data import parse_task_params

    from sgl_kvxfer import tasks

    sp = result["params"]
    ctasks = {c: ts for c, ts in result["consumer_tasks"].items() if task in ts}
    # the items the eval scored, in its order (its task parameters included)
    examples, _ = eval_items(tokenizer, ctasks, sp["n"], sp["seed"], parse_task_params(sp.get("task_param") or []))
    out = {}
    for consumer, exs in examples.items():
        keep = []
        for i, ex in enumerate(exs):
            if ex.task == task:
                ids, n_prompt = tasks.train_ids(tokenizer, ex)  # the answer and its end of turn, as trained
                if len(ids) - n_prompt <= cap:
                    keep.append(i)
        methods = {}
        for method, r in result["results"].get(consumer, {}).items():
            scores = r.get("item_scores")
            if scores and keep:
                methods[method] = sum(scores[i] for i in keep) / len(keep)
        out[consumer] = {"items": len(keep), "of": sp["n"], "methods": methods}
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("result", help="a scd_eval JSON")
    ap.add_argument("--task", required=True, help="the task whose cap to apply, e.g. code")
    ap.add_argument("--cap", type=int, required=True, help="the generation cap the result was scored under")
    ap.add_argument("--producer", default=None, help="tokenizer dir (default: the embedded SmolLM2)")
    ap.add_argument("--out", default=None, help="write the re-scoring here as JSON")
    a = ap.parse_args(argv)
    if a.cap < 1:
        ap.error("--cap must be >= 1")
    from sgl_kvxfer.models.loader import load_tokenizer, resolve_model_path

    with open(a.result) as f:
        result = json.load(f)
    got = rescore(result, load_tokenizer(resolve_model_path(a.producer)), a.task, a.cap)
    if not got:
        ap.error(f"no consumer of {a.result} is scored on task {a.task!r}")
    for consumer, r in got.items():
        print(f"{consumer}: {r['items']} of {r['of']} {a.task} items fit in {a.cap} tokens")
        for method, score in r["methods"].items():
            print(f"  {method:20s} {score:.3f}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"result": os.path.basename(a.result), "task": a.task, "cap": a.cap, "consumers": got}, f, indent=1)
    return got


if __name__ == "__main__":
    main()
