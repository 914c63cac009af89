"""Calculator tool: a safe arithmetic parser over Python's AST (numbers, + - * / // % **, parentheses)."""

from __future__ import annotations

import ast
import operator
import re
from typing import Any

from masgraph.agents.tools.registry import ToolError, ToolOptions, register_kind

_BIN = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_SPAN = re.compile(r"[-+*/%().\d\s]+")
MAX_EXPONENT = 100
MAX_MAGNITUDE = 10**30


def calculate(expression: str) -> int | float:
    """Evaluate an arithmetic expression without `eval`; raises ToolError on anything else."""
    text = expression.strip().rstrip("=").replace("×", "*").replace("÷", "/").replace("^", "**")
    text = re.sub(r"(?<=\d),(?=\d{3}\b)", "", text)  # 1,000 -> 1000
    if not text:
        raise ToolError("empty expression")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        # lenient: "compute 12 + 7 please" -> the longest arithmetic span in the text
        spans = [m.group().strip() for m in _SPAN.finditer(text) if re.search(r"\d", m.group())]
        try:
            tree = ast.parse(max(spans, key=len), mode="eval") if spans else None
        except SyntaxError:
            tree = None
        if tree is None:
            raise ToolError(f"not an arithmetic expression: {expression!r}") from None
    return _eval(tree.body)


def _eval(node: ast.AST) -> Any:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BIN:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ToolError(f"exponent {right} is too large (max {MAX_EXPONENT})")
        try:
            value = _BIN[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ToolError("division by zero") from None
        if isinstance(value, complex) or abs(value) > MAX_MAGNITUDE:
            raise ToolError("result out of range")
        return value
    raise ToolError(f"unsupported element {type(node).__name__} (only numbers and + - * / // % ** ( ))")


def format_number(value: int | float) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(round(value, 10)) if isinstance(value, float) else str(value)


@register_kind("calculator", "evaluates an arithmetic expression, e.g. Input: (12 + 7) * 3")
def make_calculator(options: ToolOptions):
    async def calculator(expression: str) -> str:
        return format_number(calculate(expression))
    return calculator
