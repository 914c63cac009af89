"""Answer scorers for tasks read from data files (`masgraph.tasks.data`): pure functions of (answer, gold, item fields)
-> a score in [0, 1]. Each is named in a task file's `scorer:`.

    exact     the answer equals a gold answer, after trimming and case-folding
    contains  a gold answer, normalised (lower case, articles and punctuation dropped, spaces squeezed), appears in
              the normalised answer as whole words (the usual QA "contains" check)
    number    the last number in the answer equals a numeric gold answer as a number (8.0 = 8, 1,234 = 1234)
    choice    multiple choice: the option letter the answer names (A, (B), "C." ...) or the option's text is the gold
              option's
    game24    Game of 24: the answer's expression uses exactly the item's four numbers, each once, and evaluates to 24
              (exact rational arithmetic on `masgraph.tasks.arith`'s parser; never `eval`)

A gold answer may hold several alternatives (a JSON list, or the string of a Python list as AgentFlow's files
write them): the answer scores 1 if it matches any.
"""

from __future__ import annotations

import ast
import re
import string
from collections import Counter
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import Any

from masgraph.tasks.arith import ArithError
from masgraph.tasks.arith import calculate as _checked  # parses and range-checks (the tool's rules)

__all__ = ["SCORERS", "alternatives", "choice", "contains", "exact", "game24", "normalise", "number"]

Scorer = Callable[[str, Sequence[str], dict[str, Any]], float]


def alternatives(gold: Any) -> list[str]:
    """The gold answers a field holds: a list's items, a string that spells a Python/JSON list parsed safely
    (`ast.literal_eval`: literals only), else the value itself as one string."""
    if isinstance(gold, list | tuple):
        return [str(g) for g in gold]
    text = str(gold).strip()
    if text.startswith("[") and text.endswith("]"):
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            return [text]
        if isinstance(value, list | tuple) and value:
            return [str(v) for v in value]
    return [text]


def normalise(text: str) -> str:
    """Lower case, punctuation and the articles a/an/the dropped, whitespace squeezed (SQuAD's normalisation)."""
    text = "".join(" " if c in string.punctuation else c for c in text.lower())
    return " ".join(w for w in text.split() if w not in ("a", "an", "the"))


def exact(answer: str, gold: Sequence[str], item: dict[str, Any]) -> float:
    return float(any(answer.strip().casefold() == g.strip().casefold() for g in gold))


def contains(answer: str, gold: Sequence[str], item: dict[str, Any]) -> float:
    said = f" {normalise(answer)} "
    return float(any(g and f" {g} " in said for g in map(normalise, gold)))


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:/\d+)?")


def _as_fraction(text: str) -> Fraction | None:
    try:
        return Fraction(text.replace(",", "").strip())
    except (ValueError, ZeroDivisionError):
        return None


def number(answer: str, gold: Sequence[str], item: dict[str, Any]) -> float:
    found = _NUMBER.findall(re.sub(r"(?<=\d),(?=\d{3}\b)", "", answer))
    if not found:
        return 0.0
    said = _as_fraction(found[-1])
    return float(said is not None and any(_as_fraction(g) == said for g in gold))


_LETTER = re.compile(r"(?:^|[\s(\[*:])([A-J])(?:$|[\s).\]*:,])")


def _options(item: dict[str, Any]) -> list[str]:
    """The item's options, in order (a `choices` or `options` field: a list, or the string of one)."""
    for key in ("choices", "options"):
        if key in item:
            return alternatives(item[key])
    return []


def _letter_of(option: str) -> str | None:
    m = re.match(r"\s*\(?([A-J])[.):]\s", option + " ")
    return m.group(1) if m else None


def _text_of(option: str) -> str:
    return re.sub(r"^\s*\(?[A-J][.):]\s*", "", option)


def choice(answer: str, gold: Sequence[str], item: dict[str, Any]) -> float:
    options = _options(item)
    want = set()
    for g in gold:  # a gold letter ("A", "A. 0.9") or a gold option text ("Colorectal cancer")
        letter = _letter_of(g) or (g.strip() if re.fullmatch(r"\s*[A-J]\s*", g) else None)
        if letter:
            want.add(letter)
        want |= {_letter_of(o) or chr(65 + i) for i, o in enumerate(options)
                 if normalise(_text_of(o)) == normalise(_text_of(g))}
    if not want:
        return 0.0
    named = _LETTER.findall(answer.strip())
    if named:
        return float(named[-1] in want)
    said = normalise(answer)  # no letter: the option whose text the answer gives
    hits = {_letter_of(o) or chr(65 + i) for i, o in enumerate(options) if normalise(_text_of(o)) in said.split(" ")
            or f" {normalise(_text_of(o))} " in f" {said} "}
    return float(len(hits) == 1 and hits <= want)


_EXPRESSION = re.compile(r"[\d(][\d\s()+\-*/×÷xX.]*[\d)]")


def _rational(node: ast.AST) -> Fraction:
    """An expression of + - * / and parentheses over integers, exactly (2/3 stays 2/3)."""
    if isinstance(node, ast.Expression):
        return _rational(node.body)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_rational(node.operand)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add | ast.Sub | ast.Mult | ast.Div):
        a, b = _rational(node.left), _rational(node.right)
        if isinstance(node.op, ast.Add):
            return a + b
        if isinstance(node.op, ast.Sub):
            return a - b
        if isinstance(node.op, ast.Mult):
            return a * b
        if b == 0:
            raise ArithError("division by zero")
        return a / b
    raise ArithError(f"only integers, + - * / and parentheses count in Game of 24, not {type(node).__name__}")


def _numbers_of(item: dict[str, Any]) -> list[int] | None:
    """The puzzle's four numbers: the first four integers of its `numbers`, `question` or `query` field."""
    for key in ("numbers", "question", "query"):
        found = re.findall(r"\d+", str(item.get(key, "")))
        if len(found) >= 4:
            return [int(x) for x in found[:4]]
    return None


def game24(answer: str, gold: Sequence[str], item: dict[str, Any]) -> float:
    """1 when an expression in the answer uses exactly the item's four numbers, each once, and equals 24."""
    numbers = _numbers_of(item)
    if numbers is None:
        return 0.0
    text = answer.replace("×", "*").replace("÷", "/").replace("x", "*").replace("X", "*")
    for candidate in reversed(_EXPRESSION.findall(text)):  # the last expression is usually the final one
        expr = candidate.strip().rstrip("=").strip()
        try:
            _checked(expr)  # the calculator's own checks: one expression, sizes in range
            value = _rational(ast.parse(expr, mode="eval"))
        except (ArithError, SyntaxError, ValueError, RecursionError, MemoryError):
            continue
        used = [int(x) for x in re.findall(r"\d+", expr)]
        if Counter(used) == Counter(numbers) and value == 24:
            return 1.0
    return 0.0


SCORERS: dict[str, Scorer] = {"exact": exact, "contains": contains, "number": number, "choice": choice,
                              "game24": game24}
"""Scorer name (a task file's `scorer:`) -> function."""
