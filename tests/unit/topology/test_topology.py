"""Topology learning's core: the `topology:` section, the decision space, the policy's masked sampling and
log-probs, the trace record, and HRPO learning a two-arm scripted toy."""

from __future__ import annotations

import asyncio
import math
import random
from pathlib import Path

import pytest
import torch

from masgraph.agents import register_agent
from masgraph.errors import SpecError
from masgraph.graph import Graph, GraphBuilder, compile_spec
from masgraph.graph.space import DecisionSpace
from masgraph.loader import load_spec
from masgraph.node import NodeOutput
from masgraph.runtime.engine import Engine
from masgraph.topology.policy import TopologyPolicy
from masgraph.trace import Trace
from masgraph.trainers.config import HRPOConfig
from masgraph.trainers.hrpo import HRPO

ROOT = Path(__file__).resolve().parents[3]


def _builder(name: str, nodes: list[str], edges: list[tuple[str, str]], merge: set[str] = frozenset()):
    b = GraphBuilder(name).add_policy("p", backend="scripted")
    for n in nodes:
        b.add_node(n, role="generator", policy="p", **({"merge": "concat"} if n in merge else {}))
    for s, t in edges:
        b.add_edge(s, t)
    return b.set(entry=nodes[0], exit=nodes[-1])


def _perturb(policy: TopologyPolicy, rng: random.Random) -> None:
    with torch.no_grad():
        for p in policy.parameters():
            p.copy_(torch.tensor([rng.gauss(0, 2) for _ in range(p.numel())]).reshape(p.shape))


@pytest.mark.slow
def test_shipped_supergraph_samples_are_valid_graphs():
    graph = compile_spec(load_spec(ROOT / "graphs/router.yaml"))
    space = DecisionSpace(graph)
    assert space.total == 32 and space.valid_count == 32
    assert space.decisions[0].name == "choice:planner"  # upstream first
    policy = TopologyPolicy(space, "query")
    rng = random.Random(0)
    seen = set()
    for i in range(5000):
        if i % 500 == 0:
            _perturb(policy, rng)
        s = policy.sample(f"what is {i} + {i % 7}?", seed=i)
        view = graph.view(s.topology)
        assert view.problems == [], (s.choice, view.problems)
        route = s.choice.decisions["choice:planner"]
        # exactly the decisions that matter were made: the planner's, and the chosen executor's
        assert set(s.choice.logprobs) == {"choice:planner"} | ({f"choice:{route}"} if route != "generator" else set())
        seen.add(tuple(sorted(s.choice.decisions.items())))
    assert len(seen) == 7  # direct, or one of 3 executors x verifier or not (skipped decisions take a fixed option)


@pytest.mark.slow
def test_random_specs_every_sample_compiles():
    """Random DAGs with random gates and choices, fan-ins only sometimes merged: every sample's sub-graph passes
    the compile rules (the masks make invalid options unreachable), over 10,000 samples."""
    rng, samples, usable, masked = random.Random(1), 0, 0, 0
    while samples < 10_000:
        k = rng.randint(3, 7)
        nodes = [f"n{i}" for i in range(k)]
        edges = [(nodes[i], nodes[i + 1]) for i in range(k - 1) if rng.random() < 0.8]
        edges += [(nodes[i], nodes[j]) for i in range(k) for j in range(i + 2, k) if rng.random() < 0.35]
        edges = list(dict.fromkeys(edges))
        merge = {n for n in nodes if rng.random() < 0.5}
        inner = nodes[1:-1]
        gates = [n for n in inner if rng.random() < 0.3]
        succ = {}
        for s, t in edges:
            succ.setdefault(s, []).append(t)
        choices = {n: rng.sample(ts, rng.randint(2, len(ts))) for n, ts in succ.items()
                   if len(ts) >= 2 and rng.random() < 0.5}
        chosen = {(n, t) for n, ts in choices.items() for t in ts}
        gated_edges = [{"source": s, "target": t} for s, t in edges if (s, t) not in chosen and rng.random() < 0.2]
        topo = {"nodes": gates, "edges": gated_edges, "choices": choices}
        if not (gates or gated_edges or choices):
            continue
        try:
            graph = _builder("rand", nodes, edges, merge).set(topology=topo).compile()
        except SpecError:
            continue  # no valid combination (or the spec itself is broken): refused at compile, located
        usable += 1
        space = DecisionSpace(graph)
        masked += space.valid_count < space.total
        policy = TopologyPolicy(space)
        for j in range(200):
            if j % 50 == 0:
                _perturb(policy, rng)
            s = policy.sample("q", seed=j)
            assert graph.view(s.topology).problems == [], (topo, s.choice)
            samples += 1
    assert usable >= 30 and masked >= 5  # the masks were exercised


def _hand_graph():
    # a -> {b, c, x} is a choice; x leads nowhere (masked); b -> d -> e with d gated; c -> e
    return _builder("hand", ["a", "b", "c", "x", "d", "e"],
                    [("a", "b"), ("a", "c"), ("a", "x"), ("b", "d"), ("b", "e"), ("d", "e"), ("c", "e")],
                    merge={"e"}).set(topology={"nodes": ["d"], "choices": {"a": ["b", "c", "x"]}}).compile()


@pytest.mark.slow
def test_log_probs_hand_checked():
    space = DecisionSpace(_hand_graph())
    assert [d.name for d in space.decisions] == ["choice:a", "node:d"]
    assert space.allowed(()) == [True, True, False]  # x can never reach the exit
    policy = TopologyPolicy(space)
    with torch.no_grad():
        policy.logits[0].copy_(torch.tensor([0.0, math.log(3), math.log(5)]))  # masked: p(b)=1/4, p(c)=3/4
        policy.logits[1].copy_(torch.tensor([0.0, math.log(4)]))  # p(on)=1/5, p(off)=4/5
    counts = {}
    for i in range(4000):
        s = policy.sample("q", seed=i)
        key = (s.choice.decisions["choice:a"], s.choice.decisions["node:d"] if "node:d" in s.choice.logprobs else "-")
        counts[key] = counts.get(key, 0) + 1
        expect = {("b", "on"): math.log(1 / 4) + math.log(1 / 5), ("b", "off"): math.log(1 / 4) + math.log(4 / 5),
                  ("c", "-"): math.log(3 / 4)}[key]
        assert s.choice.logprob == pytest.approx(expect, abs=1e-6)
        names, lp, _ = policy.log_probs("q", s.choice)  # recomputed with gradient: the same numbers
        assert lp.sum().item() == pytest.approx(expect, abs=1e-6) and names == list(s.choice.logprobs)
    assert set(counts) == {("b", "on"), ("b", "off"), ("c", "-")}  # never x; d decided only on the b branch
    assert counts[("c", "-")] / 4000 == pytest.approx(0.75, abs=0.03)
    assert counts[("b", "off")] / 4000 == pytest.approx(0.2, abs=0.03)
    greedy = policy.sample("q", greedy=True)
    assert greedy.choice.decisions["choice:a"] == "c" and greedy.choice.mode == "greedy"


def test_log_prob_gradients_are_finite_with_masked_options():
    policy = TopologyPolicy(DecisionSpace(_hand_graph()), "query")
    s = policy.sample("q", seed=3)
    _, lp, ent = policy.log_probs("q", s.choice)
    (lp.sum() + ent.sum()).backward()
    grads = [p.grad for p in policy.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    assert policy.head.weight.grad.abs().sum() > 0  # the query head gets a gradient


def test_topology_section_is_validated_with_located_errors(tmp_path):
    text = (ROOT / "graphs/router.yaml").read_text()
    cases = {
        "planner: [calc, search, python, generator]": ("planner: [calc, nowhere]", "not a successor"),
        "  condition: query": ("  condition: query\n  nodes: [generator]", "exit"),
        "  choices:": ("  edges: [{source: calc, target: verifier}]\n  choices:", "already decided"),
    }
    for old, (new, words) in cases.items():
        bad = tmp_path / "bad.yaml"
        bad.write_text(text.replace(old, new))
        with pytest.raises(SpecError) as err:
            compile_spec(load_spec(bad), str(bad))
        assert words in str(err.value) and "bad.yaml:" in str(err.value) and "topology" in str(err.value)


def test_no_valid_combination_is_refused():
    # every combination keeps the un-merged fan-in at d (a slot changes no structure)
    with pytest.raises(SpecError, match="no combination"):
        _builder("dead", ["a", "b", "c", "d"], [("a", "b"), ("a", "c"), ("b", "d"), ("c", "d")]).set(
            topology={"slots": {"a": ["direct", "generator"]}}).compile()


def test_whole_graph_problems_no_decision_fixes_are_still_reported():
    # an orphan node, or an exit further than max_steps on every route: wrong whatever the decisions
    with pytest.raises(SpecError, match="not reachable"):
        _builder("orphan", ["a", "b", "z", "c"], [("a", "b"), ("b", "c"), ("a", "c")]).set(
            topology={"edges": [{"source": "a", "target": "b"}]}).compile()
    with pytest.raises(SpecError, match="max_steps"):
        _builder("far", ["a", "b", "x", "c"], [("a", "b"), ("b", "c"), ("a", "x")]).set(
            limits={"max_steps": 2}, topology={"choices": {"a": ["b", "x"]}}).compile()


def test_a_decision_that_can_take_one_value_is_refused():
    # b is the only way to the exit: it can never be left out
    with pytest.raises(SpecError, match=r"can only ever be 'on'"):
        _builder("only", ["a", "b", "c"], [("a", "b"), ("b", "c")]).set(
            topology={"nodes": ["b"], "slots": {"a": ["direct", "generator"]}}).compile()


def test_decisions_after_the_exit_and_clashing_names_are_refused():
    with pytest.raises(SpecError, match="is the exit"):
        _builder("x", ["a", "e", "b", "c"], [("a", "e"), ("e", "b"), ("e", "c")]).set(
            exit="e", topology={"choices": {"e": ["b", "c"]}}).compile()
    with pytest.raises(SpecError, match="share the name"):
        _builder("clash", ["a", "a->b", "b->c", "c"],
                 [("a", "a->b"), ("a", "b->c"), ("a->b", "c"), ("b->c", "c")], merge={"c"}).set(
            topology={"edges": [{"source": "a", "target": "b->c"}, {"source": "a->b", "target": "c"}]}).compile()


def test_saved_policies_are_checked_when_loaded(tmp_path):
    from masgraph.errors import MasgraphError
    from masgraph.topology.policy import load_policy

    graph = compile_spec(load_spec(ROOT / "graphs/router.yaml"))
    hrpo = HRPO(TopologyPolicy(DecisionSpace(graph), "query"), HRPOConfig())
    ck = tmp_path / "ck"
    ck.mkdir()
    torch.save(hrpo.state_dict(), ck / "topology.pt")
    assert load_policy(graph, ck).signature() == hrpo.policy.signature()
    edited = load_spec(ROOT / "graphs/router.yaml")  # the same shapes, options reordered: refused, not misread
    edited.topology.choices["planner"] = ["generator", "calc", "search", "python"]
    with pytest.raises(MasgraphError, match="trained on topology decisions"):
        load_policy(compile_spec(edited), ck)
    bad = hrpo.state_dict()
    bad["policy"] = {k: torch.full_like(v, float("nan")) for k, v in bad["policy"].items()}
    torch.save(bad, ck / "topology.pt")
    with pytest.raises(MasgraphError, match="not finite"):
        load_policy(graph, ck)
    torch.save({**hrpo.state_dict(), "version": "abc"}, ck / "topology.pt")
    with pytest.raises(MasgraphError, match="not a step count"):
        load_policy(graph, ck)


def test_log_probs_refuse_decisions_from_elsewhere():
    from masgraph.errors import MasgraphError
    from masgraph.trace import TopologyChoice

    policy = TopologyPolicy(DecisionSpace(_hand_graph()))
    with pytest.raises(MasgraphError, match="no such option"):
        policy.log_probs("q", TopologyChoice(decisions={"choice:a": "zz", "node:d": "on"}))
    with pytest.raises(MasgraphError, match="not a valid graph"):
        policy.log_probs("q", TopologyChoice(decisions={"choice:a": "x", "node:d": "on"}))
    assert policy.sample("\ud800 odd query", seed=1).choice.logprob <= 0  # a lone surrogate still samples


def test_a_route_left_without_its_edge_is_masked():
    b = GraphBuilder("loop").add_policy("p", backend="scripted")
    b.add_node("gen", role="generator", policy="p").add_node("ver", role="verifier", policy="p")
    b.add_node("out", role="generator", policy="p")
    b.add_edge("gen", "ver").add_edge("ver", "gen", when="continue").add_edge("ver", "out", when="stop")
    b.set(entry="gen", exit="out", limits={"max_turns": 2}, topology={"edges": [{"source": "ver", "target": "gen"}]})
    space = DecisionSpace(Graph(b.spec()))
    assert space.allowed(()) == [True, False]  # with its `continue` edge off, the verifier could stop dead
    with pytest.raises(SpecError, match="can only ever be 'on'"):  # so compiling refuses the useless gate
        b.compile()


@register_agent("toy-pass")
async def _toy_pass(ctx) -> NodeOutput:
    return NodeOutput(text=ctx.query)


@register_agent("toy-good")
async def _toy_good(ctx) -> NodeOutput:
    return NodeOutput(text="good")


@register_agent("toy-bad")
async def _toy_bad(ctx) -> NodeOutput:
    return NodeOutput(text="bad")


def _two_arm():
    b = GraphBuilder("arms")
    b.add_node("start", role="custom", agent="toy-pass").add_node("good", role="custom", agent="toy-good")
    b.add_node("bad", role="custom", agent="toy-bad").add_node("end", role="custom", agent="toy-pass", merge="first")
    b.add_edge("start", "good").add_edge("start", "bad").add_edge("good", "end").add_edge("bad", "end")
    return b.set(entry="start", exit="end", topology={"choices": {"start": ["good", "bad"]}}).compile()


def _train_two_arm(baseline: str, steps: int, seed: int = 0) -> tuple[list[float], Trace]:
    graph = _two_arm()
    engine = Engine(graph)
    policy = TopologyPolicy(DecisionSpace(graph))
    from masgraph.trainers.config import ReinforceConfig
    from masgraph.trainers.reinforce import Reinforce

    hrpo = (HRPO(policy, HRPOConfig(group_size=8, lr=0.1)) if baseline == "group"
            else Reinforce(policy, ReinforceConfig(group_size=8, lr=0.1)))
    history, last = [], None

    async def step(k: int) -> list[list[Trace]]:
        groups = []
        for q in range(2):
            samples = [policy.sample(f"query {q}", seed=seed * 10_000 + k * 100 + q * 10 + g) for g in range(8)]
            traces = await asyncio.gather(*(engine.episode(f"query {q}", topology=s.topology, choice=s.choice)
                                            for s in samples))
            for t in traces:
                t.reward = float(any(st.node == "good" for st in t.steps))
            groups.append(list(traces))
        return groups

    for k in range(steps):
        groups = asyncio.run(step(k))
        last = groups[0][0]
        hrpo.update(groups)
        history.append(policy.probabilities()["choice:start"]["good"])
    return history, last


def test_hrpo_learns_the_rewarded_arm():
    history, trace = _train_two_arm("group", steps=25)
    assert history[-1] > 0.9, history
    first = next(i for i, p in enumerate(history) if p > 0.9)
    assert first < 25
    # the trace records the decisions, their log-probs and the policy version that sampled them
    assert trace.topology is not None and set(trace.topology.decisions) == {"choice:start"}
    assert trace.topology.version == 24 and trace.topology.logprob < 0
    assert Trace.model_validate_json(trace.model_dump_json()).topology == trace.topology
    assert _train_two_arm("group", steps=25)[0] == history  # deterministic


def test_gptswarm_reinforce_learns_the_rewarded_arm_too():
    history, _ = _train_two_arm("moving_average", steps=40)
    assert history[-1] > 0.9, history


def test_hrpo_state_dict_round_trips():
    graph = _two_arm()
    a = HRPO(TopologyPolicy(DecisionSpace(graph)), HRPOConfig())
    with torch.no_grad():
        a.policy.logits[0].add_(torch.tensor([0.3, -0.1]))
    a.policy.version = 7
    b = HRPO(TopologyPolicy(DecisionSpace(graph)), HRPOConfig())
    b.load_state_dict(a.state_dict())
    assert torch.equal(b.policy.logits[0], a.policy.logits[0]) and b.policy.version == 7


def test_a_moving_average_hrpo_checkpoint_resumes_as_reinforce():
    """A checkpoint written by HRPO with the former `baseline: moving_average` (HRPO's state with the baseline in
    it) loads into `algorithm: reinforce`, which writes the same layout, baseline included."""
    from masgraph.trainers.config import ReinforceConfig
    from masgraph.trainers.reinforce import Reinforce

    graph = _two_arm()
    a = HRPO(TopologyPolicy(DecisionSpace(graph)), HRPOConfig())
    with torch.no_grad():
        a.policy.logits[0].add_(torch.tensor([0.3, -0.1]))
    a.policy.version = 7
    old = a.state_dict() | {"baseline": 0.25}
    b = Reinforce(TopologyPolicy(DecisionSpace(graph)), ReinforceConfig())
    b.load_state_dict(old)
    assert torch.equal(b.policy.logits[0], a.policy.logits[0]) and b.policy.version == 7 and b.baseline == 0.25
    assert set(b.state_dict()) == set(old) and b.state_file == a.state_file


def test_a_supergraph_never_runs_whole(scripted, runner_for, run):
    from masgraph.tasks import BasicArithmetic

    graph = _two_arm()
    trace = asyncio.run(Engine(graph).episode("q"))  # no topology given: refused, not run whole
    assert trace.status == "error" and "topology" in trace.error
    result = run(runner_for(graph, scripted, n=3).run_task(BasicArithmetic()))  # a Runner samples the prior
    assert all(t.status == "ok" and t.topology is not None for t in result.traces)


def test_a_slot_gives_the_node_one_prompt_out_of_a_pool():
    from masgraph.backends.scripted import ScriptedBackend

    b = GraphBuilder("slot").add_policy("p", backend="scripted")
    b.add_node("answer", role="generator", policy="p")
    graph = b.set(entry="answer", exit="answer", topology={"slots": {"answer": ["direct", "generator"]}}).compile()
    space = DecisionSpace(graph)
    assert [(d.name, d.options) for d in space.decisions] == [("slot:answer", ("direct", "generator"))]
    backend = ScriptedBackend(default="42")
    engine = Engine(graph, backends={"scripted": backend})
    seen = {}
    for config in ((0,), (1,)):
        top = space.topology(config)
        assert top.prompts == (("answer", ("direct", "generator")[config[0]]),)
        trace = asyncio.run(engine.episode("What is 6 * 7?", topology=top))
        assert trace.status == "ok" and trace.meta["topology"]["prompts"] == dict(top.prompts)
        seen[config] = backend.requests[-1].messages
    assert seen[(0,)] != seen[(1,)]  # the model saw each slot's own template
    policy = TopologyPolicy(space)
    assert {policy.sample("q", seed=i).choice.decisions["slot:answer"] for i in range(40)} == {"direct", "generator"}


def test_a_slot_prompt_must_exist():
    b = GraphBuilder("slot").add_policy("p", backend="scripted").add_node("answer", role="generator", policy="p")
    with pytest.raises(SpecError, match="topology.slots.answer.*nope"):
        b.set(entry="answer", exit="answer", topology={"slots": {"answer": ["direct", "nope"]}}).compile()


def test_hrpo_clip_acts_from_the_second_epoch():
    graph = _two_arm()
    engine = Engine(graph)
    policy = TopologyPolicy(DecisionSpace(graph))
    samples = [policy.sample("q", seed=g) for g in range(8)]

    async def rollouts():
        return await asyncio.gather(*(engine.episode("q", topology=s.topology, choice=s.choice) for s in samples))

    traces = asyncio.run(rollouts())
    for t in traces:
        t.reward = float(any(st.node == "good" for st in t.steps))
    one = HRPO(TopologyPolicy(DecisionSpace(graph)), HRPOConfig(lr=0.5, ppo_epochs=1)).update([list(traces)])
    three = HRPO(TopologyPolicy(DecisionSpace(graph)), HRPOConfig(lr=0.5, ppo_epochs=3)).update([list(traces)])
    assert one["topology/clip_frac"] == 0.0 and one["topology/kl/old_k1"] == 0.0  # the first pass: ratio 1
    assert three["topology/clip_frac"] > 0.0  # stats of the last pass: the policy moved past the clip range


def test_topology_metrics_per_query_type():
    from masgraph.trainers.loop import topology_metrics

    policy = TopologyPolicy(DecisionSpace(compile_spec(load_spec(ROOT / "graphs/router.yaml"))), "query")
    _perturb(policy, random.Random(2))
    traces = [Trace(episode_id=f"e{i}", item_id=f"i{i}", query=q, meta={"type": kind})
              for i, (q, kind) in enumerate([("Calculate 2 + 3.", "math"), ("Calculate 9 * 9.", "math"),
                                              ("Where is Brabraport?", "lookup")])]
    m = topology_metrics(policy, traces)
    lookup = policy.probabilities("Where is Brabraport?")["choice:planner"]["search"]
    assert m["topology/type/lookup/choice:planner/search"] == pytest.approx(lookup)
    math_mean = sum(policy.probabilities(t.query)["choice:planner"]["calc"] for t in traces[:2]) / 2
    assert m["topology/type/math/choice:planner/calc"] == pytest.approx(math_mean)
    overall = sum(policy.probabilities(t.query)["choice:planner"]["calc"] for t in traces) / 3
    assert m["topology/p/choice:planner/calc"] == pytest.approx(overall)


def test_no_decision_is_made_about_a_node_that_ends_up_cut_off():
    """Decisions come in topological order, so one that cuts a node off comes before that node's own decision
    (the gate on r is 3 edges from the entry, the choice at c only 1 by the shortest path, yet c is after r)."""
    graph = compile_spec(_order_spec())
    space = DecisionSpace(graph)
    assert [d.name for d in space.decisions] == ["edge:a->c", "node:r", "choice:c"]
    policy = TopologyPolicy(space)
    cut = 0
    for i in range(400):
        s = policy.sample("q", seed=i)
        ran = set(graph.view(s.topology).out_edges)
        cut += "c" not in ran
        assert ("choice:c" in s.choice.logprobs) == ("c" in ran)
    assert cut > 50


def _order_spec():
    b = GraphBuilder("order").add_policy("p", backend="scripted")
    for n in ["a", "c", "p", "q", "r", "x", "y", "e"]:
        b.add_node(n, role="generator", policy="p", **({"merge": "concat"} if n in "ce" else {}))
    for s, t in [("a", "c"), ("a", "p"), ("p", "q"), ("q", "r"), ("r", "c"), ("c", "x"), ("c", "y"), ("x", "e"),
                 ("y", "e"), ("a", "e")]:
        b.add_edge(s, t)
    return b.set(entry="a", exit="e", topology={"nodes": ["r"], "edges": [{"source": "a", "target": "c"}],
                                               "choices": {"c": ["x", "y"]}}).spec()


def test_progress_line_shows_the_most_likely_option_of_each_decision():
    import io

    from masgraph.cli import TrainProgress
    from masgraph.events import TrainStep

    out = io.StringIO()
    TrainProgress(3, out, algorithm="hrpo").emit(TrainStep(step=1, metrics={
        "topology/reward": 0.75, "topology/loss": 0.1, "topology/p/choice:start/solve": 0.7,
        "topology/p/choice:start/harm": 0.3, "tokens_per_s": 3.0, "time/train_s": 60.0}))
    line = out.getvalue()
    assert "reward 0.750" in line and "topology start=solve 0.70" in line and "kl" not in line


def test_action_reward_hand_computed():
    from masgraph.trace import LLMCall, Step
    from masgraph.trainers.hrpo import action_reward

    def step(i: int, node: str, tokens: int, parse_error: str | None = None) -> Step:
        call = LLMCall(policy="p", prompt_ids=[1], completion_ids=[7] * tokens, logprobs=[0.0] * tokens, text="t")
        return Step(episode_id="e", index=i, node=node, role="custom", turn=1, llm=[call], parse_error=parse_error)

    trace = Trace(episode_id="e", item_id="i", query="q", unused_steps=[1, 3],
                  steps=[step(0, "x", 10), step(1, "x", 20, "bad"), step(2, "y", 40), step(3, "y", 5)])
    # x: 30 tokens, one parse failure, one unused step; y: 45 tokens, one unused step
    assert action_reward(trace, {"x"}, 2.0, 0.5, 0.25) == pytest.approx(-2.0 * 30 / 1000 - 0.5 - 0.25)
    assert action_reward(trace, {"y"}, 2.0, 0.5, 0.25) == pytest.approx(-2.0 * 45 / 1000 - 0.25)
    assert action_reward(trace, {"x", "y"}, 1.0, 0.0, 1.0) == pytest.approx(-75 / 1000 - 2.0)
