"""Prompt templates: text files beside the roles (agents/prompts/*.txt) with `$name` placeholders.

The text before the first marker line is the system message; marker lines `--- user` and
`--- assistant` start the following chat turns. Few-shot examples are written as real prior turns
(small instruct models follow those far better than examples pasted into one message).

An example that uses tools says so on its user marker: `--- user tools=search` (comma-separated). It is
shown, with the turns up to the next user turn, only to nodes that have every tool it names: models copy the
examples' tool names, so a node must never see a tool it lacks. `--- user tools=python fallback` is shown only
when the node has that tool and no other tool example was kept (a node left with no example otherwise)."""

from __future__ import annotations

import re
from functools import lru_cache
from importlib.resources import files
from string import Template
from typing import NamedTuple

from masgraph.errors import MasgraphError
from masgraph.node import NodeContext

_MARK = re.compile(r"^--- (user|assistant|system)(?:[ \t]+tools=([\w,-]+)(?:[ \t]+(fallback))?)?[ \t]*$", re.M)


class Turn(NamedTuple):
    role: str
    template: Template
    tools: frozenset[str] = frozenset()
    """The tools this example uses (set on the user turn that starts it): shown only to nodes having them all."""
    fallback: bool = False
    """Shown only when no other tool example is."""


@lru_cache(maxsize=64)
def load_turns(name: str) -> tuple[Turn, ...]:
    """The template's turns with their example tags."""
    path = files("masgraph.agents") / "prompts" / f"{name}.txt"
    if not path.is_file():
        raise MasgraphError(f"prompt template {name!r} not found under masgraph/agents/prompts/")
    parts = _MARK.split(path.read_text())
    turns = [Turn("system", Template(parts[0].strip()))]
    for role, tools, fallback, text in zip(parts[1::4], parts[2::4], parts[3::4], parts[4::4]):
        turns.append(Turn(role, Template(text.strip()), frozenset((tools or "").split(",")) - {""}, bool(fallback)))
    return tuple(t for t in turns if t.template.template)


def load_template(name: str) -> tuple[tuple[str, Template], ...]:
    """(role, template) for every turn, examples of all tools included."""
    return tuple((t.role, t.template) for t in load_turns(name))


def node_tools(ctx: NodeContext) -> list[str]:
    """The tools a node may use: its `tools:`, else every tool of the graph."""
    return list(getattr(ctx.node_spec, "tools", None) or ctx.spec.tools)


def select_turns(turns: tuple[Turn, ...], tools: set[str]) -> list[Turn]:
    """The turns a node with `tools` is shown: examples using a tool it lacks are dropped whole (user turn and
    the replies up to the next user turn); a fallback example only when no other tool example is left."""
    groups: list[list[Turn]] = []
    for turn in turns:
        if turn.role == "user" or not groups:
            groups.append([turn])
        else:
            groups[-1].append(turn)
    has = [not g[0].tools or g[0].tools <= tools for g in groups]
    others = any(ok and g[0].tools and not g[0].fallback for ok, g in zip(has, groups))
    return [t for ok, g in zip(has, groups) if ok and not (g[0].fallback and others) for t in g]


def render(ctx: NodeContext, default: str, **values: str) -> list[dict[str, str]]:
    """Chat messages from the node's template (the episode's slot choice, else its `prompt:`, else the role
    default) and values; only the examples whose tools the node has (see `select_turns`)."""
    turns = load_turns(ctx.prompt or ctx.node_spec.prompt or default)
    turns = [(t.role, t.template) for t in select_turns(turns, set(node_tools(ctx)))]
    names = {name for _, t in turns for name in t.get_identifiers()}
    base = {"query": ctx.query, "inputs": ctx.merged}
    if "memory" in names and "memory" not in values:  # rendered only when shown: a render marks entries as read
        base["memory"] = ctx.memory.render()
    values = {**base, **values}
    return [{"role": role, "content": t.safe_substitute(values)} for role, t in turns]


def judge_messages(question: str, references: list[str], response: str) -> list[dict[str, str]]:
    """The judge's chat (agents/prompts/judge.txt; `masgraph.tasks.judge`): the question, the reference answers
    joined by " | ", and the response to grade."""
    values = {"question": question.strip(), "reference": " | ".join(r.strip() for r in references),
              "response": response.strip()}
    return [{"role": t.role, "content": t.template.safe_substitute(values)} for t in load_turns("judge")]


def prompt_names() -> set[str]:
    """The template names a node's `prompt:` may use (registered with the agents)."""
    folder = files("masgraph.agents") / "prompts"
    return {p.name.removesuffix(".txt") for p in folder.iterdir() if p.name.endswith(".txt")}
