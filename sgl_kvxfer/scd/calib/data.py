"""Calibration data: token sequences for the paired prefills, and (prefix, continuation) pairs
for the layer selection's metric.

A calib spec is one of
    task:NAME       the task suite's calib split (sgl_kvxfer/tasks): each item is one chat-formatted
                    conversation (prompt + answer + EOS); selection scores the answer given the prompt
    PATH.jsonl[.gz] a file of {"text": ...} rows: windows of --prefix-len tokens; selection scores
                    the last --select-cont tokens of a window of --select-prefix + --select-cont
    corpus:NAME     NAME_calib.jsonl[.gz] in $SGL_KVXFER_SCD_DATA (an error names the variable when unset)
No path is built in: data comes from the spec or the environment variable.
"""
from __future__ import annotations

import gzip
import json
import os
import random


def corpus_path(corpus: str, split: str) -> str:
    from sgl_kvxfer import env as envs

    folder = envs.SCD_DATA.get()
    if not folder:
        raise FileNotFoundError(f"corpus {corpus!r}: set {envs.SCD_DATA.name} to the folder holding "
                                f"{corpus}_{split}.jsonl (or pass a path, or a task:NAME spec)")
    base = os.path.join(folder, f"{corpus}_{split}.jsonl")
    for p in (base, base + ".gz"):
        if os.path.isfile(p):
            return p
    raise FileNotFoundError(f"no {corpus}_{split}.jsonl(.gz) in {envs.SCD_DATA.name}={folder}")


def read_texts(path: str) -> list[str]:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"calib data {path!r}: no such file")
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f if line.strip()]


def token_chunks(tokenizer, texts: list[str], seq_len: int, max_chunks: int | None = None,
                 seed: int | None = None, max_per_doc: int | None = None) -> list[list[int]]:
    """Cut each text's tokens into non-overlapping windows of exactly `seq_len` tokens (a text
    shorter than that gives none), at most `max_per_doc` per text; shuffled with `seed` (None: in
    order), at most `max_chunks`."""
    chunks = []
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        doc = [ids[i:i + seq_len] for i in range(0, len(ids) - seq_len + 1, seq_len)]
        chunks += doc[:max_per_doc] if max_per_doc else doc
    if seed is not None:
        random.Random(seed).shuffle(chunks)
    return chunks[:max_chunks] if max_chunks else chunks


def task_items(tokenizer, task: str, n: int, seed: int, start: int = 0, params: dict | None = None):
    """n calib-split items of `task` as (prompt ids, answer ids + EOS)."""
    from sgl_kvxfer import tasks

    out = []
    for ex in tasks.generate(task, "calib", n, seed, tokenizer=tokenizer, start=start, **(params or {})):
        ids, n_prompt = tasks.train_ids(tokenizer, ex)
        out.append((ids[:n_prompt], ids[n_prompt:]))
    return out


# A task's selection items are its calib items from this index on, its fit items from 0: the
# layer selection scores the same items whatever --num-prefixes is (were they the items after the
# fit ones, more prefixes would move them, and with them the chosen layers), and the two sets
# stay disjoint up to this many fit items per task.
SELECT_ITEMS_START = 1 << 20


def calib_data(specs, tokenizer, num_prefixes: int, prefix_len: int, select_prompts: int, select_prefix: int,
               select_cont: int, seed: int, task_params: dict | None = None):
    """(fit sequences [ids], selection pairs [(prefix ids, continuation ids)]), round-robin over
    the specs so every source is represented. A continuation's first id is the prompt's last
    token (the one a consumer computes itself); the metric scores the ids after it."""
    per_fit, per_sel = [], []
    n_fit = -(-num_prefixes // len(specs))
    n_sel = max(1, -(-select_prompts // len(specs)))
    if n_fit > SELECT_ITEMS_START:
        raise ValueError(f"--num-prefixes {num_prefixes}: at most {SELECT_ITEMS_START} per calib spec")
    for i, spec in enumerate(specs):
        if spec.startswith("task:"):
            name = spec[len("task:"):]
            params = (task_params or {}).get(name)
            per_fit.append([p + a for p, a in task_items(tokenizer, name, n_fit, seed, params=params)])
            per_sel.append([(p[:-1], p[-1:] + a)
                            for p, a in task_items(tokenizer, name, n_sel, seed, SELECT_ITEMS_START, params)])
            continue
        path = corpus_path(spec[len("corpus:"):], "calib") if spec.startswith("corpus:") else spec
        texts = read_texts(path)
        n_sel_docs = max(1, len(texts) // 8)  # selection windows from the last documents, fit from the others
        sel = token_chunks(tokenizer, texts[-n_sel_docs:], select_prefix + select_cont, n_sel, seed + i, 4)
        per_sel.append([(w[:select_prefix], w[select_prefix:]) for w in sel])
        per_fit.append(token_chunks(tokenizer, texts[:-n_sel_docs] or texts, prefix_len, None, seed + 100 + i, 16))
    fit = [x for group in _round_robin(per_fit) for x in group][:num_prefixes]
    sel = [x for group in _round_robin(per_sel) for x in group][:select_prompts]
    if not fit or not sel:
        raise ValueError(f"calib data {list(specs)} too short for prefix_len {prefix_len} / selection windows")
    return fit, sel


def _round_robin(lists):
    for i in range(max(len(x) for x in lists)):
        yield [x[i] for x in lists if i < len(x)]
