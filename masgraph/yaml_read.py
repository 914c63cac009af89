"""Bounded YAML reading for graph files and a run's spec copy: nesting depth and alias expansion capped, duplicate
keys refused, every refusal a located SpecError (file, line:column, fix)."""

from __future__ import annotations

import yaml

from masgraph.errors import Problem, SpecError, shorten

MAX_DEPTH = 64
"""Deepest nesting of mappings and lists in a spec (a graph needs about 5; far deeper YAML exhausts the stack)."""
ALIAS_BUDGET = 10_000
"""Most YAML nodes that aliases may add once expanded (refuses 'billion laughs' alias bombs)."""


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
