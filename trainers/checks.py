"""Compile checks of a graph trained with Flow-GRPO (registered with the algorithm; pure functions of the spec)."""

from __future__ import annotations

from masgraph.errors import Problem, one_of, shorten
from masgraph.registry import Registry
from masgraph.spec import GraphSpec
from masgraph.trainers.config import FlowGRPOConfig, TrainSpec

LEARNABLE_BACKENDS = ("hf", "vllm")
"""Backends whose policies the learner trains: both serve the local base model the learner loads, as LoRA adapters."""


def flow_grpo_problems(spec: GraphSpec, registry: Registry) -> list[Problem]:
    """Something to train, each trained policy served by a learnable backend (hf, vllm) with an adapter of its own."""
    trainable = {n: p for n, p in spec.policies.items() if p.trainable}
    if not trainable:
        return [Problem("train", "the graph has a `train:` section but no trainable policy",
                        "set `trainable: true` (and an `adapter:`) on the policies to train")]
    problems = []
    adapters: dict[str, str] = {}
    for pname, pol in trainable.items():
        if pol.backend not in LEARNABLE_BACKENDS:
            problems.append(Problem(f"policies.{pname}.backend", f"backend {shorten(pol.backend)!r} cannot serve a "
                                    "trained policy (the learner's LoRA adapters live on a local base model)",
                                    "use `backend: hf` (in process) or `backend: vllm`"))
        elif pol.adapter is None:
            problems.append(Problem(f"policies.{pname}", "a trained policy needs an `adapter:`",
                                    "give it its own adapter name, e.g. `adapter: " + pname + "`"))
        elif adapters.setdefault(pol.adapter, pname) != pname:
            problems.append(Problem(f"policies.{pname}.adapter", f"adapter {shorten(pol.adapter)!r} is also trained "
                                    f"by policy {shorten(adapters[pol.adapter])!r}",
                                    "give each trainable policy its own adapter"))
    if isinstance(spec.train, TrainSpec):  # its Flow-GRPO knobs (joint training's too)
        problems += node_knob_problems(spec.train.flow_grpo, spec.trainable_adapters())
    return problems


def node_knob_problems(config: FlowGRPOConfig, trainable: dict[str, str]) -> list[Problem]:
    """The per-node Flow-GRPO knobs (`node_lr`, `node_temperature`, `counterfactual.alternatives`) name trainable
    nodes with usable values, and the nodes of one adapter agree on `node_lr` and `node_temperature`; the other
    `counterfactual` knobs have alternatives to use. `trainable` maps node -> adapter. Checked by `masgraph validate`
    and again when the trainer is built (a Python-built graph)."""
    problems = []
    where = "train.flow_grpo"
    cf = config.counterfactual
    for knob, values in (("node_lr", config.node_lr), ("node_temperature", config.node_temperature),
                         ("counterfactual.alternatives", cf.alternatives)):
        for node, value in values.items():
            if node not in trainable:
                problems.append(Problem(f"{where}.{knob}.{node}", f"{shorten(node)!r} is not a trainable node",
                                        f"use one of {one_of(trainable)}"))
            elif not knob.startswith("counterfactual") and not value > 0:
                problems.append(Problem(f"{where}.{knob}.{node}", f"must be above 0 (got {value})"))
            elif knob.startswith("counterfactual") and (len({a.strip() for a in value}) < 2
                                                        or not all(a.strip() for a in value)):
                problems.append(Problem(f"{where}.{knob}.{node}", f"needs two or more distinct, non-empty "
                                        f"completions (got {shorten(repr(value))})", "list the outputs the node "
                                        "chooses among, e.g. [\"Operation: ADD\", \"Operation: NOOP\"]"))
    if not problems:  # the nodes of one adapter (and so of one policy) must agree on its learning rate, temperature
        for knob, default, what in (("node_lr", config.lr, "learning rates"),
                                    ("node_temperature", config.temperature, "temperatures")):
            problems += owner_values(knob, getattr(config, knob), default, trainable, "adapter", what)[1]
    if cf.advantage == "replace" and not cf.alternatives:
        problems.append(Problem(f"{where}.counterfactual.advantage", "`replace` needs `counterfactual.alternatives` "
                                "(the scores that replace the outcome advantage)", "list a node's alternatives under "
                                "`counterfactual: {alternatives: ...}`, or drop `counterfactual.advantage`"))
    for knob, what in (("rows", "the alternatives to force"), ("probes", "the alternatives to score on the probes"),
                       ("decisions", "the decisions to draw from"), ("norm", "the advantages to normalise")):
        if getattr(cf, knob) and not cf.alternatives:
            problems.append(Problem(f"{where}.counterfactual.{knob}", f"needs `counterfactual.alternatives` ({what})",
                                    "list a node's alternatives under `counterfactual: {alternatives: ...}`, or "
                                    f"drop `counterfactual.{knob}`"))
    return problems


def owner_values(knob: str, overrides: dict[str, float], default: float, owner_of: dict[str, str], owner: str,
                 what: str) -> tuple[dict[str, float], list[Problem]]:
    """Each owner's value of a per-node Flow-GRPO knob (`node_lr` per adapter, `node_temperature` per policy), and
    the problems: every node of `owner_of` takes its override or `default`, and the nodes of one owner must agree, so
    an override given to some nodes of a shared adapter or policy is an error, not silently applied to the others."""
    out: dict[str, float] = {}
    problems = []
    for node, name in owner_of.items():
        value = overrides.get(node, default)
        if out.setdefault(name, value) != value:
            problems.append(Problem(f"train.flow_grpo.{knob}.{node}", f"nodes sharing {owner} {shorten(name)!r} were "
                                    f"given different {what} ({out[name]} and {value})",
                                    f"give every node of one {owner} the same `{knob}`"))
    return out, problems


def topology_problems(spec: GraphSpec, registry: Registry) -> list[Problem]:
    """HRPO needs decisions to learn: a `topology:` section."""
    if spec.topology is None:
        return [Problem("train.algorithm", f"algorithm {spec.train.algorithm!r} learns the graph's topology, but the "
                        "graph has no `topology:` section", "declare gated `nodes:`, `edges:` or `choices:` under "
                        "`topology:` (see graphs/router.yaml), or use `algorithm: flow_grpo`")]
    return []


def joint_problems(spec: GraphSpec, registry: Registry) -> list[Problem]:
    return topology_problems(spec, registry) + flow_grpo_problems(spec, registry)
