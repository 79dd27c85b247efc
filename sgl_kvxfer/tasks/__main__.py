"""python -m sgl_kvxfer.tasks {generate,show} ...  (sgl_kvxfer/tasks/README.md)

    generate --task qa --split eval --n 200 [--seed 0] [--param context_tokens=2048]
             [--tokenizer smollm2-135m] --out FILE.jsonl
    show     --task needle [--split eval] [--index 0] [--param depth=0.5]
"""
from __future__ import annotations

import argparse

from sgl_kvxfer import tasks


def _params(specs: list[str]) -> dict:
    out = {}
    for spec in specs:
        k, eq, v = spec.partition("=")
        if not eq:
            raise SystemExit(f"--param {spec!r}: expected NAME=VALUE")
        if v.lower() == "none":
            out[k] = None
            continue
        try:
            out[k] = int(v)
        except ValueError:
            try:
                out[k] = float(v)
            except ValueError:
                raise SystemExit(f"--param {spec!r}: the value must be a number or none") from None
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m sgl_kvxfer.tasks", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("generate", "show"):
        p = sub.add_parser(name)
        p.add_argument("--task", required=True, choices=tasks.task_names())
        p.add_argument("--split", default="eval", choices=tasks.SPLITS)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--param", action="append", default=[], metavar="NAME=VALUE")
        p.add_argument("--tokenizer", default=None, help="model dir or smollm2-135m: count context tokens exactly")
        if name == "generate":
            p.add_argument("--n", type=int, required=True)
            p.add_argument("--out", required=True)
        else:
            p.add_argument("--index", type=int, default=0)
    a = ap.parse_args(argv)
    tok = None
    if a.tokenizer:
        from sgl_kvxfer.models.loader import load_tokenizer, resolve_model_path, resolve_tokenizer_path

        tok = load_tokenizer(resolve_tokenizer_path(resolve_model_path(a.tokenizer)))
    try:
        if a.cmd == "generate":
            exs = tasks.generate(a.task, a.split, a.n, a.seed, tokenizer=tok, **_params(a.param))
            tasks.write_jsonl(a.out, exs)
            print(f"{len(exs)} {a.task} items ({a.split}, seed {a.seed}) -> {a.out}")
        else:
            if a.index < 0:
                raise ValueError("--index must be >= 0")
            ex = tasks.generate(a.task, a.split, 1, a.seed, tokenizer=tok, start=a.index, **_params(a.param))[0]
            print(ex.prompt())
            print(f"\n[answer] {ex.answer}\n[meta] {ex.meta}")
    except (ValueError, KeyError) as e:
        ap.error(str(e))


if __name__ == "__main__":
    main()
