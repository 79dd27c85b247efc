"""scripts/train/finetune.py with its training items made ahead of time, in parallel processes.

    python scripts/gpu/spectrum_train.py --workers 14 --items 2400 -- <finetune.py arguments>

finetune.py draws its train items one by one on the training loop's thread; a long-context kv
item is tokenized line by line while it is built (~0.1 s at 8k tokens), which would leave the
GPU waiting most of the time. This wrapper builds the first `--items` items of each task of the
mix (split by the mix weights), each exactly as `tasks.generate(task, "train", 1, seed,
start=i, ...)` would, in a process pool, and serves them to finetune.py from memory; any item
past them is built as before. The training run is otherwise finetune.py's, unchanged.
"""
from __future__ import annotations

import argparse
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


def prefetch(tokenizer_dir: str, mix: dict, params: dict, seed: int, items: int, workers: int) -> dict:
    total = sum(mix.values())
    jobs = [(t, i, seed, params.get(t, {})) for t, w in mix.items() for i in range(round(items * w / total))]
    with ProcessPoolExecutor(workers, initializer=_init, initargs=(tokenizer_dir,)) as ex:
        return dict(ex.map(_make, jobs, chunksize=8))


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 2))
    ap.add_argument("--items", type=int, default=2000, help="items made ahead, all tasks together")
    own = ap.parse_args(argv[:split])
    rest = argv[split + 1:]
    if own.workers < 1 or own.items < 0:
        ap.error("--workers >= 1 and --items >= 0")
    import finetune

    from sgl_kvxfer import tasks

    from sgl_kvxfer.models.loader import resolve_model_path, resolve_tokenizer_path

    args = finetune.parse_args(rest)
    t = time.time()
    cache = prefetch(resolve_tokenizer_path(resolve_model_path(args.model)), args.mix_weights, args.task_params,
                     args.seed, own.items, own.workers)
    print(f"made {len(cache)} train items ahead in {time.time() - t:.1f} s with {own.workers} processes", flush=True)
    made = tasks.generate

    def generate(task, split, n, seed=0, tokenizer=None, start=0, **params):
        key = (task, start)
        same = split == "train" and n == 1 and seed == args.seed and params == args.task_params.get(task, {})
        if same and key in cache:
            return [cache.pop(key)]
        return made(task, split, n, seed, tokenizer, start, **params)

    tasks.generate = generate  # task_data.TaskStream calls tasks.generate(...) per item
    finetune.main(rest)


if __name__ == "__main__":
    main()
