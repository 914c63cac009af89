"""The registry: plugins named in a graph, the train section keyed by algorithm, backends with capabilities."""

from __future__ import annotations

import textwrap

import pytest

from masgraph.backends.kinds import register as register_backends
from masgraph.errors import SpecError
from masgraph.graph import GraphBuilder, compile_spec
from masgraph.loader import load_spec, parse_spec
from masgraph.registry import Algorithm, BackendKind, Registry, default_registry, register_core

GRAPH = """
name: plug
plugins: [{plugin}]
policies: {{main: {{backend: scripted}}}}
nodes:
  answer: {{role: custom, agent: shout}}
entry: answer
exit: answer
"""

PLUGIN = """
from masgraph.agents import register_agent
from masgraph.node import NodeOutput

@register_agent("shout")
async def shout(ctx):
    return NodeOutput(text=ctx.query.upper(), answer=ctx.query.upper())
"""


def test_a_plugin_file_named_in_the_graph_registers_its_agent(tmp_path, run):
    (tmp_path / "my_agents.py").write_text(PLUGIN)
    (tmp_path / "g.yaml").write_text(GRAPH.format(plugin="my_agents.py"))
    assert "shout" not in default_registry().agents
    graph = compile_spec(load_spec(tmp_path / "g.yaml"), str(tmp_path / "g.yaml"))  # relative to the graph file
    from masgraph.backends.scripted import ScriptedBackend
    from masgraph.runtime.engine import Engine

    trace = run(Engine(graph, backends={"scripted": ScriptedBackend()}).episode("hi there"))
    assert trace.answer == "HI THERE" and trace.status == "ok"


def test_a_missing_or_broken_plugin_is_a_located_error(tmp_path):
    (tmp_path / "broken.py").write_text("raise RuntimeError('plugin exploded')\n")
    for plugin, why in (("nope_not_a_module", "ModuleNotFoundError"), ("missing.py", "no such file"),
                        ("broken.py", "plugin exploded")):
        path = tmp_path / f"{plugin}.yaml"
        path.write_text(GRAPH.format(plugin=plugin))
        with pytest.raises(SpecError) as err:
            compile_spec(load_spec(path), str(path))
        text = str(err.value)
        assert f"{path.name}:3:" in text and "plugins[0]" in text and why in text, text
        assert "agent 'shout' is not registered" in text  # and the consequence, in the same report


def test_train_section_is_keyed_by_algorithm():
    base = "name: t\npolicies: {p: {backend: hf, trainable: true, adapter: p}}\nnodes: {a: {role: generator, " \
           "policy: p}}\nentry: a\nexit: a\n"
    spec = parse_spec(base + "train: {steps: 3, flow_grpo: {group_size: 4}}\n")
    assert spec.train.algorithm == "flow_grpo" and spec.train.flow_grpo.group_size == 4  # the default algorithm
    with pytest.raises(SpecError) as err:
        parse_spec(base + "train: {algorithm: ppo2}\n", "g.yaml")
    assert "g.yaml:6:" in str(err.value) and "unknown training algorithm 'ppo2'" in str(err.value)
    assert "'flow_grpo'" in str(err.value)
    with pytest.raises(SpecError) as err:
        parse_spec(base + "train:\n  flow_grpo: {group_sise: 4}\n", "g.yaml")
    assert "g.yaml:7:" in str(err.value) and "did you mean 'group_size'" in str(err.value)


def test_a_second_algorithm_registers_its_own_section():
    from typing import Literal

    from pydantic import BaseModel

    class Toy(BaseModel):
        model_config = {"extra": "forbid"}
        algorithm: Literal["toy"] = "toy"
        knob: int = 1

    reg = Registry(agents=dict(default_registry().agents))
    register_core(reg)
    register_backends(reg)
    reg.algorithms["toy"] = Algorithm("toy", Toy, lambda spec, r: [], lambda: None)
    graph = (GraphBuilder("g").add_policy("p", backend="scripted").add_node("a", role="generator", policy="p")
             .set(train={"algorithm": "toy", "knob": 5}).compile(registry=reg))
    assert isinstance(graph.spec.train, Toy) and graph.spec.train.knob == 5


def test_backend_capabilities_come_from_the_registry():
    reg = Registry(agents=dict(default_registry().agents))
    register_core(reg)
    register_backends(reg)
    spec = (GraphBuilder("g").add_policy("p", backend="remote", trainable=True)
            .add_node("a", role="generator", policy="p").spec())
    with pytest.raises(SpecError, match="backend 'remote' is not registered"):
        compile_spec(spec, registry=reg)
    reg.backends["remote"] = BackendKind("remote", lambda policy, **o: None, returns_tokens=False)
    with pytest.raises(SpecError, match="returns no token ids"):
        compile_spec(spec, registry=reg)
    reg.backends["remote"] = BackendKind("remote", lambda policy, **o: None, returns_tokens=True)
    assert compile_spec(spec, registry=reg).spec.policies["p"].backend == "remote"


def test_registrations_do_not_leak_between_tests_part_1():
    from masgraph.agents import register_agent

    @register_agent("leaky")
    async def leaky(ctx):
        return None

    assert "leaky" in default_registry().agents


def test_registrations_do_not_leak_between_tests_part_2():
    assert "leaky" not in default_registry().agents


def test_custom_agent_routes_are_checked_when_declared():
    from masgraph.agents import register_agent
    from masgraph.node import NodeOutput

    @register_agent("judge", routes={"yes", "no"})
    async def judge(ctx):
        return NodeOutput(route="yes")

    g = (GraphBuilder("g").add_node("j", role="custom", agent="judge").add_node("b", role="custom", agent="judge")
         .add_edge("j", "b", when="maybe"))
    with pytest.raises(SpecError, match=textwrap.shorten("'j' never emits route 'maybe'", 80)):
        g.compile()


def test_a_plugin_registers_into_the_registry_that_loads_it_and_any_later_one(tmp_path):
    (tmp_path / "my_agents.py").write_text(PLUGIN)
    (tmp_path / "g.yaml").write_text(GRAPH.format(plugin="my_agents.py"))

    def fresh():
        reg = Registry(agents=dict(default_registry().agents))
        register_core(reg)
        register_backends(reg)
        return reg

    first, second = fresh(), fresh()
    graph = compile_spec(load_spec(tmp_path / "g.yaml"), registry=first)  # plugin path absolute since load
    assert "shout" in first.agents and "shout" not in default_registry().agents and graph.registry is first
    compile_spec(load_spec(tmp_path / "g.yaml"), registry=second)  # the module is cached: its entries replayed
    assert second.agents["shout"] is first.agents["shout"]


def test_a_bad_algorithm_value_is_located_not_a_traceback():
    base = "name: t\npolicies: {p: {backend: hf, trainable: true, adapter: p}}\nnodes: {a: {role: generator, " \
           "policy: p}}\nentry: a\nexit: a\n"
    for value in ("[flow_grpo]", "{a: 1}", "3"):
        with pytest.raises(SpecError, match="train.algorithm: unknown training algorithm"):
            parse_spec(base + f"train: {{algorithm: {value}}}\n", "g.yaml")


TOOL_PLUGIN = """
from masgraph.agents import register_tool

@register_tool("adder")              # the form register_agent takes (issue 30, finding 7)
def add(a: int, b: int = 0) -> int:
    "Add two whole numbers."
    return a + b
"""


def test_register_tool_takes_its_name_positionally_as_register_agent_does(tmp_path, run):
    from masgraph.agents import register_tool
    from masgraph.agents.tools.registry import build_tools
    from masgraph.spec import ToolSpec

    (tmp_path / "my_tools.py").write_text(TOOL_PLUGIN)
    (tmp_path / "g.yaml").write_text("name: t\nplugins: [my_tools.py]\npolicies: {main: {backend: scripted}}\n"
                                     "tools: {add: {kind: adder}}\n"
                                     "nodes: {answer: {role: generator, policy: main}}\nentry: answer\nexit: answer\n")
    graph = compile_spec(load_spec(tmp_path / "g.yaml"), str(tmp_path / "g.yaml"))
    kind = graph.registry.tools["adder"]
    assert kind.description == "Add two whole numbers." and kind.schema["required"] == ["a"]
    assert run(build_tools({"add": ToolSpec(kind="adder")}, graph.registry)["add"]('{"a": 2, "b": 3}')) == "5"

    @register_tool  # the other two forms still work
    def bare(text: str) -> str:
        return text

    @register_tool(name="keyword")
    def kw(text: str) -> str:
        return text

    assert {"bare", "keyword"} <= set(default_registry().tools)
    with pytest.raises(TypeError, match="two names"):
        register_tool("a", name="b")
    with pytest.raises(TypeError, match="a function or a tool name"):
        register_tool(42)
