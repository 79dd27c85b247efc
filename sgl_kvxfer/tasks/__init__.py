"""The shared task suite: seeded, offline generators of train / calib / eval splits with exact
scoring (sgl_kvxfer/tasks/README.md).

    generate(task, split, n, seed=0, tokenizer=None, start=0, **params) -> [Example]
    score(example, prediction) -> {metric: value}      evaluate(examples, predictions) -> summary
    chat_prompt_ids / train_ids                        token ids under a model's chat template
    parse_mix("qa=2,code=1") -> {task: weight}         read_jsonl / write_jsonl

Tasks: qa (extractive QA with distractors: f1, em), kv (key-value retrieval: em), needle (needle
and two-hop needle at a depth: em), code (completion against a module's helpers: pass, em).
Offline tooling: the serving runtime never imports this package.
"""
from __future__ import annotations

import json
import random

from sgl_kvxfer.tasks.base import SPLITS, Example, Task, get_task, task_names, token_counter
from sgl_kvxfer.tasks.format import chat_prompt_ids, chat_text, train_ids

__all__ = ["SPLITS", "Example", "Task", "get_task", "task_names", "generate", "score", "evaluate", "parse_mix",
           "read_jsonl", "write_jsonl", "chat_prompt_ids", "chat_text", "train_ids", "headline"]


def generate(task: str, split: str, n: int, seed: int = 0, tokenizer=None, start: int = 0, **params) -> list[Example]:
    """Items start .. start + n - 1 of (task, split, seed): each a pure function of those and
    `params` (the task's `defaults` overridden). `tokenizer`: an HF tokenizer or a callable
    text -> token count, for the tasks that fill a context to `context_tokens`."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if n < 0 or start < 0:
        raise ValueError("n and start must be >= 0")
    t = get_task(task)
    p = t.params(params)
    count = token_counter(tokenizer)
    return [t.make(random.Random(f"{task}/{split}/{seed}/{i}"), f"{task}-{split}-{seed}-{i}", count, **p)
            for i in range(start, start + n)]


def score(example: Example, prediction: str) -> dict[str, float]:
    return get_task(example.task).score(prediction, example)


def headline(task: str) -> str:
    """The task's main metric (f1 for qa, pass for code, em otherwise)."""
    return get_task(task).metrics[0]


def evaluate(examples: list[Example], predictions: list[str]) -> dict:
    """{task: {metric: mean, "n": count}} over paired examples and predictions."""
    if len(examples) != len(predictions):
        raise ValueError(f"{len(examples)} examples, {len(predictions)} predictions")
    sums: dict[str, dict[str, float]] = {}
    for ex, pred in zip(examples, predictions):
        acc = sums.setdefault(ex.task, {"n": 0})
        acc["n"] += 1
        for k, v in score(ex, pred).items():
            acc[k] = acc.get(k, 0.0) + v
    return {t: {k: (v if k == "n" else v / acc["n"]) for k, v in acc.items()} for t, acc in sums.items()}


def parse_mix(spec: str) -> dict[str, float]:
    """"qa=2,code=1" (or "qa,code": weight 1 each) -> {task: weight}, weights > 0."""
    out = {}
    for part in filter(None, (x.strip() for x in spec.split(","))):
        name, _, w = part.partition("=")
        get_task(name)
        try:
            weight = float(w) if w else 1.0
        except ValueError:
            raise ValueError(f"task mix {spec!r}: weight of {name!r} is not a number") from None
        if not weight > 0 or weight != weight or weight == float("inf"):
            raise ValueError(f"task mix {spec!r}: weight of {name!r} must be a finite number > 0")
        out[name] = weight
    if not out:
        raise ValueError(f"empty task mix {spec!r}")
    return out


def write_jsonl(path: str, examples: list[Example]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for ex in examples:
            f.write(json.dumps(ex.to_dict()) + "\n")


def read_jsonl(path: str) -> list[Example]:
    with open(path, encoding="utf-8") as f:
        return [Example.from_dict(json.loads(line)) for line in f if line.strip()]
