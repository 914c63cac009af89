"""Calculator tool: evaluates one arithmetic expression with `masgraph.tasks.arith`'s safe parser (never `eval`)."""

from __future__ import annotations

from masgraph.agents.tools.registry import ToolError, ToolOptions, register_kind
from masgraph.tasks.arith import ArithError, format_number
from masgraph.tasks.arith import calculate as _calculate

__all__ = ["calculate", "format_number"]


def calculate(expression: str) -> int | float:
    """`masgraph.tasks.arith.calculate`, its errors as the tool error the step records."""
    try:
        return _calculate(expression)
    except ArithError as exc:
        raise ToolError(str(exc)) from None


@register_kind("calculator", "evaluates an arithmetic expression, e.g. Input: (12 + 7) * 3")
def make_calculator(options: ToolOptions):
    async def calculator(expression: str) -> str:
        return format_number(calculate(expression))
    return calculator
