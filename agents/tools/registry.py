"""Tool registry: built-in kinds and user tools registered as typed Python functions (signature -> JSON schema)."""

from __future__ import annotations

import asyncio
import inspect
import json
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict

from masgraph.errors import MasgraphError
from masgraph.node import ToolFn
from masgraph.spec import ToolSpec

_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}


class ToolOptions(BaseModel):
    """Base of every tool kind's typed `options:` (unknown keys are errors); a kind with none uses it as is."""

    model_config = ConfigDict(extra="forbid", strict=True, use_attribute_docstrings=True)


@dataclass(frozen=True)
class ToolKind:
    """A registered tool: a factory from its validated options to an async `str -> str` function."""

    name: str
    description: str
    factory: Callable[[Any], ToolFn]
    schema: dict[str, Any]
    options: type[ToolOptions] = ToolOptions
    """The pydantic model that `tools.<name>.options` is validated against (at compile time)."""


TOOL_KINDS: dict[str, ToolKind] = {}


class ToolError(MasgraphError):
    """The tool rejected its input or failed; the message is shown to the model."""


def register_kind(name: str, description: str, schema: dict[str, Any] | None = None,
                  options: type[ToolOptions] = ToolOptions):
    """Register a built-in tool kind whose factory takes its validated `options` model instance."""
    def deco(factory: Callable[[Any], ToolFn]) -> Callable[[Any], ToolFn]:
        TOOL_KINDS[name] = ToolKind(name, description, factory,
                                    schema or {"type": "object", "properties": {"input": {"type": "string"}}},
                                    options)
        return factory
    return deco


def register_tool(fn: Callable[..., Any] | None = None, *, name: str | None = None):
    """Register a typed Python function as a tool kind (sync or async).

    The model's input is parsed as a JSON object of keyword arguments when it looks like one, otherwise
    it is passed (converted to the annotated type) as the first parameter.

    Example:
        >>> @register_tool
        ... def word_count(text: str) -> int:
        ...     "Count the words in a text."
        ...     return len(text.split())
        >>> TOOL_KINDS["word_count"].schema["properties"]["text"]
        {'type': 'string'}
    """
    def deco(f: Callable[..., Any]) -> Callable[..., Any]:
        sig = inspect.signature(f)
        hints = typing.get_type_hints(f)
        params = list(sig.parameters.values())
        schema = {"type": "object",
                  "properties": {p.name: {"type": _JSON_TYPES.get(hints.get(p.name, str), "string")} for p in params},
                  "required": [p.name for p in params if p.default is inspect.Parameter.empty]}

        def factory(options: ToolOptions) -> ToolFn:
            async def call(raw: str) -> str:
                kwargs = _parse_args(raw, params, hints)
                result = await f(**kwargs) if inspect.iscoroutinefunction(f) else await asyncio.to_thread(f, **kwargs)
                return result if isinstance(result, str) else json.dumps(result)
            return call

        tool_name = name or f.__name__
        TOOL_KINDS[tool_name] = ToolKind(tool_name, (inspect.getdoc(f) or tool_name).split("\n")[0], factory, schema)
        return f
    return deco(fn) if fn is not None else deco


def _parse_args(raw: str, params: list[inspect.Parameter], hints: dict[str, Any]) -> dict[str, Any]:
    text = raw.strip()
    if text.startswith("{"):
        try:
            obj = json.loads(text)
            if isinstance(obj, dict):
                return obj
        except json.JSONDecodeError:
            pass
    if not params:
        return {}
    first = params[0]
    typ = hints.get(first.name, str)
    try:
        return {first.name: typ(text) if typ in (int, float, str) else text}
    except ValueError:
        raise ToolError(f"expected {typ.__name__} for {first.name!r}, got {text!r}") from None


def load_builtin_tools() -> None:
    from masgraph.agents.tools import calculator, python, search  # noqa: F401  (they register)


def build_tools(specs: dict[str, ToolSpec]) -> dict[str, ToolFn]:
    """Instantiate the graph's tools (kinds checked at compile), each bound to its time limit."""
    load_builtin_tools()
    out = {}
    for name, spec in specs.items():
        kind = TOOL_KINDS[spec.kind]
        out[name] = _with_timeout(kind.factory(kind.options.model_validate(spec.options)), spec.timeout_s, name)
    return out


def describe(specs: dict[str, ToolSpec], names: list[str]) -> str:
    """One line per tool for prompts: `name: description`."""

    return "\n".join(f"- {n}: {specs[n].description or TOOL_KINDS[specs[n].kind].description}"
                     for n in names if specs[n].kind in TOOL_KINDS)


def _with_timeout(fn: ToolFn, timeout_s: float, name: str) -> ToolFn:
    """Bound `fn` to `timeout_s` (a ToolError past it); a cancelled caller's cancellation propagates unchanged."""
    async def call(raw: str) -> str:
        try:
            async with asyncio.timeout(timeout_s):
                return await fn(raw)
        except TimeoutError:
            raise ToolError(f"{name} timed out after {timeout_s}s; raise tools.{name}.timeout_s if it needs "
                            "longer") from None
    return call
