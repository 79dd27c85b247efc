"""The task interface: an `Example` (context, question, gold answer) and a `Task` that makes
seeded examples and scores predictions.

A task item is a pure function of (task name, split, seed, index): `random.Random` seeded with
the string "task/split/seed/index" (Python seeds str through SHA-512, so the same on every
platform and run). Splits are disjoint seed spaces; every entity is a made-up word, so a
train item never answers an eval question.
"""
from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field
from typing import Callable

SPLITS = ("train", "calib", "eval")
CHARS_PER_TOKEN = 3.6  # the length estimate when no tokenizer is given (SmolLM2's BPE on this text)


@dataclass(frozen=True)
class Example:
    """One item. `prompt()` is the user message (context, question, answer instruction); the
    gold answer is `answer`. `meta` holds task parameters (depth, hops, unit tests, ...) as
    JSON-able values."""

    task: str
    uid: str
    context: str
    question: str
    answer: str
    instruction: str = ""
    meta: dict = field(default_factory=dict)

    def prompt(self) -> str:
        tail = f"\n{self.instruction}" if self.instruction else ""
        return f"{self.context}\n\n{self.question}{tail}"

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "prompt": self.prompt()}

    @classmethod
    def from_dict(cls, d: dict) -> "Example":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


TokenCounter = Callable[[str], int]


def token_counter(tokenizer=None) -> TokenCounter:
    """A function text -> token count: an HF tokenizer's, a callable as is, or the estimate
    len(text) / CHARS_PER_TOKEN when None."""
    if tokenizer is None:
        return lambda text: max(1, round(len(text) / CHARS_PER_TOKEN))
    if hasattr(tokenizer, "encode"):
        return lambda text: len(tokenizer.encode(text, add_special_tokens=False))
    return tokenizer


class Task:
    """Base class. Subclasses set `name`, `metrics` (the first is the headline metric, in
    [0, 1]), `defaults` (the generation parameters and their default values) and implement
    `make` and `score`."""

    name: str = ""
    metrics: tuple[str, ...] = ("em",)
    defaults: dict = {}
    max_answer_tokens: int = 16  # generation cap: every gold answer of the task and its end of turn fit
    # (test_tasks.py checks it with SmolLM2's tokenizer)

    def make(self, rng: random.Random, uid: str, count: TokenCounter, **params) -> Example:
        raise NotImplementedError

    def score(self, prediction: str, example: Example) -> dict[str, float]:
        """{metric: value in [0, 1]} for one prediction."""
        raise NotImplementedError

    def params(self, overrides: dict) -> dict:
        unknown = set(overrides) - set(self.defaults)
        if unknown:
            raise ValueError(f"task {self.name!r} takes parameters {sorted(self.defaults)}, not {sorted(unknown)}")
        for k, v in overrides.items():
            if isinstance(self.defaults[k], int) and (not isinstance(v, int) or isinstance(v, bool)):
                raise ValueError(f"task {self.name!r}: {k} must be an integer, got {v!r}")
            if self.defaults[k] is None and v is not None and not isinstance(v, (int, float)):
                raise ValueError(f"task {self.name!r}: {k} must be a number or None, got {v!r}")
        return {**self.defaults, **overrides}


_REGISTRY: dict[str, Task] = {}


def register(task: Task) -> Task:
    _REGISTRY[task.name] = task
    return task


def get_task(name: str) -> Task:
    from sgl_kvxfer.tasks import code, qa, retrieval  # noqa: F401  (they register themselves)

    if name not in _REGISTRY:
        raise KeyError(f"unknown task {name!r}; tasks: {sorted(_REGISTRY)}")
    return _REGISTRY[name]


def task_names() -> tuple[str, ...]:
    from sgl_kvxfer.tasks import code, qa, retrieval  # noqa: F401

    return tuple(sorted(_REGISTRY))
