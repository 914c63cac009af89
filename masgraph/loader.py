"""Load a GraphSpec from YAML with errors that give file, line:column, key path and the fix."""

from __future__ import annotations

import difflib
import re
import warnings
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from pydantic import BaseModel, ValidationError

from masgraph.errors import Problem, SpecError, one_of, shorten
from masgraph.spec import ROLES, GraphSpec, MovedKeysWarning

if TYPE_CHECKING:
    from masgraph.registry import Registry

MAX_DEPTH = 64
"""Deepest nesting of mappings and lists in a spec (a graph needs about 5; far deeper YAML exhausts the stack)."""
ALIAS_BUDGET = 10_000
"""Most YAML nodes that aliases may add once expanded (refuses 'billion laughs' alias bombs)."""

_SOURCES: dict[int, yaml.Node] = {}  # id(spec) -> its composed YAML, kept beside the spec (not in it) for locating


MAX_SPEC_BYTES = 16 << 20
"""The largest graph file read (a graph is a few KB of YAML): more is refused, not read (`/dev/zero`, a wrong
path to a data file)."""


def load_spec(path: str | Path, registry: Registry | None = None) -> GraphSpec:
    """Read and validate a graph YAML file (its `train:` section against the registry's algorithms); raise
    SpecError naming file, location and fix."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_SPEC_BYTES + 1)  # bounded: the path may be a device or a huge file
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc)
        raise SpecError([Problem("", f"cannot read file: {reason}", "check the path")], str(path)) from None
    if len(data) > MAX_SPEC_BYTES:
        raise SpecError([Problem("", f"the file is larger than {MAX_SPEC_BYTES >> 20} MiB, the most a graph file "
                                 "may be", "check the path: a graph file is a YAML file of a few KB")], str(path))
    spec = parse_spec(data, str(path), registry)
    if any(p.endswith(".py") for p in spec.plugins):  # plugin files resolve beside the graph, from anywhere
        here = path.resolve().parent
        spec = keep_source(spec.model_copy(update={"plugins": [str(here / p) if p.endswith(".py") else p
                                                               for p in spec.plugins]}), spec)
    return spec


def parse_spec(text: str | bytes, file: str | None = None, registry: Registry | None = None) -> GraphSpec:
    """Validate YAML text (or UTF-8 bytes) as a GraphSpec."""
    if isinstance(text, bytes):
        text = _decode(text, file)
    root, data = _load_yaml(text, file)
    if not isinstance(data, dict):
        line, col = _mark(root.start_mark) if root is not None else (1, 1)
        raise SpecError([Problem("", "the file must hold a mapping (name:, nodes:, edges:, ...)",
                                 "see graphs/*.yaml", line, col)], file)
    from masgraph.registry import default_registry

    problems: list[Problem] = []
    try:
        spec = GraphSpec.model_validate(data, strict=True)
    except ValidationError as exc:
        problems, spec = problems_from(exc, root), None
    registry = registry or default_registry()
    raw_train = data.get("train")
    if data.get("plugins") and _unknown_algorithm(raw_train, registry):
        train, train_problems = raw_train, []  # a plugin may register it: compile_spec validates after loading them
    else:
        train, train_problems = validate_train(raw_train, registry, root, file)
    problems += train_problems
    if problems or spec is None:
        raise SpecError(problems, file)
    if train is not spec.train:
        spec = spec.model_copy(update={"train": train})
    _remember(spec, root)
    return spec


def _unknown_algorithm(raw: Any, registry: Registry) -> bool:
    """A `train:` mapping whose `algorithm:` the registry does not know (yet)."""
    return isinstance(raw, dict) and isinstance(raw.get("algorithm"), str) and raw["algorithm"] not in \
        registry.algorithms


def validate_train(raw: Any, registry: Registry, root: yaml.Node | None = None,
                   file: str | None = None) -> tuple[Any, list[Problem]]:
    """A `train:` section as its algorithm's model (`algorithm:` picks it; the registry's default if absent). Keys
    that moved since the file was written load in their new place, with one `MovedKeysWarning` per section that
    gives each old key's file:line and what to write instead."""
    if raw is None or isinstance(raw, BaseModel):
        return raw, []
    if not isinstance(raw, dict):
        return None, locate_in([Problem("train", f"expected a mapping, got {type(raw).__name__}",
                                        "write `train:` as a mapping, e.g. `train: {task: basic_arithmetic}`")], root)
    name = raw.get("algorithm", registry.default_algorithm)
    if not isinstance(name, str) or name not in registry.algorithms:
        fix = f"use one of {one_of(registry.algorithms)}" if registry.algorithms else \
            "install masgraph with its trainers (pip install -e .): no training algorithm is registered"
        return None, locate_in([Problem("train.algorithm", f"unknown training algorithm {shorten(str(name))!r}",
                                        fix)], root)
    model = registry.algorithms[name].config
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", MovedKeysWarning)
        try:
            train = model.model_validate({**raw, "algorithm": name}, strict=True)
        except ValidationError as exc:
            train, problems = None, problems_from(exc, root, prefix=("train",), model=model)
        else:
            problems = []
    for w in caught:
        if isinstance(w.message, MovedKeysWarning):
            _warn_located(w.message, root, file)
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return train, problems


def _warn_located(moved: MovedKeysWarning, root: yaml.Node | None, file: str | None) -> None:
    """`moved` again, its keys under `train:`, each with its file:line."""
    moved = moved.under("train.")
    where = {}
    for old, _ in moved.moves:
        [p] = locate_in([Problem(old, "")], root)
        where[old] = f"{file or '<spec>'}" + (f":{p.line}" if p.line is not None else "")
    warnings.warn(moved.under("", where), stacklevel=4)


def _remember(spec: GraphSpec, root: yaml.Node | None) -> None:
    _SOURCES[id(spec)] = root
    weakref.finalize(spec, _SOURCES.pop, id(spec), None)


def keep_source(new: GraphSpec, old: GraphSpec) -> GraphSpec:
    """`new` (a copy of `old`) keeps `old`'s YAML source, so its problems are located in the same file."""
    root = _SOURCES.get(id(old))
    if root is not None:
        _remember(new, root)
    return new


def locate(problems: list[Problem], spec: GraphSpec) -> list[Problem]:
    """Give problems without a line the line:column of their key path in the YAML `spec` was loaded from."""
    return locate_in(problems, _SOURCES.get(id(spec)))


def locate_in(problems: list[Problem], root: yaml.Node | None) -> list[Problem]:
    """Give problems without a line the line:column of their key path in a composed YAML document."""
    if root is None:
        return problems
    out, cache = [], {}
    for p in problems:
        node = _find(root, _split_path(p.path, root, cache), cache) if p.line is None else None
        out.append(p if node is None else Problem(p.path, p.message, p.fix, *_mark(node.start_mark)))
    return out


class _Refused(Exception):
    """The YAML is refused while reading it (too deep, an alias bomb, a value Python cannot hold)."""

    def __init__(self, problem: Problem):
        super().__init__(problem.message)
        self.problem = problem


if yaml.__with_libyaml__:
    _Events = yaml.cyaml.CParser  # libyaml's scanner and parser: ~4x faster loads than PyYAML's own
else:
    class _Events(yaml.reader.Reader, yaml.scanner.Scanner, yaml.parser.Parser):  # type: ignore[no-redef]
        def __init__(self, text: str):
            yaml.reader.Reader.__init__(self, text)
            yaml.scanner.Scanner.__init__(self)
            yaml.parser.Parser.__init__(self)


class _Loader(yaml.composer.Composer, _Events, yaml.constructor.SafeConstructor, yaml.resolver.Resolver):
    """A safe loader that bounds nesting and alias expansion and reports duplicate keys, all located."""

    def __init__(self, text: str):
        _Events.__init__(self, text)
        yaml.composer.Composer.__init__(self)
        yaml.constructor.SafeConstructor.__init__(self)
        yaml.resolver.Resolver.__init__(self)
        self.loc: list = []  # key path of the node being composed (None while composing a key)
        self.sizes: dict[int, int] = {}  # id(node) -> its node count with aliases expanded
        self.aliased = 0
        self.duplicates: list[Problem] = []
        self.root: yaml.Node | None = None

    def compose_node(self, parent: yaml.Node | None, index: object) -> yaml.Node:
        loc = self.loc + [_key(index)]
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            self._count_alias(event, loc)
            return super().compose_node(parent, index)
        if len(loc) > MAX_DEPTH:
            raise _Refused(Problem(_render(loc), f"nesting is deeper than {MAX_DEPTH} levels",
                                   "flatten it: a graph spec needs only a few levels", *_mark(event.start_mark)))
        self.loc = loc
        node = super().compose_node(parent, index)
        self.loc = loc[:-1]
        if isinstance(node, yaml.MappingNode):
            self._check_duplicates(node, loc)
            children = [c for pair in node.value for c in pair]
        else:
            children = node.value if isinstance(node, yaml.SequenceNode) else []
        self.sizes[id(node)] = 1 + sum(self.sizes[id(c)] for c in children)
        return node

    def _count_alias(self, event: yaml.AliasEvent, loc: list) -> None:
        node = self.anchors.get(event.anchor)
        if node is None:
            return  # the composer reports the undefined alias
        size = self.sizes.get(id(node))
        where = (_render(loc), *_mark(event.start_mark))
        if size is None:
            raise _Refused(Problem(where[0], f"alias *{event.anchor} refers to a node that contains it",
                                   "write the value out: a spec cannot contain itself", *where[1:]))
        self.aliased += size
        if self.aliased > ALIAS_BUDGET:
            raise _Refused(Problem(where[0], f"aliases expand to more than {ALIAS_BUDGET} YAML nodes",
                                   "write the values out instead of nesting anchors and aliases", *where[1:]))

    def _check_duplicates(self, node: yaml.MappingNode, loc: list) -> None:
        seen: dict[tuple[str, str], yaml.Node] = {}
        for key, _ in node.value:
            if not isinstance(key, yaml.ScalarNode) or key.tag == "tag:yaml.org,2002:merge":
                continue
            first = seen.setdefault((key.tag, key.value), key)
            if first is not key:
                self.duplicates.append(Problem(
                    _render(loc + [key.value]), f"duplicate key {shorten(key.value)!r} "
                    f"(first at line {first.start_mark.line + 1})",
                    "keep one of them: YAML would silently use only the last", *_mark(key.start_mark)))

    def construct_object(self, node: yaml.Node, deep: bool = False) -> object:
        try:
            return super().construct_object(node, deep)
        except (ValueError, OverflowError) as exc:  # e.g. a 5000-digit integer, a timestamp for 2024-13-45
            loc = _path_to(self.root, node) if self.root is not None else []
            raise _Refused(Problem(_render(loc), f"cannot read value {shorten(str(node.value))!r}: {exc}",
                                   "write a plain value (quote it to make it a string)",
                                   *_mark(node.start_mark))) from None


def _load_yaml(text: str, file: str | None) -> tuple[yaml.Node | None, object]:
    """Compose and construct one YAML document; every refusal becomes a located SpecError."""
    loader = None
    try:
        loader = _Loader(text)
        root = loader.root = loader.get_single_node()
        if loader.duplicates:
            raise SpecError(loader.duplicates, file)
        return root, loader.construct_document(root) if root is not None else None
    except _Refused as exc:
        raise SpecError([exc.problem], file) from None
    except UnicodeEncodeError as exc:  # a str from Python holding a lone surrogate (no file can)
        raise SpecError([Problem("", f"the text holds a lone surrogate U+{ord(text[exc.start]):04X}",
                                 "remove it (it is not a character)", *_end_of(text[:exc.start]))], file) from None
    except yaml.reader.ReaderError as exc:
        # libyaml counts bytes, PyYAML characters
        before = text.encode()[:exc.position].decode(errors="ignore") if yaml.__with_libyaml__ else text[:exc.position]
        char = exc.character if isinstance(exc.character, int) else ord(exc.character)
        raise SpecError([Problem("", f"YAML cannot hold the character U+{char:04X}",
                                 "remove it (control characters are not allowed)", *_end_of(before))], file) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line, col = _mark(mark) if mark else (1, 1)
        msg = getattr(exc, "problem", None) or str(exc)
        path = _render(loader.loc) if loader is not None else ""
        raise SpecError([Problem(path, f"YAML syntax: {msg}", "fix the YAML syntax at that position", line, col)],
                        file) from None
    finally:
        if loader is not None:
            loader.dispose()


def read_yaml(data: bytes, file: str | None = None) -> object:
    """Any YAML document from UTF-8 bytes, read as graph files are (nesting and alias expansion bounded, duplicate
    keys refused) but not validated as a spec: for a run directory's copy of its spec. SpecError when refused."""
    return _load_yaml(_decode(data, file), file)[1]


def _decode(data: bytes, file: str | None) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SpecError([Problem("", f"the file is not UTF-8 text (byte 0x{data[exc.start]:02x})", "save it as UTF-8",
                                 *_end_of(data[:exc.start].decode()))], file) from None


def _end_of(before: str) -> tuple[int, int]:
    """line, column (1-based) just after the text `before`."""
    return before.count("\n") + 1, len(before) - before.rfind("\n")


def _mark(mark: yaml.Mark) -> tuple[int, int]:
    return mark.line + 1, mark.column + 1


def _key(index: object) -> object:
    """The path part of a node the composer is at: a key's text, a list index, or None for a key itself."""
    if isinstance(index, yaml.ScalarNode):
        return index.value
    return "?" if isinstance(index, yaml.Node) else index


def _render(loc: list) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{shorten(str(p))}" for p in loc if p is not None).lstrip(".")


def _path_to(root: yaml.Node, target: yaml.Node) -> list:
    """The key path from root to target (iterative: only reached on errors)."""
    stack: list[tuple[yaml.Node, list]] = [(root, [])]
    seen: set[int] = set()
    while stack:
        node, loc = stack.pop()
        if node is target:
            return loc
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            stack += [(k, loc) for k, _ in node.value] + [(v, loc + [_key(k)]) for k, v in node.value]
        elif isinstance(node, yaml.SequenceNode):
            stack += [(v, loc + [i]) for i, v in enumerate(node.value)]
    return []


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
    if kind == "value_error":
        text = msg.removeprefix("Value error, ")
        return text.removeprefix(_render(loc) + ": "), ""  # the location is shown already
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
