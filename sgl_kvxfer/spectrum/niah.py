"""Needle-in-a-haystack prompts for the int4 tolerance probe (paper Sec. 4.5).

A 7-digit passcode sentence is inserted at a relative depth inside filler prose, followed by the
retrieval question (the paper's App. B fix iii: the question must be present). The returned text
is the *user message*; the caller applies the model's chat template.
"""
from __future__ import annotations

import importlib
import inspect
import json
import logging
import os
import random
import re
import warnings
from dataclasses import dataclass
from typing import Callable, Sequence

from sgl_kvxfer import env

logger = logging.getLogger(__name__)

DEFAULT_PROSE_PATH = env.PROBE_PROSE.default
# Fallback filler where no prose file exists (a clean clone): module docstrings of the standard
# library, which every Python install carries. Same Python version -> same text -> same prompts.
STDLIB_PROSE_MODULES = ("argparse", "asyncio", "collections", "concurrent.futures", "contextlib", "csv",
                        "dataclasses", "datetime", "decimal", "difflib", "email", "enum", "fractions",
                        "functools", "heapq", "http.server", "inspect", "itertools", "json", "logging",
                        "multiprocessing", "pathlib", "pickle", "random", "re", "sched", "shlex",
                        "shutil", "socket", "sqlite3", "statistics", "string", "subprocess", "tarfile",
                        "textwrap", "threading", "timeit", "typing", "unittest", "urllib.parse",
                        "uuid", "warnings", "weakref", "zipfile")
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


def load_filler_texts(path: str | None = None) -> list[str]:
    """`text` fields of a JSONL file whose rows are {"source": ..., "text": ...}: `path`, else
    $SGL_KVXFER_PROBE_PROSE (default the project's prose eval split). A path given explicitly
    must exist; when the default file is absent, the standard library's docstrings are used."""
    if path is not None:
        return _read_jsonl_texts(path)
    path = env.PROBE_PROSE.get()
    if os.path.exists(path):
        return _read_jsonl_texts(path)
    if path != DEFAULT_PROSE_PATH:
        raise FileNotFoundError(f"{env.PROBE_PROSE.name}={path}: no such file")
    logger.info("NIAH filler: %s not found; using the Python standard library's docstrings", path)
    return stdlib_docstrings()


def _read_jsonl_texts(path: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f if line.strip()]
    if not texts:
        raise ValueError(f"{path}: no rows")
    return texts


def stdlib_docstrings() -> list[str]:
    """Module, class and function docstrings of STDLIB_PROSE_MODULES that are paragraphs of prose."""
    texts = []
    with warnings.catch_warnings():  # deprecated aliases (typing.io, typing.re) warn when touched
        warnings.simplefilter("ignore", DeprecationWarning)
        for name in STDLIB_PROSE_MODULES:
            try:
                module = importlib.import_module(name)
            except ImportError:  # e.g. sqlite3 missing from a minimal build
                continue
            objs = [module] + [obj for _, obj in sorted(vars(module).items())
                               if (inspect.isclass(obj) or inspect.isfunction(obj)) and
                               getattr(obj, "__module__", None) == module.__name__]
            for obj in objs:
                doc = inspect.getdoc(obj)
                if doc and len(doc) >= 200:
                    texts.append(doc)
    return texts


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
