"""Load a GraphSpec from YAML with errors that give file, line:column, key path and the fix (reading bounded by
masgraph/yaml_read.py, problems located by masgraph/locate.py)."""

from __future__ import annotations

import warnings
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from pydantic import BaseModel, ValidationError

from masgraph.errors import Problem, SpecError, one_of, shorten
from masgraph.locate import locate_in, problems_from
from masgraph.spec import GraphSpec, MovedKeysWarning
from masgraph.yaml_read import _decode, _load_yaml, _mark, read_yaml

if TYPE_CHECKING:
    from masgraph.registry import Registry

__all__ = ["keep_source", "load_spec", "locate", "locate_in", "parse_spec", "problems_from", "read_yaml",
           "validate_train"]

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
