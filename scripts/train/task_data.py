"""Training batches from the task suite: a seeded, endless stream of train-split examples drawn
from a task mix, tokenized under the model's chat template, loss on the answer only.

The n-th example of the stream is a pure function of (seed, mix, task params): the task is
drawn by weight from random.Random(seed), and each task's items are taken in index order from
its train split. Examples longer than max_len are skipped (counted).
"""
from __future__ import annotations

import random

import torch

from sgl_kvxfer import tasks

IGNORE = -100


class TaskStream:
    def __init__(self, tokenizer, mix: dict[str, float], task_params: dict[str, dict], seed: int, max_len: int):
        self.tok, self.mix, self.params, self.seed, self.max_len = tokenizer, mix, task_params, seed, max_len
        self.rng = random.Random(f"mix/{seed}")
        self.next_index = {t: 0 for t in mix}
        self.skipped = 0
        self.drawn = {t: 0 for t in mix}
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def example(self) -> tuple[list[int], int, str]:
        names, weights = list(self.mix), list(self.mix.values())
        while True:
            t = self.rng.choices(names, weights)[0]
            i = self.next_index[t]
            self.next_index[t] += 1
            ex = tasks.generate(t, "train", 1, self.seed, tokenizer=self.tok, start=i, **self.params.get(t, {}))[0]
            ids, n_prompt = tasks.train_ids(self.tok, ex)
            if len(ids) <= self.max_len:
                self.drawn[t] += 1
                return ids, n_prompt, t
            self.skipped += 1
            if self.skipped > 1000 and sum(self.drawn.values()) == 0:
                raise ValueError(f"every example exceeds --max-len {self.max_len} tokens")

    def batch(self, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, list[str]]:
        """(input_ids [B, S], labels [B, S] with IGNORE outside answers, attention mask, answer
        tokens, each row's task), right-padded to the longest row."""
        rows = [self.example() for _ in range(size)]
        s = max(len(ids) for ids, _, _ in rows)
        ids = torch.full((size, s), self.pad_id, dtype=torch.long)
        labels = torch.full((size, s), IGNORE, dtype=torch.long)
        mask = torch.zeros(size, s, dtype=torch.long)
        for i, (x, n, _) in enumerate(rows):
            ids[i, :len(x)] = torch.tensor(x)
            labels[i, n:len(x)] = torch.tensor(x[n:])
            mask[i, :len(x)] = 1
        return ids, labels, mask, int((labels != IGNORE).sum()), [t for _, _, t in rows]


class Prefetcher:
    """stream.batch(size) made ahead in a worker thread (tokenizing and counting context tokens
    overlap the GPU step); the same batches in the same order as calling it directly."""

    def __init__(self, stream: TaskStream, size: int, depth: int = 4):
        import queue
        import threading

        self.q: queue.Queue = queue.Queue(maxsize=depth)
        self.stop = threading.Event()

        def work():
            try:
                while not self.stop.is_set():
                    self.q.put(stream.batch(size))
            except Exception as e:  # surfaced by next()
                self.q.put(e)

        threading.Thread(target=work, daemon=True, name="task-batches").start()

    def next(self):
        item = self.q.get()
        if isinstance(item, Exception):
            raise item
        return item

    def close(self) -> None:
        self.stop.set()
        while not self.q.empty():
            self.q.get_nowait()


def parse_task_params(specs: list[str]) -> dict[str, dict]:
    """["kv.context_tokens=2048", "needle.hops=2"] -> {"kv": {"context_tokens": 2048}, ...}
    (values parsed as int, float, None or kept as text)."""
    out: dict[str, dict] = {}
    for spec in specs:
        key, eq, value = spec.partition("=")
        task, dot, param = key.partition(".")
        if not eq or not dot or not task or not param:
            raise ValueError(f"task parameter {spec!r}: expected TASK.PARAM=VALUE")
        tasks.get_task(task).params({param: None})  # unknown names fail here
        out.setdefault(task, {})[param] = _value(value)
    return out


def _value(s: str):
    if s.lower() == "none":
        return None
    for kind in (int, float):
        try:
            return kind(s)
        except ValueError:
            pass
    return s
