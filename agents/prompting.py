"""Prompt templates: text files beside the roles (agents/prompts/*.txt) with `$name` placeholders.

The text before the first marker line is the system message; marker lines `--- user` and
`--- assistant` start the following chat turns. Few-shot examples are written as real prior turns
(small instruct models follow those far better than examples pasted into one message)."""

from __future__ import annotations

import re
from functools import lru_cache
from importlib.resources import files
from string import Template

from masgraph.errors import MasgraphError
from masgraph.node import NodeContext

_MARK = re.compile(r"^--- (user|assistant|system)\s*$", re.M)


@lru_cache(maxsize=64)
def load_template(name: str) -> tuple[tuple[str, Template], ...]:
    path = files("masgraph.agents") / "prompts" / f"{name}.txt"
    if not path.is_file():
        raise MasgraphError(f"prompt template {name!r} not found under masgraph/agents/prompts/")
    parts = _MARK.split(path.read_text())
    turns = [("system", parts[0])] + list(zip(parts[1::2], parts[2::2]))
    return tuple((role, Template(text.strip())) for role, text in turns if text.strip())


def render(ctx: NodeContext, default: str, **values: str) -> list[dict[str, str]]:
    """Chat messages from the node's template (the episode's slot choice, else its `prompt:`, else the role
    default) and values."""
    turns = load_template(ctx.prompt or ctx.node_spec.prompt or default)
    names = {name for _, t in turns for name in t.get_identifiers()}
    base = {"query": ctx.query, "inputs": ctx.merged}
    if "memory" in names and "memory" not in values:  # rendered only when shown: a render marks entries as read
        base["memory"] = ctx.memory.render()
    values = {**base, **values}
    return [{"role": role, "content": t.safe_substitute(values)} for role, t in turns]


def prompt_names() -> set[str]:
    """The template names a node's `prompt:` may use (registered with the agents)."""
    folder = files("masgraph.agents") / "prompts"
    return {p.name.removesuffix(".txt") for p in folder.iterdir() if p.name.endswith(".txt")}
