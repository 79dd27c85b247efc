"""Short code completion against the helpers of a module (metrics: pass, EM).

The context is a Python module of `helpers` small functions, each documented as "the <word>
score of a and b" (a made-up word) and returning an integer expression, then one unfinished
function whose docstring describes its result through those scores. The answer is the
expression after its `return`: the helper to call has to be looked up by its description.

pass: the prediction, evaluated on `tests` seeded (x, y) pairs with the module's helpers in
scope (scoring.safe_eval: integer arithmetic, comparisons, abs / min / max and calls to the
helpers, nothing else), equals the reference on every pair. EM: the same expression up to
whitespace.
"""
from __future__ import annotations

import random

from sgl_kvxfer.tasks import words
from sgl_kvxfer.tasks.base import Example, Task, register
from sgl_kvxfer.tasks.scoring import UnsafeExpression, extract_answer, safe_eval

_HELPER_BODIES = ("a * {c} + b", "a + b * {c}", "(a - b) * {c}", "a * b - {c}", "max(a, b) + {c}",
                  "min(a, b) * {c}", "abs(a - b) + {c}", "a * a + b * {c}", "(a + {c}) * b", "a - b + {c}")
_TARGETS = (  # (docstring, expression) over helpers h1, h2 with scores s1, s2 and a constant c
    ("Return the {s1} score of x and y, multiplied by {c}.", "{h1}(x, y) * {c}"),
    ("Return the {s1} score of y and x, plus {c}.", "{h1}(y, x) + {c}"),
    ("Return the {s1} score of x and y minus the {s2} score of x and y.", "{h1}(x, y) - {h2}(x, y)"),
    ("Return the larger of the {s1} score of x and y and the number {c}.", "max({h1}(x, y), {c})"),
    ("Return the {s1} score of x and {c}.", "{h1}(x, {c})"),
    ("Return the {s1} score of the {s2} score of x and y and y.", "{h1}({h2}(x, y), y)"),
)
INSTRUCTION = "Write only the expression that follows `return`, nothing else."


class CodeCompletion(Task):
    name = "code"
    metrics = ("pass", "em")
    defaults = {"helpers": 4, "tests": 5}
    # SmolLM2's BPE splits the made-up helper names into many pieces: gold answers run to 31
    # tokens over 5000 items of each split (median 17), plus the end of turn
    max_answer_tokens = 40

    def make(self, rng, uid, count, helpers=4, tests=5) -> Example:
        if not 2 <= helpers <= 40 or not 1 <= tests <= 50:
            raise ValueError("code: helpers in [2, 40], tests in [1, 50]")
        taken: set = set()
        fnames = [f"{a}_{b}" for a, b in zip(words.distinct(rng, words.pseudo_word, helpers, taken),
                                              words.distinct(rng, lambda r: words.pseudo_word(r, (1, 2)), helpers, taken))]
        scores = words.distinct(rng, words.pseudo_word, helpers, taken)
        bodies = [rng.choice(_HELPER_BODIES).format(c=rng.randint(2, 9)) for _ in range(helpers)]
        i1, i2 = rng.sample(range(helpers), 2)
        doc, expr = rng.choice(_TARGETS)
        fill = {"h1": fnames[i1], "h2": fnames[i2], "s1": scores[i1], "s2": scores[i2], "c": rng.randint(2, 9)}
        target = words.pseudo_word(rng, (2, 2)) + "_total"
        src = [f'def {f}(a, b):\n    """Compute the {s} score of a and b."""\n    return {b}\n'
               for f, s, b in zip(fnames, scores, bodies)]
        src.append(f'def {target}(x, y):\n    """{doc.format(**fill)}"""\n    return ...\n')
        context = "Here is a Python module:\n\n" + "\n\n".join(src)
        pairs = [(rng.randint(-20, 20), rng.randint(-20, 20)) for _ in range(tests)]
        return Example(self.name, uid, context, f"Complete the return statement of {target}.", expr.format(**fill),
                       INSTRUCTION, {"helpers": {f: b for f, b in zip(fnames, bodies)}, "tests": pairs})

    def score(self, prediction, example):
        pred = extract_answer(prediction)
        pred = pred[len("return"):].strip() if pred.startswith("return ") else pred
        em = float("".join(pred.split()) == "".join(example.answer.split()))
        fns = {f: (("a", "b"), body) for f, body in example.meta["helpers"].items()}
        try:
            ok = all(safe_eval(pred, {"x": x, "y": y}, fns) == safe_eval(example.answer, {"x": x, "y": y}, fns)
                     for x, y in example.meta["tests"])
        except (UnsafeExpression, TypeError, ValueError, RecursionError):
            ok = False
        return {"pass": float(ok), "em": em}


register(CodeCompletion())
