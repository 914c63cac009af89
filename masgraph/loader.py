"""Load a GraphSpec from YAML with errors that give file, line:column, key path and the fix."""

from __future__ import annotations

import difflib
import re
from pathlib import Path

import yaml
from pydantic import BaseModel, ValidationError

from masgraph.errors import Problem, SpecError
from masgraph.spec import GraphSpec


def load_spec(path: str | Path) -> GraphSpec:
    """Read and validate a graph YAML file; raise SpecError naming file, location and fix."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise SpecError([Problem("", f"cannot read file: {exc.strerror}", "check the path")], str(path)) from None
    return parse_spec(text, str(path))


def parse_spec(text: str, file: str | None = None) -> GraphSpec:
    """Validate YAML text as a GraphSpec."""
    try:
        root = yaml.compose(text)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line, col = (mark.line + 1, mark.column + 1) if mark else (None, None)
        msg = getattr(exc, "problem", None) or str(exc)
        raise SpecError([Problem("", f"YAML syntax: {msg}", "fix the YAML syntax at that position", line, col)], file) from None
    if not isinstance(data, dict):
        raise SpecError([Problem("", "the file must hold a mapping (name:, nodes:, edges:, ...)", "see graphs/*.yaml")], file)
    try:
        return GraphSpec.model_validate(data)
    except ValidationError as exc:
        raise SpecError(problems_from(exc, root), file) from None


def problems_from(exc: ValidationError, root: yaml.Node | None = None) -> list[Problem]:
    """Turn pydantic errors into located problems with a suggested fix."""
    problems = []
    for err in exc.errors(include_url=False):
        loc = _strip_tag(list(err["loc"])) or _path_in_message(err)
        path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")
        line = col = None
        node = _find(root, loc) if root is not None else None
        if node is not None:
            line, col = node.start_mark.line + 1, node.start_mark.column + 1
        msg, fix = _explain(err, loc)
        problems.append(Problem(path, msg, fix, line, col))
    return problems


_ROLES = {"planner", "executor", "verifier", "generator", "memory", "custom"}
_PATH = re.compile(r"^([A-Za-z_]\w*(?:\[\d+\])?(?:\.[\w-]+(?:\[\d+\])?)*)[ :]")


def _path_in_message(err: dict) -> list:
    """Cross-field checks (model_validator) start their message with the key path they are about."""
    m = _PATH.match(err["msg"].removeprefix("Value error, ")) if err["type"] == "value_error" else None
    if m is None or "." not in m.group(1) and "[" not in m.group(1) and m.group(1) not in ("entry", "exit"):
        return []
    loc: list = []
    for part in m.group(1).split("."):
        name, _, idx = part.partition("[")
        loc += [name] + ([int(idx[:-1])] if idx else [])
    return loc


def _strip_tag(loc: list) -> list:
    """Drop the discriminator value pydantic inserts into union locations: nodes.<name>.<role>.<field>."""
    if len(loc) > 2 and loc[0] == "nodes" and loc[2] in _ROLES:
        return loc[:2] + loc[3:]
    return loc


def _find(node: yaml.Node | None, loc: list) -> yaml.Node | None:
    """Walk the composed YAML tree along a key path; return the deepest node found."""
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            nxt = next(((k, v) for k, v in node.value if k.value == str(part)), None)
            if nxt is None:
                return node
            node = nxt[1] if part != loc[-1] else nxt[0]
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            node = node.value[part]
        else:
            return node
    return node


def _fields_at(loc: list) -> list[str]:
    """Allowed keys at a key path of a GraphSpec document (for 'did you mean')."""
    from masgraph import spec as s

    node_models = (s.PlannerSpec, s.ExecutorSpec, s.VerifierSpec, s.GeneratorSpec, s.MemoryNodeSpec, s.CustomSpec)
    table: dict[tuple, tuple[type[BaseModel], ...]] = {
        (): (s.GraphSpec,), ("nodes", "*"): node_models, ("policies", "*"): (s.PolicySpec,),
        ("policies", "*", "sampling"): (s.SamplingSpec,), ("tools", "*"): (s.ToolSpec,),
        ("edges", "*"): (s.EdgeSpec,), ("memory",): (s.MemoryConfig,), ("limits",): (s.Limits,),
        ("train",): (s.TrainSpec,), ("train", "flow_grpo"): (s.FlowGRPOConfig,),
    }
    keyed = loc[:1] in (["nodes"], ["policies"], ["tools"], ["edges"])  # sections whose 2nd part is a name/index
    key = tuple("*" if i == 1 and keyed else p for i, p in enumerate(loc))
    return sorted({f for m in table.get(key, ()) for f in m.model_fields})


def _explain(err: dict, loc: list) -> tuple[str, str]:
    kind, msg = err["type"], err["msg"]
    if kind == "extra_forbidden":
        key = str(loc[-1])
        allowed = _fields_at(loc[:-1])
        close = difflib.get_close_matches(key, allowed, n=1)
        fix = f"did you mean {close[0]!r}?" if close else f"remove it; allowed keys: {', '.join(allowed)}"
        return f"unknown key {key!r}", fix
    if kind == "missing":
        return "required key is missing", f"add `{loc[-1]}:`"
    if kind == "union_tag_invalid" or kind == "union_tag_not_found":
        return msg, "set `role:` to one of planner, executor, verifier, generator, memory, custom"
    if kind == "literal_error":
        return msg, "use one of the listed values"
    if kind == "value_error":
        text = msg.removeprefix("Value error, ")
        return text, ""
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
