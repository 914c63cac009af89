"""Tool kinds and tool instances: a registered kind (factory + typed options) becomes a graph's named,
time-limited `str -> str` async function."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from masgraph.errors import MasgraphError, ToolError
from masgraph.node import ToolFn
from masgraph.spec import ToolSpec

__all__ = ["ToolError", "ToolKind", "ToolOptions", "build_tools", "with_timeout"]


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
    describe: Callable[[Any], str] | None = None
    """The description of one instance, from its validated options (a kind whose tools come from elsewhere, e.g. an
    MCP server's); None: `description` for every instance."""


def build_tools(kinds: Mapping[str, ToolKind], specs: Mapping[str, ToolSpec]) -> dict[str, ToolFn]:
    """Instantiate a graph's tools (kinds checked at compile), each bound to its time limit."""
    out = {}
    for name, spec in specs.items():
        kind = kinds.get(spec.kind)
        if kind is None:
            raise MasgraphError(f"tools.{name}: tool kind {spec.kind!r} is not in this registry; compile the graph "
                                "with the registry it is run with")
        try:
            options = kind.options.model_validate(spec.options)
        except ValidationError as exc:  # checked at compile; a file an option names may have gone since
            raise MasgraphError(f"tools.{name}.options: " + "; ".join(
                f"{'.'.join(map(str, e['loc']))}: {e['msg'].removeprefix('Value error, ')}"
                for e in exc.errors(include_url=False))) from None
        out[name] = with_timeout(kind.factory(options), spec.timeout_s, name)
    return out


def tool_descriptions(kinds: Mapping[str, ToolKind], specs: Mapping[str, ToolSpec]) -> dict[str, str]:
    """Tool name -> the description shown to the model (the spec's override, else the instance's or the kind's)."""
    def text(spec: ToolSpec, kind: ToolKind) -> str:
        if spec.description or kind.describe is None:
            return spec.description or kind.description
        return kind.describe(kind.options.model_validate(spec.options))
    return {n: text(s, kinds[s.kind]) for n, s in specs.items() if s.kind in kinds}


def with_timeout(fn: ToolFn, timeout_s: float, name: str) -> ToolFn:
    """Bound `fn` to `timeout_s` (a ToolError past it); a cancelled caller's cancellation propagates unchanged."""
    async def call(raw: str) -> str:
        try:
            async with asyncio.timeout(timeout_s):
                return await fn(raw)
        except TimeoutError:
            raise ToolError(f"{name} timed out after {timeout_s}s; raise tools.{name}.timeout_s if it needs "
                            "longer") from None
    return call
