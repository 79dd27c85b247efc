"""Needle-in-a-haystack prompts for the int4 tolerance probe (paper Sec. 4.5).

A 7-digit passcode sentence is inserted at a relative depth inside filler prose, followed by the
retrieval question (the paper's App. B fix iii: the question must be present). The returned text
is the *user message*; the caller applies the model's chat template.
"""
from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from typing import Callable, Sequence

DEFAULT_PROSE_PATH = "/work/shared/data/prose_eval.jsonl"
CHARS_PER_TOKEN = 4.0  # used only when no tokenizer-backed count_tokens is given

_INTRO = ("Below is a long document. Somewhere inside it is a secret passcode. "
          "Read the document carefully, then answer the question that follows it.\n\n<document>\n")
_OUTRO = ("\n</document>\n\nQuestion: What is the secret passcode mentioned in the document? "
          "Reply with the 7-digit passcode only.")


@dataclass(frozen=True)
class NIAHTrial:
    prompt: str
    passcode: str
    depth: float


def load_filler_texts(path: str = DEFAULT_PROSE_PATH) -> list[str]:
    """`text` fields of a JSONL file whose rows are {"source": ..., "text": ...}."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f if line.strip()]


def make_passcode(rng: random.Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


def needle_sentence(passcode: str) -> str:
    return f"The secret passcode is {passcode}. Remember this passcode."


def _filler(texts: Sequence[str], num_chars: int, start: int) -> str:
    out, size, i = [], 0, start
    while size < num_chars:
        t = texts[i % len(texts)].strip()
        out.append(t)
        size += len(t) + 2
        i += 1
    return "\n\n".join(out)[:num_chars]


def _insert(filler: str, needle: str, depth: float) -> str:
    """Insert at the last line break at or before depth * len (a paragraph-ish boundary)."""
    cut = int(len(filler) * min(max(depth, 0.0), 1.0))
    nl = filler.rfind("\n", 0, cut)
    cut = nl + 1 if nl >= 0 and cut - nl < 2000 else cut
    return f"{filler[:cut]}\n{needle}\n{filler[cut:]}"


def build_niah_prompt(texts: Sequence[str], passcode: str, depth: float, target_tokens: int = 4096,
                      count_tokens: Callable[[str], int] | None = None, start: int = 0) -> str:
    """User message of ~target_tokens tokens with the needle at relative `depth` in [0, 1].

    count_tokens (a tokenizer-backed length) trims the filler to fit; else CHARS_PER_TOKEN.
    """
    count = count_tokens or (lambda s: int(len(s) / CHARS_PER_TOKEN))
    num_chars = int(target_tokens * CHARS_PER_TOKEN)
    for _ in range(4):  # shrink until it fits (a couple of rounds for a real tokenizer)
        prompt = _INTRO + _insert(_filler(texts, num_chars, start), needle_sentence(passcode), depth) + _OUTRO
        tokens = count(prompt)
        if tokens <= target_tokens:
            break
        num_chars = int(num_chars * target_tokens / tokens * 0.98)
    return prompt


def niah_success(response: str, passcode: str) -> bool:
    """True iff the passcode appears as a whole number (digits may be split by spaces, commas, dashes)."""
    pattern = rf"(?<!\d){re.escape(passcode)}(?!\d)"
    joined = re.sub(r"(?<=\d)[ ,\-](?=\d)", "", response)
    return any(re.search(pattern, text) is not None for text in (response, joined))


def build_probe_trials(texts: Sequence[str], num_trials: int = 3, depths: Sequence[float] = (0.25, 0.5, 0.75),
                       seed: int = 0, target_tokens: int = 4096,
                       count_tokens: Callable[[str], int] | None = None) -> list[NIAHTrial]:
    """Deterministic probe trials: trial i uses depths[i % len], its own passcode and filler start."""
    rng = random.Random(seed)
    trials = []
    for i in range(num_trials):
        passcode = make_passcode(rng)
        start = rng.randrange(len(texts))
        prompt = build_niah_prompt(texts, passcode, depths[i % len(depths)], target_tokens, count_tokens, start)
        while prompt.count(passcode) != 1:  # the filler must not already contain the code
            passcode = make_passcode(rng)
            prompt = build_niah_prompt(texts, passcode, depths[i % len(depths)], target_tokens, count_tokens, start)
        trials.append(NIAHTrial(prompt=prompt, passcode=passcode, depth=depths[i % len(depths)]))
    return trials
