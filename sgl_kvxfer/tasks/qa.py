"""Extractive QA over a synthetic document with distractors (metrics: F1, EM).

The document describes `entities` made-up organisations, each with 3 of the attributes below
(a founder, a town, a year, a product, a head count, a current head), plus `filler` sentences,
shuffled. The question asks one attribute of one entity; the same attribute of at least one
other entity is in the document (the distractor), and "founder" and "current head" (two
people) are both present for the asked entity whenever one of them is asked. The answer is a
span of the document, checked verbatim.
"""
from __future__ import annotations

import random

from sgl_kvxfer.tasks import words
from sgl_kvxfer.tasks.base import Example, Task, register
from sgl_kvxfer.tasks.scoring import exact_match, token_f1

_KINDS = ("Institute", "Company", "Mills", "Foundry", "Guild", "Works", "Society", "Trading House")
INSTRUCTION = "Answer with the exact words from the document, nothing else."


def _attributes(rng: random.Random, ent: str, taken: set) -> dict[str, tuple[str, str, str]]:
    """attribute -> (sentence, question, answer)."""
    founder, head = words.distinct(rng, words.person, 2, taken)
    town = words.distinct(rng, words.name, 1, taken)[0]
    product = f"{words.pseudo_word(rng, (2, 2))} {words.pseudo_word(rng, (1, 2))}"
    year, workers = str(rng.randint(1520, 1990)), str(rng.randint(12, 9800))
    return {
        "founder": (f"{ent} was founded by {founder}.", f"Who founded {ent}?", founder),
        "head": (f"The current head of {ent} is {head}.", f"Who is the current head of {ent}?", head),
        "town": (f"{ent} is located in the town of {town}.", f"In which town is {ent} located?", town),
        "year": (f"{ent} opened its doors in {year}.", f"In which year did {ent} open its doors?", year),
        "product": (f"{ent} is best known for its {product}.", f"What is {ent} best known for?", product),
        "workers": (f"{ent} employs {workers} workers.", f"How many workers does {ent} employ?", workers),
    }


def _cap(s: str) -> str:
    return s[0].upper() + s[1:]


class ExtractiveQA(Task):
    name = "qa"
    metrics = ("f1", "em")
    defaults = {"entities": 5, "facts": 3, "filler": 4}
    max_answer_tokens = 12

    def make(self, rng, uid, count, entities=5, facts=3, filler=4) -> Example:
        if not 2 <= entities <= 40 or not 2 <= facts <= 6 or not 0 <= filler <= 200:
            raise ValueError("qa: entities in [2, 40], facts in [2, 6], filler in [0, 200]")
        taken: set = set()
        ents = [f"the {n} {rng.choice(_KINDS)}" for n in words.distinct(rng, words.name, entities, taken)]
        attrs = [_attributes(rng, e, taken) for e in ents]
        target, kind = 0, rng.choice(tuple(attrs[0]))
        chosen = []
        for i, a in enumerate(attrs):
            keys = list(a)
            rng.shuffle(keys)
            pick = keys[:facts]
            if i == 0:
                pick = [kind] + [k for k in pick if k != kind][:facts - 1]
                if kind in ("founder", "head"):  # both people of the asked entity are present
                    pick = list(dict.fromkeys([kind, "head" if kind == "founder" else "founder", *pick]))[:max(2, facts)]
            if i == 1 and kind not in pick:  # the distractor: the same attribute of another entity
                pick[0] = kind
            chosen += [_cap(a[k][0]) for k in pick]
        chosen += [words.filler_sentence(rng) for _ in range(filler)]
        rng.shuffle(chosen)
        sentence, question, answer = attrs[target][kind]
        context = " ".join(chosen)
        assert _cap(sentence) in context and answer in context
        ctx = "Read the document and answer the question.\n\nDocument: " + context
        return Example(self.name, uid, ctx, f"Question: {_cap(question)}", answer, INSTRUCTION,
                       {"attribute": kind, "entities": entities})

    def score(self, prediction, example):
        return {"f1": token_f1(prediction, example.answer), "em": exact_match(prediction, example.answer)}


register(ExtractiveQA())
