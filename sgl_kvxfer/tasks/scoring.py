"""Exact scoring: answer extraction, SQuAD-style EM / token F1, and a safe evaluator of the small
Python expressions the code task uses (unit tests without exec).

A prediction is read up to its first line break (models often add an explanation after it),
stripped of quotes, backticks and an "Answer:" label.
"""
from __future__ import annotations

import ast
import operator
import re
import string
from collections import Counter

_WORD = re.compile(r"\w+")
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_LABEL = re.compile(r"^(final\s+)?answer\s*[:\-]\s*", re.IGNORECASE)


def extract_answer(prediction: str) -> str:
    """The first non-empty line, without an "Answer:" label, quotes or a trailing period."""
    lines = [x.strip() for x in prediction.strip().split("\n") if x.strip()]
    s = lines[0] if lines else ""
    s = _LABEL.sub("", s).strip()
    s = s[:-1].rstrip() if s.endswith(".") else s
    return s.strip("`\"'").strip()


def normalize(s: str) -> str:
    """SQuAD normalization: lower case, no punctuation, no articles, single spaces."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    return " ".join(_ARTICLES.sub(" ", s).split())


def exact_match(prediction: str, answer: str) -> float:
    return float(normalize(extract_answer(prediction)) == normalize(answer))


def token_f1(prediction: str, answer: str) -> float:
    p, a = normalize(extract_answer(prediction)).split(), normalize(answer).split()
    if not p or not a:
        return float(p == a)
    common = sum((Counter(p) & Counter(a)).values())
    if common == 0:
        return 0.0
    prec, rec = common / len(p), common / len(a)
    return 2 * prec * rec / (prec + rec)


# ---------------------------------------------------------------------------- safe evaluation
_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
           ast.Mod: operator.mod}
_CMPOPS = {ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt, ast.GtE: operator.ge,
           ast.Eq: operator.eq, ast.NotEq: operator.ne}
_BUILTINS = {"abs": abs, "min": min, "max": max}
MAX_ABS = 10 ** 12  # larger intermediate values fail the test (no huge powers or products)


class UnsafeExpression(ValueError):
    """The expression uses something the evaluator does not allow."""


def safe_eval(expr: str, env: dict, functions: dict | None = None, depth: int = 0):
    """Evaluate an integer expression over names in `env`: + - * // %, comparisons, a
    conditional expression, abs / min / max, and calls to `functions` (name -> (params, body
    expression), themselves evaluated safely). Anything else raises UnsafeExpression."""
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except SyntaxError as e:
        raise UnsafeExpression(f"not an expression: {expr!r}") from e
    return _eval(tree.body, env, functions or {}, depth)


def _eval(node, env, fns, depth):
    if depth > 8:
        raise UnsafeExpression("calls nest too deep")
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.Name):
        if node.id not in env:
            raise UnsafeExpression(f"unknown name {node.id!r}")
        return env[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_eval(node.operand, env, fns, depth)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        a, b = _eval(node.left, env, fns, depth), _eval(node.right, env, fns, depth)
        if isinstance(node.op, (ast.FloorDiv, ast.Mod)) and b == 0:
            raise UnsafeExpression("division by zero")
        out = _BINOPS[type(node.op)](a, b)
        if abs(out) > MAX_ABS:
            raise UnsafeExpression("value too large")
        return out
    if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _CMPOPS:
        return int(_CMPOPS[type(node.ops[0])](_eval(node.left, env, fns, depth),
                                              _eval(node.comparators[0], env, fns, depth)))
    if isinstance(node, ast.IfExp):
        return _eval(node.body if _eval(node.test, env, fns, depth) else node.orelse, env, fns, depth)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.keywords:
        args = [_eval(a, env, fns, depth) for a in node.args]
        if node.func.id in _BUILTINS and args:
            return _BUILTINS[node.func.id](*args)
        if node.func.id in fns:
            params, body = fns[node.func.id]
            if len(params) != len(args):
                raise UnsafeExpression(f"{node.func.id} takes {len(params)} arguments")
            return safe_eval(body, dict(zip(params, args)), fns, depth + 1)
    raise UnsafeExpression(f"not allowed: {ast.dump(node)[:80]}")
