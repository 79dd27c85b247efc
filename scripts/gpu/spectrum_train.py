"""scripts/train/finetune.py with its training items made ahead of time, in parallel processes.

    python scripts/gpu/spectrum_train.py --workers 14 --items 2400 -- <finetune.py arguments>

finetune.py draws its train items one by one on the training loop's thread; a long-context kv
item is tokenized line by line while it is built (~0.1 s at 8k tokens), which would leave the
GPU waiting most of the time. This wrapper builds the first `--items` items of each task of the
mix (split by the mix weights), each exactly as `tasks.generate(task, "train", 1, seed,
start=i, ...)` would, in a process pool, and serves them to finetune.py from memory; any item
past them is built as before. The training run is otherwise finetune.py's, unchanged.

Curriculum (`--short-context N --short-fraction F`): the first F of the items made ahead are made
at N context tokens instead of the run's `context_tokens` task parameter, so the stream (which
takes items in index order) starts on short contexts, where steps are cheaper and the lookup is
learnt, and moves to the full length for the rest of the run. Batches stay one length (but the
one at the switch), so little of a batch is padding.

    python scripts/gpu/spectrum_train.py --items 2400 --short-context 4000 --short-fraction 0.35 -- \
        --mix kv=1 --task-param kv.context_tokens=8000 ...

`--finish-within S`: finetune.py's --time-limit-s is cut to what is left of S seconds (from this
script's start) after the items are made, less 30 s for loading and saving the model, so a run
under `timeout S` still saves its weights when making the items took longer than planned.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts", "train"))

_TOK = None


def _init(tokenizer_dir: str) -> None:
    global _TOK
    from sgl_kvxfer.models.loader import load_tokenizer

    _TOK = load_tokenizer(tokenizer_dir)


def _make(job):
    from sgl_kvxfer import tasks

    task, start, seed, params = job
    return (task, start), tasks.generate(task, "train", 1, seed, tokenizer=_TOK, start=start, **params)[0]


def prefetch(tokenizer_dir: str, mix: dict, params: dict, seed: int, items: int, workers: int,
             short: tuple[int, float] | None = None) -> dict:
    """{(task, index): item} for the first `items` items of the mix; with short = (N, F), each task's
    first F of them at context_tokens N."""
    total = sum(mix.values())
    jobs = []
    for t, w in mix.items():
        n = round(items * w / total)
        n_short = round(n * short[1]) if short else 0
        for i in range(n):
            p = dict(params.get(t, {}))
            if i < n_short:
                p["context_tokens"] = short[0]
            jobs.append((t, i, seed, p))
    with ProcessPoolExecutor(workers, initializer=_init, initargs=(tokenizer_dir,)) as ex:
        return dict(ex.map(_make, jobs, chunksize=8))


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 2))
    ap.add_argument("--items", type=int, default=2000, help="items made ahead, all tasks together")
    ap.add_argument("--short-context", type=int, default=0,
                    help="curriculum: the first --short-fraction of the items made ahead at this many context "
                         "tokens (0: none)")
    ap.add_argument("--short-fraction", type=float, default=0.0)
    ap.add_argument("--finish-within", type=float, default=0.0,
                    help="cut --time-limit-s so that the run ends within this many seconds (0: no cut)")
    own = ap.parse_args(argv[:split])
    rest = argv[split + 1:]
    if own.workers < 1 or own.items < 0:
        ap.error("--workers >= 1 and --items >= 0")
    if not (math.isfinite(own.short_fraction) and 0.0 <= own.short_fraction <= 1.0):
        ap.error("--short-fraction must be in [0, 1]")
    if own.short_context and not 16 <= own.short_context <= 1 << 20:
        ap.error("--short-context must be 0 (none) or in [16, 1048576]")
    if not (math.isfinite(own.finish_within) and 0.0 <= own.finish_within <= 1e6):
        ap.error("--finish-within must be in [0, 1e6] seconds")
    t_start = time.time()
    import finetune

    from sgl_kvxfer import tasks

    from sgl_kvxfer.models.loader import resolve_model_path, resolve_tokenizer_path

    args = finetune.parse_args(rest)
    t = time.time()
    short = (own.short_context, own.short_fraction) if own.short_context and own.short_fraction else None
    cache = prefetch(resolve_tokenizer_path(resolve_model_path(args.model)), args.mix_weights, args.task_params,
                     args.seed, own.items, own.workers, short)
    print(f"made {len(cache)} train items ahead in {time.time() - t:.1f} s with {own.workers} processes"
          + (f" (the first {short[1]:g} at {short[0]} context tokens)" if short else ""), flush=True)
    made = tasks.generate

    def generate(task, split, n, seed=0, tokenizer=None, start=0, **params):
        key = (task, start)
        same = split == "train" and n == 1 and seed == args.seed and params == args.task_params.get(task, {})
        if same and key in cache:
            return [cache.pop(key)]
        return made(task, split, n, seed, tokenizer, start, **params)

    tasks.generate = generate  # task_data.TaskStream calls tasks.generate(...) per item
    if own.finish_within:
        left = max(10.0, own.finish_within - (time.time() - t_start) - 30.0)
        if not args.time_limit_s or left < args.time_limit_s:
            print(f"--time-limit-s {args.time_limit_s:g} -> {left:.0f} s (--finish-within {own.finish_within:g})",
                  flush=True)
            rest = [*rest, "--time-limit-s", f"{left:.1f}"]  # argparse: the last value wins
    finetune.main(rest)


if __name__ == "__main__":
    main()
