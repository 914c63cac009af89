"""Locating problems in a graph file: pydantic errors and key paths turned into file, line:column, key path and the
fix (the nearest allowed key for a typo)."""

from __future__ import annotations

import difflib
import re

import yaml
from pydantic import BaseModel, ValidationError

from masgraph.errors import Problem, shorten
from masgraph.spec import ROLES
from masgraph.yaml_read import _mark, _render


def locate_in(problems: list[Problem], root: yaml.Node | None) -> list[Problem]:
    """Give problems without a line the line:column of their key path in a composed YAML document."""
    if root is None:
        return problems
    out, cache = [], {}
    for p in problems:
        node = _find(root, _split_path(p.path, root, cache), cache) if p.line is None else None
        out.append(p if node is None else Problem(p.path, p.message, p.fix, *_mark(node.start_mark)))
    return out


def problems_from(exc: ValidationError, root: yaml.Node | None = None, prefix: tuple = (),
                  model: type[BaseModel] | None = None) -> list[Problem]:
    """Turn pydantic errors into located problems with a suggested fix.

    `prefix` is where the validated value sits in the document, and `model` (when it is not a section of
    GraphSpec, e.g. a tool kind's options) names the keys allowed at that prefix.
    """
    problems, cache = [], {}
    for err in exc.errors(include_url=False):
        loc = [*prefix, *(_strip_tag(list(err["loc"])) or _path_in_message(err))]
        line = col = None
        node = _find(root, loc, cache) if root is not None else None
        if node is not None:
            line, col = _mark(node.start_mark)
        allowed = _model_fields_at(model, loc[len(prefix):-1]) if model is not None else None
        msg, fix = _explain(err, loc, allowed)
        problems.append(Problem(_render(loc), msg, fix, line, col))
    return problems


_PATH = re.compile(r"^([A-Za-z_]\w*(?:\[\d+\])?(?:\.[\w-]+(?:\[\d+\])?)*)[ :]")


def _path_in_message(err: dict) -> list:
    """Cross-field checks (model_validator) start their message with the key path they are about."""
    m = _PATH.match(err["msg"].removeprefix("Value error, ")) if err["type"] == "value_error" else None
    if m is None or "." not in m.group(1) and "[" not in m.group(1) and m.group(1) not in ("entry", "exit",
                                                                                          "topology"):
        return []
    loc: list = []
    for part in m.group(1).split("."):
        name, _, idx = part.partition("[")
        loc += [name] + ([int(idx[:-1])] if idx else [])
    return loc


def _strip_tag(loc: list) -> list:
    """Drop the discriminator value pydantic inserts into union locations: nodes.<name>.<role>.<field>."""
    if len(loc) > 2 and loc[0] == "nodes" and loc[2] in ROLES:
        return loc[:2] + loc[3:]
    return loc


_Keys = dict[int, dict[str, tuple[yaml.Node, yaml.Node]]]  # id(mapping node) -> key text -> (key, value) nodes


def _keys(node: yaml.Node | None, cache: _Keys) -> dict[str, tuple[yaml.Node, yaml.Node]]:
    """A mapping node's entries by key text, built once per node (so locating N problems stays linear)."""
    if not isinstance(node, yaml.MappingNode):
        return {}
    if id(node) not in cache:
        table = cache[id(node)] = {}
        for k, v in node.value:
            if isinstance(k, yaml.ScalarNode):
                table.setdefault(k.value, (k, v))
    return cache[id(node)]


def _split_path(path: str, root: yaml.Node, cache: _Keys) -> list:
    """A rendered key path back to its parts, matching mapping keys that contain dots (`nodes.a.b.merge`)."""
    loc: list = []
    node: yaml.Node | None = root
    rest = path
    while rest:
        if rest[0] == "[":
            text, _, rest = rest[1:].partition("]")
            part: object = int(text) if text.isdigit() else text
            ok = isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value)
            node = node.value[part] if ok else None
        else:
            table = _keys(node, cache)
            cuts = [i for i, ch in enumerate(rest) if ch in ".["]
            first = rest[:min(cuts, default=len(rest))]
            part = next((rest[:i] for i in [len(rest), *reversed(cuts)] if rest[:i] in table), first)
            rest = rest[len(part):]
            node = table[part][1] if part in table else None
        loc.append(part)
        rest = rest.removeprefix(".")
    return loc


def _find(node: yaml.Node | None, loc: list, cache: _Keys) -> yaml.Node | None:
    """Walk the composed YAML tree along a key path; return the deepest node found (a mapping key for the last)."""
    for i, part in enumerate(loc):
        if isinstance(node, yaml.SequenceNode):
            if not (isinstance(part, int) and 0 <= part < len(node.value)):
                return node
            node = node.value[part]
        else:
            pair = _keys(node, cache).get(str(part))
            if pair is None:
                return node
            node = pair[0] if i == len(loc) - 1 else pair[1]
    return node


def _fields_at(loc: list) -> list[str]:
    """Allowed keys at a key path of a GraphSpec document (for 'did you mean')."""
    from masgraph import spec as s

    node_models = tuple(s.ROLES.values())
    table: dict[tuple, tuple[type[BaseModel], ...]] = {
        (): (s.GraphSpec,), ("nodes", "*"): node_models, ("policies", "*"): (s.PolicySpec,),
        ("policies", "*", "sampling"): (s.SamplingSpec,), ("tools", "*"): (s.ToolSpec,),
        ("edges", "*"): (s.EdgeSpec,), ("memory",): (s.MemoryConfig,), ("limits",): (s.Limits,),
        ("topology",): (s.TopologySpec,), ("topology", "edges", "*"): (s.EdgeRef,),
    }
    keyed = loc[:1] in (["nodes"], ["policies"], ["tools"], ["edges"])  # sections whose 2nd part is a name/index
    key = tuple("*" if i == 1 and keyed else p for i, p in enumerate(loc))
    if loc[:2] == ["topology", "edges"]:
        key = tuple("*" if i == 2 else p for i, p in enumerate(loc))
    return sorted({f for m in table.get(key, ()) for f in m.model_fields})


def _model_fields_at(model: type[BaseModel], loc: list) -> list[str] | None:
    """Keys allowed at a path inside `model` (through nested model fields); None when the path leaves models."""
    for part in loc:
        field = model.model_fields.get(str(part))
        inner = getattr(field, "annotation", None)
        if not (isinstance(inner, type) and issubclass(inner, BaseModel)):
            return None
        model = inner
    return sorted(model.model_fields)


def _explain(err: dict, loc: list, allowed: list[str] | None = None) -> tuple[str, str]:
    kind, msg = err["type"], err["msg"]
    if kind == "extra_forbidden":
        key = str(loc[-1])
        allowed = _fields_at(loc[:-1]) if allowed is None else allowed
        close = difflib.get_close_matches(key, allowed, n=1) if len(key) <= 100 else []
        fix = f"did you mean {close[0]!r}?" if close else f"remove it; allowed keys: {', '.join(allowed) or 'none'}"
        return f"unknown key {shorten(key)!r}", fix
    if kind == "missing":
        return "required key is missing", f"add `{loc[-1]}:`"
    if kind == "union_tag_invalid" or kind == "union_tag_not_found":
        return msg, f"set `role:` to one of {', '.join(ROLES)}"
    if kind == "literal_error":
        return msg, "use one of the listed values"
    if kind == "value_error":  # a cross-field check's "PATH: what is wrong; what to do"
        text = msg.removeprefix("Value error, ")
        path = _render(loc)
        for head in (path + ": ", path + " "):  # the location is shown already
            if path and text.startswith(head):
                text = text[len(head):]
                break
        what, _, fix = text.partition("; ")
        return (what, fix) if fix else (text, "")
    bounds = {"greater_than_equal": ("ge", "≥"), "greater_than": ("gt", ">"), "less_than_equal": ("le", "≤"),
              "less_than": ("lt", "<")}
    if kind in bounds:
        key, sign = bounds[kind]
        return msg, f"use a value {sign} {err.get('ctx', {}).get(key)}"
    expected = {"float": "a number, e.g. 0.001", "int": "a whole number, e.g. 8", "bool": "true or false",
                "string": "a string (quote it if YAML reads it as something else)", "dict": "a mapping (key: value)",
                "list": "a list ([a, b] or one `- item` per line)"}
    for prefix, what in expected.items():
        if kind.startswith(prefix + "_"):
            return msg, f"write {what}"
    return msg, f"expected {kind.replace('_', ' ')}"
