"""Seeded vocabulary: pseudo-words, names, numbers and filler sentences (stdlib only).

Every entity the tasks ask about is a made-up word, so no model can answer from memory: the
answer has to be read from the context. All functions take a `random.Random`, so a task item
is a pure function of its seed.
"""
from __future__ import annotations

import random
import string

_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "gr", "kl",
           "pr", "st", "tr", "sk", "th", "sh", "ch")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ou", "ea", "io")
_CODAS = ("", "", "n", "r", "s", "l", "k", "th", "m", "x")


def pseudo_word(rng: random.Random, syllables: tuple[int, int] = (2, 3)) -> str:
    """A pronounceable made-up word, lower case ("dravoun", "kelith")."""
    n = rng.randint(*syllables)
    return "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(n)) + rng.choice(_CODAS)


def name(rng: random.Random, syllables: tuple[int, int] = (2, 3)) -> str:
    return pseudo_word(rng, syllables).capitalize()


def person(rng: random.Random) -> str:
    """A first and last name ("Tolan Brekith")."""
    return f"{name(rng, (2, 2))} {name(rng, (2, 3))}"


def distinct(rng: random.Random, make, n: int, taken: set | None = None) -> list[str]:
    """n distinct values of make(rng), none in `taken` (which is updated)."""
    taken = set() if taken is None else taken
    out = []
    while len(out) < n:
        x = make(rng)
        if x not in taken:
            taken.add(x)
            out.append(x)
    return out


def digits(rng: random.Random, n: int) -> str:
    """n decimal digits, no leading zero."""
    return str(rng.randint(1, 9)) + "".join(rng.choice(string.digits) for _ in range(n - 1))


def near_digits(rng: random.Random, value: str, m: int) -> str:
    """`value` (decimal digits) with m distinct positions changed to other digits (no leading zero)."""
    out = list(value)
    for i in rng.sample(range(len(value)), m):
        out[i] = rng.choice([d for d in string.digits if d != value[i] and (i or d != "0")])
    return "".join(out)


def key_id(rng: random.Random) -> str:
    """A key like "kx7-q2m4" (letters and digits, easy to tokenize apart)."""
    alnum = string.ascii_lowercase + string.digits
    return "".join(rng.choice(alnum) for _ in range(3)) + "-" + "".join(rng.choice(alnum) for _ in range(4))


def near_key(rng: random.Random, key: str) -> str:
    """`key` (a key_id) with one letter or digit replaced by another: a near-duplicate key."""
    alnum = string.ascii_lowercase + string.digits
    i = rng.choice([j for j, c in enumerate(key) if c != "-"])
    return key[:i] + rng.choice(alnum.replace(key[i], "")) + key[i + 1:]


_SUBJECTS = ("The committee", "A traveller", "The old library", "Every spring the valley", "The river",
             "A quiet village", "The market", "The workshop", "Her neighbour", "The northern road",
             "A small boat", "The council", "The gardener", "A passing merchant", "The harbour")
_VERBS = ("considered", "welcomed", "described", "ignored", "remembered", "visited", "painted", "measured",
          "recorded", "crossed", "repaired", "praised", "questioned", "followed", "collected")
_OBJECTS = ("the long winter", "a crowded festival", "the eastern hills", "an unfinished bridge",
            "the morning fog", "a forgotten map", "the stone tower", "a basket of apples", "the evening bells",
            "a narrow staircase", "the wide meadow", "an empty warehouse", "the copper roofs",
            "a letter from abroad", "the slow tide")
_TAILS = ("without hurry.", "for many years.", "before the rain came.", "with great care.", "once again.",
          "as the sun set.", "in silence.", "after the harvest.", "during the night.", "at dawn.")


def filler_sentence(rng: random.Random) -> str:
    """A plain sentence that carries no fact any task asks about."""
    return f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_TAILS)}"
