"""Long-context lookups (metric: EM): key-value retrieval and needle / multi-hop needles.

Both fill a context of about `context_tokens` tokens (counted with the tokenizer given to
`generate`, else estimated) and place the asked fact at relative `depth` in [0, 1] (0: first
line, 1: last; None draws it uniformly).

  kv      lines "KEY: VALUE" (random 8-character keys, `value_digits`-digit values, 6 by default);
          asks one key's value. `near_keys` of the other lines have keys one character away from the
          asked key (at random depths), so the lookup must match the asked key exactly. With
          `near_values` = m > 0 their values are the asked value with m digits changed, so a copy
          that strays onto a near line midway (its digit runs are the asked one's) is wrong in
          only m places: the answer needs the asked line's keys and digits read precisely.
  needle  filler prose with "The secret number of NAME is DIGITS." sentences: the asked one at
          `depth`, `distractors` others (other names) at random depths. hops=2 asks a name whose
          sentence says it "has the same secret number as" a second name, whose number is
          stated elsewhere (at a random depth): two lookups, the first at `depth`.
"""
from __future__ import annotations

import random

from sgl_kvxfer.tasks import words
from sgl_kvxfer.tasks.base import Example, Task, register
from sgl_kvxfer.tasks.scoring import exact_match

MAX_CONTEXT_TOKENS = 32768


def _check(context_tokens: int, depth) -> None:
    if not 16 <= context_tokens <= MAX_CONTEXT_TOKENS:
        raise ValueError(f"context_tokens must be in [16, {MAX_CONTEXT_TOKENS}], got {context_tokens}")
    if depth is not None and not 0.0 <= float(depth) <= 1.0:
        raise ValueError(f"depth must be in [0, 1] or None, got {depth}")


def _slot(depth, n: int, rng: random.Random) -> int:
    """Index in [0, n] at relative depth (n + 1 insertion points)."""
    d = rng.random() if depth is None else float(depth)
    return min(n, max(0, round(d * n)))


class KeyValue(Task):
    name = "kv"
    metrics = ("em",)
    defaults = {"context_tokens": 512, "depth": None, "value_digits": 6, "near_keys": 0, "near_values": 0}
    max_answer_tokens = 14  # value_digits <= 12 digit tokens and the end of turn

    def make(self, rng, uid, count, context_tokens=512, depth=None, value_digits=6, near_keys=0,
             near_values=0) -> Example:
        _check(context_tokens, depth)
        if not (isinstance(value_digits, int) and 4 <= value_digits <= 12) or \
                not (isinstance(near_keys, int) and 0 <= near_keys <= 16):
            raise ValueError(f"kv: value_digits in [4, 12] and near_keys in [0, 16], got {value_digits}, {near_keys}")
        if not (isinstance(near_values, int) and 0 <= near_values < value_digits):
            raise ValueError(f"kv: near_values in [0, value_digits), got {near_values}")
        head = "Below is a list of keys and their values.\n\n"
        budget = context_tokens - count(head) - 24  # the question and instruction
        taken: set = set()
        lines, used = [], 0
        while True:
            line = f"{words.distinct(rng, words.key_id, 1, taken)[0]}: {words.digits(rng, value_digits)}"
            cost = count(line + "\n")
            if lines and used + cost > budget:
                break
            lines.append(line)
            used += cost
        # the asked line moves to the slot at `depth`; near keys replace the keys of other lines
        # (same line lengths up to tokenization), each one character away from the asked key
        asked = lines.pop(rng.randrange(len(lines)))
        key = asked.split(": ")[0]
        value = asked.split(": ")[1]
        for i in rng.sample(range(len(lines)), min(near_keys, len(lines))):
            lines[i] = f"{words.distinct(rng, lambda r: words.near_key(r, key), 1, taken)[0]}: {lines[i].split(': ')[1]}"
            if near_values:  # drawn after the key, so near_values=0 makes the items it made before
                lines[i] = f"{lines[i].split(': ')[0]}: {words.near_digits(rng, value, near_values)}"
        at = _slot(depth, len(lines), rng)
        lines.insert(at, asked)
        key, value = asked.split(": ")
        d = at / max(1, len(lines) - 1)
        return Example(self.name, uid, head + "\n".join(lines), f"What is the value of the key {key}?", value,
                       "Answer with the value only.", {"depth": round(d, 4), "lines": len(lines),
                                                       "context_tokens": context_tokens})

    def score(self, prediction, example):
        return {"em": exact_match(prediction, example.answer)}


class Needle(Task):
    name = "needle"
    metrics = ("em",)
    defaults = {"context_tokens": 1024, "depth": None, "hops": 1, "distractors": 2}
    max_answer_tokens = 8

    def make(self, rng, uid, count, context_tokens=1024, depth=None, hops=1, distractors=2) -> Example:
        _check(context_tokens, depth)
        if hops not in (1, 2) or not 0 <= distractors <= 16:
            raise ValueError("needle: hops 1 or 2, distractors in [0, 16]")
        taken: set = set()
        names = words.distinct(rng, words.name, 2 + distractors, taken)
        numbers = words.distinct(rng, lambda r: words.digits(r, 7), 2 + distractors)
        asked, second = names[0], names[1]
        if hops == 1:
            needle, answer = f"The secret number of {asked} is {numbers[0]}.", numbers[0]
            extra = []
        else:
            needle, answer = f"{asked} has the same secret number as {second}.", numbers[1]
            extra = [f"The secret number of {second} is {numbers[1]}."]
        extra += [f"The secret number of {n} is {x}." for n, x in zip(names[2:], numbers[2:])]
        head = "Below is a long document. Read it carefully, then answer the question.\n\n"
        question = f"What is the secret number of {asked}?"
        budget = context_tokens - count(head) - count(question) - 16 - sum(count(" " + s) for s in [needle, *extra])
        sents, used = [], 0
        while True:
            s = words.filler_sentence(rng)
            cost = count(" " + s)
            if sents and used + cost > budget:
                break
            sents.append(s)
            used += cost
        for s in extra:  # other facts at random places
            sents.insert(rng.randint(0, len(sents)), s)
        at = _slot(depth, len(sents), rng)
        sents.insert(at, needle)
        d = at / max(1, len(sents) - 1)
        return Example(self.name, uid, head + " ".join(sents), f"Question: {question}", answer,
                       "Answer with the number only.",
                       {"depth": round(d, 4), "hops": hops, "distractors": distractors,
                        "context_tokens": context_tokens})

    def score(self, prediction, example):
        return {"em": exact_match(prediction, example.answer)}


register(KeyValue())
register(Needle())
