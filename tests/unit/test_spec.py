"""GraphSpec: YAML and builder agree, round-trip, schema, and located errors for bad input."""

from __future__ import annotations

import pytest
import yaml

from masgraph.errors import SpecError
from masgraph.graph import GraphBuilder, compile_spec
from masgraph.loader import load_spec, parse_spec
from masgraph.spec import GraphSpec

LOOP = """\
name: loop
policies:
  p: {backend: scripted}
tools:
  calculator: {kind: calculator}
nodes:
  planner: {role: planner, policy: p}
  executor: {role: executor, tools: [calculator]}
  verifier: {role: verifier, policy: p}
  generator: {role: generator, policy: p}
edges:
  - {source: planner, target: executor}
  - {source: executor, target: verifier}
  - {source: verifier, target: planner, when: continue}
  - {source: verifier, target: generator, when: stop}
entry: planner
exit: generator
limits: {max_turns: 3}
"""


def _errors(text: str) -> SpecError:
    with pytest.raises(SpecError) as info:
        compile_spec(parse_spec(text, "g.yaml"), "g.yaml")
    return info.value


def test_every_shipped_graph_validates(graph_files):
    assert len(graph_files) == 3, [p.name for p in graph_files]
    for path in graph_files:
        graph = compile_spec(load_spec(path), str(path))
        assert graph.spec.entry in graph.spec.nodes


@pytest.mark.parametrize("name", ["agentflow", "single", "fanout"])
def test_yaml_round_trip(root, name):
    spec = load_spec(root / "graphs" / f"{name}.yaml")
    again = parse_spec(yaml.safe_dump(spec.model_dump(mode="json")))
    assert again == spec


def test_builder_matches_yaml():
    built = (GraphBuilder("loop")
             .add_policy("p", backend="scripted")
             .add_tool("calculator", kind="calculator")
             .add_node("planner", role="planner", policy="p")
             .add_node("executor", role="executor", tools=["calculator"])
             .add_node("verifier", role="verifier", policy="p")
             .add_node("generator", role="generator", policy="p")
             .add_edge("planner", "executor").add_edge("executor", "verifier")
             .add_edge("verifier", "planner", when="continue").add_edge("verifier", "generator", when="stop")
             .set(limits={"max_turns": 3})
             .compile())
    assert built.spec == parse_spec(LOOP)
    assert built.cycle_of.keys() == {"planner", "executor", "verifier"}


def test_json_schema_carries_field_docs():
    schema = GraphSpec.model_json_schema()
    assert schema["additionalProperties"] is False
    limits = schema["$defs"]["Limits"]["properties"]["max_turns"]
    assert "cycle" in limits["description"]
    assert set(schema["properties"]["nodes"]["additionalProperties"]["discriminator"]["mapping"]) == {
        "planner", "executor", "verifier", "generator", "memory", "custom"}


def test_malformed_yaml_gives_line_and_column():
    err = _errors("name: x\nnodes:\n  a: {role: generator, policy: p\nentry: a\n")
    text = str(err)
    assert text.startswith("g.yaml:4:") and "YAML syntax" in text


def test_unknown_key_is_located_with_suggestion():
    err = _errors(LOOP.replace("policy: p}\n  generator", "polcy: p}\n  generator"))
    [p] = [p for p in err.problems if "polcy" in p.path]
    assert p.path == "nodes.verifier.polcy" and p.line == 9 and "did you mean 'policy'" in p.fix


def test_wrong_type_and_out_of_range_values_say_what_to_write():
    err = _errors(LOOP.replace("limits: {max_turns: 3}\n", "limits: {max_turns: 0}\n"
                               "train: {task: basic_arithmetic, steps: lots, flow_grpo: {lr: fast}}\n"))
    fixes = {p.path: p.fix for p in err.problems}
    assert fixes["train.steps"] == "write a whole number, e.g. 8"
    assert fixes["train.flow_grpo.lr"] == "write a number, e.g. 0.001"
    assert fixes["limits.max_turns"] == "use a value ≥ 1"
    assert str(err).startswith("3 problems in g.yaml:\ng.yaml:")


def test_unknown_node_in_edge():
    err = _errors(LOOP.replace("target: generator, when: stop", "target: genrator, when: stop"))
    [p] = err.problems
    assert "edges[3].target 'genrator' is not a node" in p.message and "use one of" in p.message
    assert p.path == "edges[3].target" and p.line == 15  # located in the file, not just named


def test_unbounded_cycle_is_rejected():
    err = _errors(LOOP.replace("limits: {max_turns: 3}\n", ""))
    assert any(p.path == "limits.max_turns" and "unbounded" in p.message for p in err.problems)


def test_cycle_without_conditional_exit_is_rejected():
    text = LOOP.replace("target: planner, when: continue", "target: planner").replace(
        "  - {source: verifier, target: generator, when: stop}\n", "  - {source: verifier, target: generator}\n")
    err = _errors(text)
    assert any("no conditional exit" in p.message for p in err.problems)


def test_fan_in_needs_merge(root):
    text = (root / "graphs" / "fanout.yaml").read_text().replace(", merge: concat", "")
    err = _errors(text)
    assert any(p.path == "nodes.judge.merge" for p in err.problems)


def test_trainable_policy_needs_token_backend():
    err = _errors(LOOP.replace("p: {backend: scripted}", "p: {backend: litellm, model: openai/x, trainable: true}"))
    assert any(p.path == "policies.p.backend" and "token ids" in p.message for p in err.problems)


def test_missing_model_is_a_located_error():
    err = _errors(LOOP.replace("p: {backend: scripted}", "p: {backend: hf, model: /no/such/model}"))
    [p] = err.problems
    assert p.path == "policies.p.model" and "not installed" in p.message


def test_unregistered_tool_kind_and_agent():
    err = _errors(LOOP.replace("{kind: calculator}", "{kind: abacus}").replace(
        "generator: {role: generator, policy: p}", "generator: {role: custom, agent: nope, policy: p}"))
    paths = {p.path for p in err.problems}
    assert {"tools.calculator.kind", "nodes.generator.agent"} <= paths


def test_node_without_required_policy():
    with pytest.raises(SpecError, match="a verifier needs `policy:`"):
        parse_spec(LOOP.replace("verifier: {role: verifier, policy: p}", "verifier: {role: verifier}"))


def test_unreachable_node():
    err = _errors(LOOP.replace("nodes:\n", "nodes:\n  orphan: {role: generator, policy: p}\n"))
    assert any(p.path == "nodes.orphan" for p in err.problems)


def test_edge_condition_must_be_a_route_the_source_emits():
    err = _errors(LOOP.replace("target: generator, when: stop", "target: generator, when: stpo"))
    [p] = err.problems
    assert p.path == "edges[3].when" and "never emits route 'stpo'" in p.message and "continue" in p.fix
