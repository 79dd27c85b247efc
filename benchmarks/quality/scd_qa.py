"""A seeded extractive-QA set built from the SCD corpora's eval split (answers are spans of the context).

For each corpus, documents are visited in a seeded order; from each, up to `per_doc` context
windows of `context_chars` characters (cut at line starts) are taken, and one question is asked
about each window:

  next-words   (code and prose)  an anchor of 5-9 consecutive words from a line in the window's
               second half is quoted, the answer is the 2-5 words that follow it on that line.
               The anchor occurs exactly once in the window.
  assignment   (code, half of the windows when available)  a line `NAME = VALUE` whose NAME is
               assigned exactly once in the window; the answer is VALUE (1-8 words).

Every answer occurs verbatim in its context (checked). Scoring is token F1 (SQuAD style: the
bag of lower-cased \\w+ tokens of the prediction's first line vs the answer's), max over nothing
else (one reference). Same seed, same data -> the same items.
"""
from __future__ import annotations

import random
import re
from collections import Counter
from dataclasses import asdict, dataclass

_ASSIGN = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_.]*)\s*=\s*([^=\s].*?)\s*$")
_WORD = re.compile(r"\w+")


@dataclass(frozen=True)
class QAItem:
    qid: str
    corpus: str
    kind: str
    context: str
    question: str
    answer: str

    def prompt(self) -> str:
        return (f"{self.context}\n\n{self.question}\nAnswer with the exact words from the text above, "
                f"nothing else.")

    def to_dict(self) -> dict:
        return asdict(self)


def _window(text: str, rng: random.Random, chars: int) -> str | None:
    if len(text) < chars // 2:
        return None
    start = rng.randrange(0, max(1, len(text) - chars))
    nl = text.rfind("\n", 0, start)
    start = 0 if nl < 0 else nl + 1
    win = text[start:start + chars]
    cut = win.rfind("\n")
    return win[:cut] if cut > chars // 2 else win


def _next_words(ctx: str, rng: random.Random) -> tuple[str, str] | None:
    lines = ctx.split("\n")
    order = list(range(len(lines) // 2, len(lines)))
    rng.shuffle(order)
    for i in order:
        words = lines[i].split()
        if len(words) < 8:
            continue
        n_anchor = rng.randint(5, min(9, len(words) - 2))
        start = rng.randint(0, len(words) - n_anchor - 2)
        anchor = " ".join(words[start:start + n_anchor])
        n_ans = rng.randint(2, min(5, len(words) - start - n_anchor))
        answer = " ".join(words[start + n_anchor:start + n_anchor + n_ans])
        if ctx.count(anchor) == 1 and anchor + " " + answer in " ".join(ctx.split()) and _WORD.search(answer):
            return f'In the text above, which words come right after "{anchor}"?', answer
    return None


def _assignment(ctx: str, rng: random.Random) -> tuple[str, str] | None:
    found = [m for m in (_ASSIGN.match(line) for line in ctx.split("\n")) if m]
    counts = Counter(m.group(1) for m in found)
    ok = [m for m in found if counts[m.group(1)] == 1 and 1 <= len(m.group(2).split()) <= 8
          and _WORD.search(m.group(2)) and len(m.group(1)) > 1]
    if not ok:
        return None
    m = rng.choice(ok)
    return f"In the code above, what value is assigned to {m.group(1)}?", m.group(2)


def build_qa(texts: dict[str, list[str]], per_corpus: int = 150, seed: int = 0, context_chars: int = 1600,
             per_doc: int = 4) -> list[QAItem]:
    """texts: corpus name -> documents (the eval split). Returns per_corpus items per corpus
    (fewer only if the documents run out)."""
    items: list[QAItem] = []
    for corpus in sorted(texts):
        rng = random.Random(f"{seed}:{corpus}")
        docs = list(range(len(texts[corpus])))
        rng.shuffle(docs)
        made = 0
        for round_ in range(per_doc):
            for d in docs:
                if made >= per_corpus:
                    break
                ctx = _window(texts[corpus][d], rng, context_chars)
                if ctx is None:
                    continue
                qa = None
                if corpus == "code" and rng.random() < 0.5:
                    qa = _assignment(ctx, rng)
                kind = "assignment" if qa else "next-words"
                qa = qa or _next_words(ctx, rng)
                if qa is None:
                    continue
                assert qa[1] in ctx or qa[1] in " ".join(ctx.split()), qa
                items.append(QAItem(f"{corpus}-{d}-{round_}", corpus, kind, ctx, qa[0], qa[1]))
                made += 1
    return items


def normalize_tokens(s: str) -> list[str]:
    return _WORD.findall(s.lower())


def first_line(s: str) -> str:
    s = s.strip()
    return s.split("\n", 1)[0].strip().strip('"`\'')


def f1(prediction: str, answer: str) -> float:
    """Token F1 between the prediction's first line and the answer (lower-cased \\w+ tokens)."""
    p, a = normalize_tokens(first_line(prediction)), normalize_tokens(answer)
    if not p or not a:
        return float(p == a)
    common = sum((Counter(p) & Counter(a)).values())
    if common == 0:
        return 0.0
    prec, rec = common / len(p), common / len(a)
    return 2 * prec * rec / (prec + rec)
