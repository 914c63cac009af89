"""Registering tools: the built-in kinds, and user tools as typed Python functions (signature -> JSON schema)."""

from __future__ import annotations

import asyncio
import inspect
import json
import typing
from collections.abc import Callable
from typing import Any

from masgraph.errors import ToolError
from masgraph.node import ToolFn
from masgraph.registry import Registry, default_registry, record
from masgraph.spec import ToolSpec
from masgraph.tools import ToolKind, ToolOptions
from masgraph.tools import build_tools as _build

__all__ = ["BUILTIN_TOOLS", "ToolError", "ToolKind", "ToolOptions", "build_tools", "describe", "register_kind",
           "register_tool"]

_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}


BUILTIN_TOOLS: dict[str, ToolKind] = {}
"""The built-in kinds (calculator, python, search, web_search), registered by `masgraph.agents.register`."""


def register_kind(name: str, description: str, schema: dict[str, Any] | None = None,
                  options: type[ToolOptions] = ToolOptions):
    """Register a built-in tool kind whose factory takes its validated `options` model instance."""
    def deco(factory: Callable[[Any], ToolFn]) -> Callable[[Any], ToolFn]:
        BUILTIN_TOOLS[name] = ToolKind(name, description, factory,
                                       schema or {"type": "object", "properties": {"input": {"type": "string"}}},
                                       options)
        return factory
    return deco


def register_tool(fn: Callable[..., Any] | str | None = None, *, name: str | None = None,
                  registry: Registry | None = None):
    """Register a typed Python function as a tool kind (sync or async), in `registry` (default: the process's).

    Three forms: `@register_tool` (named after the function), `@register_tool("adder")` (the form
    `register_agent` takes) and `@register_tool(name="adder")`; the graph's `tools:` names it as `kind: adder`.

    The model's input is parsed as a JSON object of keyword arguments when it looks like one, otherwise
    it is passed (converted to the annotated type) as the first parameter.

    Example:
        >>> @register_tool
        ... def word_count(text: str) -> int:
        ...     "Count the words in a text."
        ...     return len(text.split())
        >>> default_registry().tools["word_count"].schema["properties"]["text"]
        {'type': 'string'}
    """
    if isinstance(fn, str):  # @register_tool("adder"): the name, positionally
        if name is not None and name != fn:
            raise TypeError(f"register_tool({fn!r}, name={name!r}): two names; give one")
        fn, name = None, fn
    if fn is not None and not callable(fn):
        raise TypeError(f"register_tool takes a function or a tool name (str), not {type(fn).__name__} {fn!r}; "
                        "use @register_tool, @register_tool(\"name\") or @register_tool(name=\"name\")")
    if name is not None and not (isinstance(name, str) and name):
        raise TypeError(f"register_tool: a tool name is a non-empty str, not {name!r}")

    def deco(f: Callable[..., Any]) -> Callable[..., Any]:
        if not callable(f):
            raise TypeError(f"@register_tool({name!r}) decorates a function, not {type(f).__name__} {f!r}")
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
        kind = ToolKind(tool_name, (inspect.getdoc(f) or tool_name).split("\n")[0], factory, schema)
        if registry is not None:
            registry.tools[tool_name] = kind
        else:  # the registry loading this module as a plugin (else the process's); replayed for others
            record(f.__module__, "tools", tool_name, kind)
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


def build_tools(specs: dict[str, ToolSpec], registry: Registry | None = None) -> dict[str, ToolFn]:
    """A graph's tools from the registry's kinds (default: the process's), each bound to its time limit."""
    return _build((registry or default_registry()).tools, specs)


def describe(descriptions: dict[str, str], names: list[str]) -> str:
    """One line per tool for prompts: `name: description` (descriptions as in NodeContext.tool_descriptions)."""
    return "\n".join(f"- {n}: {descriptions[n]}" for n in names if n in descriptions)
