"""Safe arithmetic without `eval`: one expression of numbers, + - * / // % ** and parentheses, read from Python's
AST (prose around a single expression tolerated). The calculator tool and the Game-of-24 scorer both use it."""

from __future__ import annotations

import ast
import math
import operator
import re
import sys
import unicodedata
from typing import Any

__all__ = ["ArithError", "calculate", "format_number"]


class ArithError(ValueError):
    """Not one arithmetic expression, or one whose value is out of range; the message says which."""


_BIN = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_NODES = {ast.Expression, ast.UnaryOp, ast.BinOp, *_BIN, *_UNARY}
_SPAN = re.compile(r"[-+*/%().0-9\s]+")
_WORDS_BEFORE = re.compile(r"(?:[A-Za-z']+[:,]?\s+)*")
"""Prose allowed before a lenient expression: whole words, each followed by a space ("compute ", "what is ")."""
_WORDS_AFTER = re.compile(r"(?:\s+[A-Za-z' ,.]*)?")
"""Prose allowed after it: a space, then words ("please", "now")."""
MAX_EXPONENT = 100
MAX_MAGNITUDE = 10**30
MAX_CHARS = 150_000
"""Longest text read (prose included): ~0.1 s of parsing at most (10 MB took 9 s of CPU before its error)."""
_CODE = (ast.Lambda, ast.Attribute, ast.Subscript, ast.NamedExpr, ast.Starred, ast.Await, ast.Yield,
         ast.YieldFrom, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp, ast.IfExp, ast.JoinedStr)
"""Python constructs that make a text code, not prose around an expression (`lambda: 1` is not `1`)."""


def calculate(expression: str) -> int | float:
    """Evaluate one arithmetic expression without `eval`; raises ArithError on anything else.

    Prose around a single expression is tolerated ("compute 12 + 7 please", "12 + 7 ="), but not text glued
    to it ("1000!") nor several expressions or statements ("2 + 3; import os").
    """
    if len(expression) > MAX_CHARS:
        raise ArithError(f"expression too long: {len(expression)} characters (max {MAX_CHARS}): give one arithmetic "
                         "expression")
    text = _normalize(expression)
    if not text:
        raise ArithError("empty expression: give one arithmetic expression, e.g. (12 + 7) * 3")
    try:
        tree = _parse(text)
    except SyntaxError:
        tree = None
    if tree is not None and (code := next((n for n in ast.walk(tree) if isinstance(n, _CODE)), None)):
        raise ArithError(f"{_short(expression)} is Python code ({type(code).__name__}), not an arithmetic "
                         "expression: give numbers, + - * / // % ** and parentheses")
    if tree is None or not _is_arithmetic(tree):  # "what is 12 + 7" parses, as a comparison
        span = _lenient_span(expression, text)
        try:
            tree = _parse(span)
        except SyntaxError as exc:
            raise ArithError(f"not a valid arithmetic expression {_short(span)}: {exc.msg}") from None
    try:
        return _eval(tree.body)
    except (RecursionError, MemoryError):
        raise ArithError("expression is nested too deeply") from None


def _is_arithmetic(tree: ast.Expression) -> bool:
    return all(type(n) in _NODES or (type(n) is ast.Constant and type(n.value) in (int, float)) for n in ast.walk(tree))


def _short(text: str, chars: int = 60) -> str:
    return repr(text if len(text) <= chars else text[:chars] + "...")


def _normalize(expression: str) -> str:
    text = "".join(str(unicodedata.decimal(c)) if not c.isascii() and c.isdecimal() else c for c in expression)
    text = text.replace("×", "*").replace("÷", "/").replace("^", "**").strip().rstrip(" =?").rstrip()
    return re.sub(r"(?<=\d),(?=\d{3}\b)", "", text)  # 1,000 -> 1000


def _parse(text: str) -> ast.Expression:
    """`ast.parse` in eval mode; only SyntaxError escapes (as the signal to try the lenient reading)."""
    try:
        return ast.parse(text, mode="eval")
    except (RecursionError, MemoryError):
        raise ArithError("expression is nested too deeply") from None
    except (SyntaxError, ValueError) as exc:
        if "Exceeds the limit" in str(exc):  # a literal over Python's int-string digit limit (4300)
            raise ArithError(f"number too large: more than {sys.get_int_max_str_digits()} digits, out of range "
                            f"(max {MAX_MAGNITUDE:.0e})") from None
        if isinstance(exc, SyntaxError):
            raise
        raise ArithError(f"not an arithmetic expression: {exc}") from None  # e.g. a NUL byte


def _lenient_span(expression: str, text: str) -> str:
    """The one arithmetic span in prose; ArithError if there are several or text is glued to it."""
    spans = [m for m in _SPAN.finditer(text) if re.search(r"[0-9]", m.group())]
    if not spans:
        raise ArithError(f"not an arithmetic expression: {_short(expression)}")
    if len(spans) > 1:
        raise ArithError(f"several expressions or statements in {_short(expression)}: give exactly one expression")
    match = spans[0]
    start = match.start() + len(match.group()) - len(match.group().lstrip())
    end = match.end() - (len(match.group()) - len(match.group().rstrip()))
    span = text[start:end]
    if re.match(r"[*/%]|[-+]\s", span):
        raise ArithError(f"the expression {_short(span)} in {_short(expression)} lacks an operand before its "
                        "first operator")
    if not _WORDS_BEFORE.fullmatch(text[:start]):
        raise ArithError(f"unexpected {_short((text[:start].split() or [text[:start]])[-1])} before the expression "
                        f"in {_short(expression)}")
    if not _WORDS_AFTER.fullmatch(text[end:]):
        raise ArithError(f"unexpected {_short((text[end:].split() or [text[end:]])[0])} after the expression "
                        f"{_short(span)}: give exactly one expression of numbers, + - * / // % ** and parentheses")
    return span


def _eval(node: ast.AST) -> Any:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _literal(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BIN:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ArithError(f"exponent {right} is too large (max {MAX_EXPONENT})")
        try:
            return _in_range(_BIN[type(node.op)](left, right))
        except ZeroDivisionError:
            raise ArithError("division by zero") from None
        except OverflowError:
            raise ArithError(f"result out of range (max {MAX_MAGNITUDE:.0e})") from None
    raise ArithError(f"unsupported element {type(node).__name__} (only numbers and + - * / // % ** ( ))")


def _literal(value: float) -> float:
    """A number written in the expression, if within ±MAX_MAGNITUDE, else a ArithError that says so plainly."""
    if not _within(value):
        size = f"{len(str(abs(value)))} digits, " if isinstance(value, int) else ""
        raise ArithError(f"number too large: {size}out of range (max {MAX_MAGNITUDE:.0e})")
    return value


def _in_range(value: complex) -> float:
    """`value` if it is a real number within ±MAX_MAGNITUDE, else ArithError."""
    if isinstance(value, complex):
        raise ArithError("the result is a complex number (e.g. a fractional power of a negative number)")
    if not _within(value):
        raise ArithError(f"result out of range (max {MAX_MAGNITUDE:.0e})")
    return value


def _within(value: float) -> bool:
    """|value| <= MAX_MAGNITUDE, compared exactly: a huge int is never converted to a float (OverflowError)."""
    if isinstance(value, int):
        return abs(value) <= MAX_MAGNITUDE
    return math.isfinite(value) and abs(value) <= MAX_MAGNITUDE


def format_number(value: float) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(round(value, 10)) if isinstance(value, float) else str(value)
