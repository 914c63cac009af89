"""Flow-GRPO's per-node overrides: `node_temperature` sets what each trainable node's policy samples at in training
rollouts (the others keep `temperature`; evaluation keeps the graph's own), `node_lr` its adapter's learning rate;
a name that is not a trainable node, a non-positive value, or two nodes of one policy / adapter that disagree
(an override for some of its nodes only, too) are located errors."""

from __future__ import annotations

import pytest
import torch

from masgraph.errors import SpecError
from masgraph.loader import parse_spec
from masgraph.trainers.config import FlowGRPOConfig
from masgraph.trainers.flow_grpo import FlowGRPO

GRAPH = """\
name: two
policies:
  plan: {backend: scripted, model: none, adapter: plan, trainable: true, sampling: {temperature: 0.0}}
  check: {backend: scripted, model: none, adapter: check, trainable: true, sampling: {temperature: 0.0}}
  fixed: {backend: scripted, model: none, sampling: {temperature: 0.0}}
nodes:
  planner: {role: planner, policy: plan}
  replanner: {role: planner, policy: plan}
  verifier: {role: verifier, policy: check}
  answer: {role: generator, policy: fixed}
edges:
  - {source: planner, target: replanner}
  - {source: replanner, target: verifier}
  - {source: verifier, target: planner, when: continue}
  - {source: verifier, target: answer, when: stop}
entry: planner
exit: answer
"""
TRAINABLE = {"planner": "plan", "replanner": "plan", "verifier": "check"}


class Learner:
    """Just what FlowGRPO's constructor asks of a learner."""

    def __init__(self):
        self.weights = {a: [torch.nn.Parameter(torch.zeros(2))] for a in ("plan", "check")}

    def adapters(self):
        return list(self.weights)

    def parameters(self, adapter):
        return self.weights[adapter]


def _algo(**knobs) -> FlowGRPO:
    return FlowGRPO(Learner(), TRAINABLE, FlowGRPOConfig(temperature=0.7, **knobs))


def test_node_temperature_sets_its_policy_and_leaves_the_rest_at_the_flow_grpo_temperature():
    spec = parse_spec(GRAPH, "g.yaml")
    hot = _algo(node_temperature={"verifier": 1.5}).rollout_spec(spec)
    assert {n: p.sampling.temperature for n, p in hot.policies.items()} == {"plan": 0.7, "check": 1.5, "fixed": 0.0}
    assert _algo().rollout_spec(spec).policies["check"].sampling.temperature == 0.7  # no override: the default
    assert spec.policies["check"].sampling.temperature == 0.0  # the graph itself (evaluation's) is untouched


def test_node_lr_sets_its_adapters_learning_rate():
    algo = _algo(lr=1e-3, node_lr={"verifier": 1e-4})
    assert {a: o.param_groups[0]["lr"] for a, o in algo.optimizers.items()} == {"plan": 1e-3, "check": 1e-4}


@pytest.mark.parametrize("knobs,where,what", [
    ({"node_temperature": {"verifer": 1.2}}, "train.flow_grpo.node_temperature.verifer", "not a trainable node"),
    ({"node_lr": {"answer": 1e-4}}, "train.flow_grpo.node_lr.answer", "not a trainable node"),
    ({"node_temperature": {"verifier": 0.0}}, "train.flow_grpo.node_temperature.verifier", "must be above 0"),
    ({"node_lr": {"planner": 1e-3, "replanner": 1e-4}}, "train.flow_grpo.node_lr.replanner", "different learning"),
])
def test_a_wrong_override_is_a_located_error(knobs, where, what):
    with pytest.raises(SpecError) as err:
        _algo(**knobs)
    assert err.value.problems[0].path == where and what in str(err.value)


def test_two_nodes_of_one_policy_at_different_temperatures_is_a_located_error():
    with pytest.raises(SpecError, match="nodes sharing adapter 'plan' were given different temperatures") as err:
        _algo(node_temperature={"planner": 1.0, "replanner": 1.3})
    assert err.value.problems[0].path == "train.flow_grpo.node_temperature.replanner"


@pytest.mark.parametrize("knob,value", [("node_temperature", 1.3), ("node_lr", 1e-4)])
def test_an_override_for_some_nodes_of_a_shared_policy_is_an_error_not_applied_to_the_others(knob, value):
    """planner and replanner share one policy and adapter: overriding only the planner would silently change the
    replanner too (it samples / updates with the planner's value), so both knobs refuse it alike."""
    with pytest.raises(SpecError, match="nodes sharing") as err:
        _algo(**{knob: {"planner": value}}).rollout_spec(parse_spec(GRAPH, "g.yaml"))
    assert err.value.problems[0].path == f"train.flow_grpo.{knob}.replanner"
    both = _algo(**{knob: {"planner": value, "replanner": value}})  # the whole policy: fine
    hot = both.rollout_spec(parse_spec(GRAPH, "g.yaml"))
    assert (hot.policies["plan"].sampling.temperature if knob == "node_temperature"
            else both.optimizers["plan"].param_groups[0]["lr"]) == value


@pytest.mark.parametrize("knobs,where,what", [
    ("node_lr: {verifer: 0.001}", "train.flow_grpo.node_lr.verifer", "not a trainable node"),
    ("node_temperature: {verifier: 0.0}", "train.flow_grpo.node_temperature.verifier", "must be above 0"),
    ("counterfactual: {alternatives: {answer: [a, b]}}", "train.flow_grpo.counterfactual.alternatives.answer",
     "not a trainable node"),
    ("counterfactual: {alternatives: {verifier: [a, ' a']}}", "train.flow_grpo.counterfactual.alternatives.verifier",
     "two or more distinct"),
    ("counterfactual: {rows: true}", "train.flow_grpo.counterfactual.rows", "needs `counterfactual.alternatives`"),
    ("counterfactual: {norm: true}", "train.flow_grpo.counterfactual.norm", "needs `counterfactual.alternatives`"),
    ("node_lr: {planner: 0.001}", "train.flow_grpo.node_lr.replanner", "nodes sharing adapter 'plan'"),
    ("node_temperature: {planner: 1.0, replanner: 0.5}", "train.flow_grpo.node_temperature.replanner",
     "different temperatures (1.0 and 0.5)"),
    ("counterfactual: {advantage: replace}", "train.flow_grpo.counterfactual.advantage",
     "needs `counterfactual.alternatives`"),
])
def test_masgraph_validate_finds_a_wrong_per_node_knob_on_its_line(tmp_path, knobs, where, what):
    """The same checks run when the graph compiles (`masgraph validate`, `masgraph train` before any run dir), located
    in the YAML, not only once the trainer is built."""
    from masgraph.cli import _load_graph, main

    hf = GRAPH.replace("backend: scripted, model: none", "backend: hf, model: smollm2-135m")
    hf += "limits: {max_turns: 3}\n"
    path = tmp_path / "g.yaml"
    path.write_text(hf + f"train:\n  task: basic_arithmetic\n  flow_grpo:\n    {knobs}\n")
    with pytest.raises(SpecError) as err:
        _load_graph(str(path), check_models=False)
    [problem] = err.value.problems
    assert problem.path == where and what in str(err.value) and problem.line == hf.count("\n") + 4
    assert main(["validate", "--no-model-check", str(path)]) == 1
    path.write_text(hf + "train:\n  task: basic_arithmetic\n")
    assert main(["validate", "--no-model-check", str(path)]) == 0
