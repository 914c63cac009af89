"""Compile a GraphSpec into a frozen, checked Graph: structure, topology decisions, policies, agents, tools, prompts."""

from __future__ import annotations

import difflib
from pathlib import Path

from pydantic import ValidationError

from masgraph.errors import Problem, SpecError, one_of, shorten
from masgraph.graph.space import DecisionSpace
from masgraph.graph.structure import Graph, check_structure
from masgraph.loader import keep_source, locate, problems_from, validate_train
from masgraph.registry import Registry, default_registry
from masgraph.spec import GraphSpec


def compile_spec(spec: GraphSpec, file: str | None = None, check_models: bool = True,
                 registry: Registry | None = None) -> Graph:
    """Check a spec against the structural rules (reachability, bounded cycles, fan-in merges) and the registry
    (plugins load, agents, routes, tools, backends, models and the `train:` section exist and fit), every problem
    located; the Graph's spec has its `train:` section as its algorithm's typed model."""
    registry = registry or default_registry()
    problems = check_structure(spec.nodes, spec.edges, spec.entry, spec.exit, spec.limits.max_turns,
                               spec.limits.max_steps)
    if spec.topology is not None:
        problems = _topology_problems(spec, problems)
    problems += registry.load_plugins(spec.plugins, _folder_of(file))
    problems += _policy_problems(spec, registry, check_models) + _registry_problems(spec, registry)
    train, train_problems = validate_train(spec.train, registry)
    problems += train_problems
    typed = spec if train is spec.train else keep_source(spec.model_copy(update={"train": train}), spec)
    if train is not None and not train_problems:
        problems += registry.algorithm(train.algorithm).check(typed, registry)
    if problems:
        raise SpecError(locate(problems, spec), file)
    return Graph(typed, registry)


def _topology_problems(spec: GraphSpec, whole_graph: list[Problem]) -> list[Problem]:
    """A graph with a `topology:` section runs only its sampled sub-graphs, each checked when its decision space
    is built: the whole graph need not be valid itself (a choice's branches never run together, so they need
    no merge), but some combination of decisions must be."""
    kept = [p for p in whole_graph if not p.message.startswith("fan-in node has parallel inputs")]
    if kept:  # an orphan node, an unbounded cycle ...: wrong whatever the decisions
        return kept
    try:
        space = DecisionSpace(Graph(spec))
    except ValueError as exc:
        return [Problem("topology", str(exc), "")]
    if not space.valid_count:
        return whole_graph + [Problem("topology", "no combination of the topology's decisions gives a valid graph "
                                      f"(checked all {space.total}); first: "
                                      + "; ".join(p.message for p in space.problems),
                                      "gate fewer nodes or edges, or fix the graph's structure")]
    return [Problem(space.path_of(d), f"decision {d.name!r} can only ever be {only!r}: every valid graph has it so",
                    "drop it from `topology:` (or fix what makes its other options invalid, e.g. a missing merge)")
            for d, only in space.forced()]


def _policy_problems(spec: GraphSpec, registry: Registry, check_models: bool) -> list[Problem]:
    problems = []
    for pname, pol in spec.policies.items():
        kind = registry.backends.get(pol.backend)
        if kind is None:
            problems.append(Problem(f"policies.{pname}.backend", f"backend {shorten(pol.backend)!r} is not registered",
                                    f"use one of {one_of(registry.backends)}"))
            continue
        if pol.trainable and not kind.returns_tokens:
            tokens = sorted(n for n, k in registry.backends.items() if k.returns_tokens)
            problems.append(Problem(f"policies.{pname}.backend",
                                    f"trainable policy uses backend {pol.backend!r}, which returns no token "
                                    "ids/logprobs", f"use one of {tokens} or set trainable: false"))
        if check_models and kind.local_models and pol.model not in registry.models:
            problem = model_dir_problem(pol.model, registry)
            if problem is not None:
                problems.append(Problem(f"policies.{pname}.model", *problem))
    return problems


WEIGHT_FILES = ("*.safetensors", "pytorch_model*.bin", "*.safetensors.index.json")
"""What a Hugging Face model directory holds its weights in (one of them, beside config.json)."""


def model_dir_problem(model: str, registry: Registry) -> tuple[str, str] | None:
    """(message, fix) when `model` (not an embedded model) is no loadable local HF model directory: one that does
    not exist, a file, an empty directory, one without config.json or without weights; None when it looks loadable.
    A relative path starts at the current directory, as when the model loads."""
    embedded = f"use one of {one_of(registry.models)} (embedded)"
    saved = "the directory save_pretrained wrote: config.json, the weights, the tokenizer files"
    try:
        path = Path(model).expanduser()
        exists, is_dir = path.exists(), path.is_dir()
    except (OSError, ValueError):  # a name too long for the file system, or one holding a NUL byte
        exists = is_dir = False
    name = shorten(model)
    if not exists:
        if any(c in model for c in "/\\") or model.startswith((".", "~")):
            where = "" if path.is_absolute() else f" (relative to the current directory {shorten(str(Path.cwd()))})"
            return (f"model directory {name!r} does not exist{where}",
                    f"fix the path to the model directory, or {embedded}")
        return (f"model {name!r} is not installed: it is not an embedded model, and no directory of that name exists",
                f"{embedded} or the path of a local HF model directory (masgraph never downloads weights)")
    if not is_dir:
        return f"model {name!r} is a file, not a model directory", f"point `model:` at {saved}"
    try:
        if next(path.iterdir(), None) is None:
            return (f"model directory {name!r} is empty",
                    f"copy a saved model there (config.json, the weights, the tokenizer files), or {embedded}")
        if not (path / "config.json").is_file():
            return (f"model directory {name!r} has no config.json, so it is not a Hugging Face model directory",
                    f"point `model:` at {saved}")
        if not any(next(path.glob(pattern), None) is not None for pattern in WEIGHT_FILES):
            return (f"model directory {name!r} has config.json but no weights (*.safetensors or pytorch_model*.bin)",
                    f"copy the weights there, or point `model:` at {saved}")
    except OSError as exc:
        return f"model directory {name!r} cannot be read: {exc.strerror or exc}", "check its permissions"
    return None


def _folder_of(file: str | None) -> Path | None:
    """The folder of the graph file (where relative plugin paths start), when `file` is one."""
    try:
        return Path(file).parent if file and Path(file).is_file() else None
    except (OSError, ValueError):
        return None


def _registry_problems(spec: GraphSpec, registry: Registry) -> list[Problem]:
    """Agents, routes, tool kinds (with their options) and prompt templates must exist."""
    out = []
    for name, node in spec.nodes.items():
        key = node.agent or node.role
        if key not in registry.agents:
            out.append(Problem(f"nodes.{name}.agent", f"agent {shorten(key)!r} is not registered",
                               f"use one of {one_of(registry.agents)}, or register it with "
                               f"register_agent({shorten(key)!r}) in a module listed under `plugins:`"))
    for i, e in enumerate(spec.edges):
        routes = registry.routes(spec, e.source) if e.when is not None and e.source in spec.nodes else None
        if routes is not None and e.when not in routes:
            fix = f"use one of {one_of(routes)}" if routes else f"drop `when:` ({shorten(e.source)!r} emits none)"
            out.append(Problem(f"edges[{i}].when", f"{shorten(e.source)!r} never emits route {shorten(e.when)!r}", fix))
    return out + _tool_problems(spec, registry) + _prompt_problems(spec, registry)


def _tool_problems(spec: GraphSpec, registry: Registry) -> list[Problem]:
    """Each tool's kind is registered and its `options` validate against that kind's ToolOptions model."""
    out = []
    for name, tool in spec.tools.items():
        kind = registry.tools.get(tool.kind)
        if kind is None:
            out.append(Problem(f"tools.{name}.kind", f"tool kind {shorten(tool.kind)!r} is not registered",
                               f"use one of {one_of(registry.tools)} or register a function with register_tool "
                               "(in a module listed under `plugins:`)"))
            continue
        try:
            kind.options.model_validate(tool.options)
        except ValidationError as exc:
            out += problems_from(exc, prefix=("tools", name, "options"), model=kind.options)
    return out


def _prompt_problems(spec: GraphSpec, registry: Registry) -> list[Problem]:
    """A node's `prompt:` and a topology slot's prompts name registered templates (masgraph/agents/prompts/)."""
    named = [(f"nodes.{n}.prompt", node.prompt) for n, node in spec.nodes.items() if node.prompt is not None]
    if spec.topology is not None:
        named += [(f"topology.slots.{n}", p) for n, prompts in spec.topology.slots.items() for p in prompts]
    if not named:
        return []
    available = sorted(registry.prompts)
    out = []
    for path, prompt in named:
        if prompt not in available:
            close = difflib.get_close_matches(prompt[:100], available, n=1)
            fix = (f"did you mean {close[0]!r}?" if close else f"use one of {one_of(available)}"
                   + (" or drop `prompt:`" if path.startswith("nodes.") else ""))
            out.append(Problem(path, f"prompt {shorten(prompt)!r} is not a template under masgraph/agents/prompts/",
                               fix))
    return out
