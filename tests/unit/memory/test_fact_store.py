"""A memory that a policy edits (issue 27, Memory-R1): the operation parser, the fact store, the memory node's
fact-store modes on a scripted policy, the `memory_updates` task, and step credit per manager call."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from masgraph.agents.memory import split_stream
from masgraph.graph import compile_spec
from masgraph.loader import load_spec
from masgraph.memory.store import FactStore, parse_op
from masgraph.rundir.store import read_traces
from masgraph.spec import GraphSpec
from masgraph.tasks import Item, Task, get_task, load_kb
from masgraph.trace import LLMCall, Step, Trace
from masgraph.trainers.credit import anchor_groups, call_failures, step_advantages, step_format_advantages
from masgraph.trainers.flow_grpo import FlowGRPOConfig, build_rows

FACT = "Kalo Mira moved to Sadport."


@pytest.mark.parametrize(("output", "op", "target", "text"), [
    ("ADD", "ADD", None, FACT),
    ("Operation: add", "ADD", None, FACT),
    ("  Operation: UPDATE 2\nmore text", "UPDATE", 2, FACT),
    ("UPDATE [3]: Kalo Mira lives in Sadport.", "UPDATE", 3, "Kalo Mira lives in Sadport."),
    ("UPDATE", "UPDATE", None, FACT),
    ("DELETE 1", "DELETE", 1, None),
    ("NOOP", "NOOP", None, None),
    ("ADD: Kalo lives in Sadport", "ADD", None, "Kalo lives in Sadport"),
])
def test_parse_op(output, op, target, text):
    got = parse_op(output, FACT)
    assert (got.op, got.target, got.text, got.fact, got.output) == (op, target, text, FACT, output)


@pytest.mark.parametrize("output", ["", "Answer: Sadport", "ADDED it", "I would UPDATE 1", "\n\n"])
def test_parse_op_refuses_outputs_without_an_operation(output):
    with pytest.raises(ValueError, match="no operation"):
        parse_op(output, FACT)


def test_store_applies_operations_and_never_reuses_numbers():
    s = FactStore()
    assert s.render() == "(empty)"
    a = s.apply(parse_op("ADD", "Kalo Mira lives in Rafeport."))
    b = s.apply(parse_op("ADD", "Tomo Rii lives in Velport."))
    assert (a.target, b.target) == (1, 2)
    up = s.apply(parse_op("UPDATE", FACT))  # no number: the entry sharing most words with the fact (Kalo Mira's)
    assert (up.op, up.target, up.error) == ("UPDATE", 1, None)
    s.apply(parse_op("DELETE 2", "Tomo Rii left."))
    c = s.apply(parse_op("ADD", "Ena Sul lives in Rockford."))
    assert c.target == 3  # 2 was deleted; its number is not given out again
    assert s.render() == "[1] Kalo Mira moved to Sadport.\n[3] Ena Sul lives in Rockford."
    assert s.apply(parse_op("NOOP", "It rained.")).target is None and len(s.entries) == 2


def test_an_operation_on_a_missing_entry_adds_the_fact_and_says_so():
    s = FactStore()
    op = s.apply(parse_op("UPDATE", FACT))  # empty store: nothing to update
    assert (op.op, op.target, op.text) == ("ADD", 1, FACT) and "memory is empty" in op.error
    op = s.apply(parse_op("DELETE 7", "Tomo Rii left."))
    assert (op.op, op.target) == ("ADD", 2) and "no entry 7" in op.error
    assert s.render() == f"[1] {FACT}\n[2] Tomo Rii left."


def test_closest_prefers_shared_words_then_the_newer_entry():
    s = FactStore({1: "Kalo Mira lives in Rafeport.", 2: "Tomo Rii lives in Velport.", 3: "Kalo Mira visited Ashmere."})
    assert s.closest("Tomo Rii moved to Orrinford.") == 2
    assert s.closest("Kalo Mira moved to Orrinford.") == 3  # ties with 1: the newer
    assert s.closest("It rained.") == 3  # no shared word: the newest
    assert FactStore().closest("x") is None


def test_recall_keeps_the_entries_most_like_the_question_in_store_order():
    s = FactStore({1: "Kalo Mira lives in Rafeport.", 2: "It rained all afternoon.", 3: "Tomo Rii lives in Velport.",
                   4: "Kalo Mira visited Ashmere last week.", 5: "Kalo Mira moved to Orrinford."}, next_id=6)
    got = s.recall("In which city does Kalo Mira live now?", 2)
    assert got.render() == "[4] Kalo Mira visited Ashmere last week.\n[5] Kalo Mira moved to Orrinford."
    assert s.recall("Where is Nobody Here?", 2).render() == "(empty)"  # no shared word: nothing recalled
    assert s.recall("Tomo Rii?", 5).entries == {3: "Tomo Rii lives in Velport."}


def test_trim_keeps_the_newest():
    s = FactStore({1: "a", 2: "b", 5: "c"}, next_id=6)
    s.trim(2)
    assert s.entries == {2: "b", 5: "c"}


def test_split_stream():
    assert split_stream("a.\n\n b. \nQuestion: where?") == (["a.", "b."], "where?")
    assert split_stream("Where does X live?") == ([], "Where does X live?")
    assert split_stream("  \n") == ([], "")


# ---- the memory node on a scripted policy -------------------------------------------------------------------

STREAM = ("Kalo Mira lives in Rafeport.\nIt rained all afternoon.\nTomo Rii lives in Velport.\n"
          "Kalo Mira visited Ashmere last week.\nKalo Mira moved to Orrinford.\n"
          "Question: In which city does Kalo Mira live now?")


class OneStream(Task):
    name = "one-stream"

    def generate(self, split, n, seed):
        return [Item(f"{split}-{i}", STREAM, "Orrinford", {"others": ["Rafeport", "Velport", "Ashmere"]})
                for i in range(n)]

    def score(self, item, answer):
        return get_task("memory_updates").score(item, answer)


def memory_graph(root, mode: str, **node) -> object:
    spec = load_spec(root / "graphs" / "memory.yaml")
    policies = {k: p.model_copy(update={"backend": "scripted"}) for k, p in spec.policies.items()}
    mem = spec.nodes["memory"].model_copy(update={"mode": mode, **node})
    return compile_spec(spec.model_copy(update={"policies": policies, "nodes": {**spec.nodes, "memory": mem},
                                               "train": None}))


def manager_replies(req):
    """A scripted manager that knows the task: homes added, moves update, the rest skipped; the reader answers with
    the last city it is shown."""
    if req.key[1] == "generator":
        shown = req.messages[-1]["content"]
        return "Answer: " + shown.split("Question:")[0].rstrip().rsplit(" ", 1)[-1].rstrip(".")
    fact = req.messages[-1]["content"].rsplit("New fact: ", 1)[1]
    return "Operation: ADD" if " lives in " in fact else "Operation: UPDATE" if " moved " in fact else "NOOP"


@pytest.mark.parametrize(("mode", "node", "shown", "correct"), [
    ("manager", {"recall": 2}, "[1] Kalo Mira moved to Orrinford.", True),
    ("append", {"recall": 2}, "[4] Kalo Mira visited Ashmere last week.\n[5] Kalo Mira moved to Orrinford.",
     True),
    ("append", {"recall": None}, "[1] Kalo Mira lives in Rafeport.\n[2] It rained all afternoon.\n"
     "[3] Tomo Rii lives in Velport.\n[4] Kalo Mira visited Ashmere last week.\n[5] Kalo Mira moved to Orrinford.",
     True),
    ("last_k", {"keep": 2, "recall": None}, "[4] Kalo Mira visited Ashmere last week.\n[5] Kalo Mira moved to "
     "Orrinford.", True),
    ("last_k", {"keep": 1, "recall": 2}, "[5] Kalo Mira moved to Orrinford.", True),
])
def test_memory_node_modes_build_the_store_the_reader_sees(root, scripted, runner_for, run, mode, node, shown, correct):
    backend = scripted({"memory": manager_replies, "generator": manager_replies})
    result = run(runner_for(memory_graph(root, mode, **node), backend, n=1).run_task(OneStream()))
    [trace] = result.traces
    mem = trace.steps[0]
    assert mem.text == f"Memory:\n{shown}\nQuestion: In which city does Kalo Mira live now?"
    assert [op.op for op in mem.memory_ops] == (["ADD", "NOOP", "ADD", "NOOP", "UPDATE"] if mode == "manager"
                                                else ["ADD"] * 5)
    assert len(mem.llm) == (5 if mode == "manager" else 0)  # one call per fact, only for the manager
    assert trace.reward == float(correct) and mem.parse_error is None


def test_manager_ops_are_inspectable_in_the_stored_trace(root, scripted, runner_for, run):
    backend = scripted({"memory": manager_replies, "generator": manager_replies})
    result = run(runner_for(memory_graph(root, "manager", recall=2), backend, n=1).run_task(OneStream()))
    [stored] = read_traces(result.run_dir)
    ops = stored.steps[0].memory_ops
    assert [(o.op, o.target, o.fact) for o in ops][-1] == ("UPDATE", 1, "Kalo Mira moved to Orrinford.")
    assert ops[0].output == "Operation: ADD"
    assert "memory_ops" not in stored.steps[1].model_dump(mode="json")  # the reader's step: left out when none


def test_unparseable_manager_output_adds_the_fact_and_is_a_parse_failure(root, scripted, runner_for, run):
    def replies(req):
        return "Answer: Orrinford" if req.key[1] == "generator" else "I think we should keep it"

    result = run(runner_for(memory_graph(root, "manager"), scripted({"memory": replies, "generator": replies}),
                            n=1).run_task(OneStream()))
    mem = result.traces[0].steps[0]
    assert [op.op for op in mem.memory_ops] == ["ADD"] * 5 and all("no operation" in op.error for op in mem.memory_ops)
    assert mem.parse_error.startswith("5 of 5 outputs had no operation")
    assert result.traces[0].status == "ok"  # the episode goes on with every fact kept
    assert all(c.parse_error and "no operation" in c.parse_error for c in mem.llm)  # each call says so


def test_each_manager_call_records_its_own_format_failure(root, scripted, runner_for, run):
    """Only the calls whose output had no operation are marked; the step's flag says some did. The marks travel in
    the stored trace and are left out of it where a call parsed."""
    def replies(req):
        if req.key[1] == "generator":
            return "Answer: Orrinford"
        fact = req.messages[-1]["content"].rsplit("New fact: ", 1)[1]
        return "hmm" if "rained" in fact or "visited" in fact else "Operation: ADD"

    result = run(runner_for(memory_graph(root, "manager"), scripted({"memory": replies, "generator": replies}),
                            n=1).run_task(OneStream()))
    mem = result.traces[0].steps[0]
    assert [c.parse_error is not None for c in mem.llm] == [False, True, False, True, False]
    assert mem.parse_error.startswith("2 of 5 outputs had no operation")
    assert call_failures(mem) == [False, True, False, True, False]
    [stored] = read_traces(result.run_dir)
    dumped = [c.model_dump(mode="json") for c in stored.steps[0].llm]
    assert ["parse_error" in c for c in dumped] == [False, True, False, True, False]
    assert stored.steps[1].llm[0].parse_error is None  # the reader's one call: no flag of its own


def test_a_manager_needs_a_policy_and_modes_are_checked(root):
    raw = load_spec(root / "graphs" / "memory.yaml").model_dump(mode="json", exclude_none=True)
    raw["nodes"]["memory"].pop("policy")
    with pytest.raises(ValidationError, match=r"nodes.memory: a memory with mode: manager needs `policy:`"):
        GraphSpec.model_validate(raw)
    raw["nodes"]["memory"]["mode"] = "append"
    GraphSpec.model_validate(raw)  # a rule needs none
    raw["nodes"]["memory"]["mode"] = "forgetful"
    with pytest.raises(ValidationError, match="mode"):
        GraphSpec.model_validate(raw)


# ---- the task ---------------------------------------------------------------------------------------------

def test_memory_updates_holds_people_out_and_scores_the_current_city_only():
    task = get_task("memory_updates")
    people = {p["name"]: i for i, p in enumerate(load_kb()["people"])}

    def named(items):
        return {line.split(" lives in ")[0] for it in items for line in it.question.splitlines()
                if " lives in " in line}

    train, test = named(task.items("train", 80, 0)), named(task.items("test", 80, 0))
    assert train and test and not train & test
    assert all(people[n] % 5 == 0 for n in test) and all(people[n] % 5 for n in train)
    items = task.items("test", 30, 1)
    assert items == task.items("test", 30, 1) and items != task.items("test", 30, 2)
    assert {it.meta["type"] for it in items} == {"moved", "stayed"}
    for it in items:
        *facts, question = it.question.splitlines()
        assert question.startswith("Question: In which city does ") and len(facts) >= 6
        name = question.removeprefix("Question: In which city does ").removesuffix(" live now?")
        moves = [f for f in facts if f.startswith(f"{name} moved to ")]
        assert it.answer == (moves[-1].removeprefix(f"{name} moved to ").rstrip(".") if moves
                             else next(f for f in facts if f.startswith(f"{name} lives in ")).split(" in ")[1][:-1])
        assert task.score(it, f"Answer: {it.answer}") == 1.0
        assert task.score(it, f"{it.answer} or {it.meta['others'][0]}") == 0.0  # naming a second city is wrong
        assert task.score(it, it.meta["others"][-1]) == 0.0


# ---- step credit per call -----------------------------------------------------------------------------------

def _manager_step(prompts: list[list[int]]) -> Step:
    calls = [LLMCall(policy="m", adapter="memory", prompt_ids=p, completion_ids=[9], logprobs=[-0.5], text="x",
                     temperature=1.0) for p in prompts]
    return Step(episode_id="e", index=0, node="memory", role="memory", turn=1, llm=calls)


def test_format_is_credited_per_manager_call():
    """Two trajectories of one query with the same reward (no outcome signal); trajectory 0's second of three
    manager calls had no operation. Per call, the failures over the six calls are [0, 1, 0, 0, 0, 0]: rewards
    [0, -1, 0, 0, 0, 0], mean -1/6, unbiased std sqrt((5 (1/6)^2 + (5/6)^2) / 5) = sqrt(1/6) = 0.408248, so the
    failed call gets (-1 + 1/6) / 0.408248 = -2.041241 and every other +0.408248. Step-level, both of trajectory 0's
    other calls would have been pushed down with it (its step failed): [1, 1, 1, 0, 0, 0] -> -+0.912871."""
    traces = [Trace(episode_id=f"t{i}", item_id="q", query="q", reward=1.0,
                    steps=[_manager_step([[1], [1, 2], [1, 2, 3]])]) for i in range(2)]
    traces[0].steps[0].llm[1].parse_error = "no operation"
    traces[0].steps[0].parse_error = "1 of 3 outputs had no operation"
    fmt = step_format_advantages(traces, {("q",): [0, 1]}, {"memory"}, eps=0.0)
    assert [fmt[(i, 0, k)] for i in range(2) for k in range(3)] == pytest.approx(
        [0.408248, -2.041241, 0.408248, 0.408248, 0.408248, 0.408248], abs=1e-6)
    rows = build_rows(traces, {"memory": "memory"}, FlowGRPOConfig(credit={"adv_eps": 0.0, "format_weight": 0.5}))
    assert [(r.traj, r.call, round(r.advantage, 4)) for r in rows] == [
        (0, 0, 0.2041), (0, 1, -1.0206), (0, 2, 0.2041), (1, 0, 0.2041), (1, 1, 0.2041), (1, 2, 0.2041)]
    # a node that flags no call of its own: the step's failure is every call's
    traces[0].steps[0].llm[1].parse_error = None
    assert call_failures(traces[0].steps[0]) == [True, True, True]
    fmt = step_format_advantages(traces, {("q",): [0, 1]}, {"memory"}, eps=0.0)
    assert [fmt[(i, 0, k)] for i in range(2) for k in range(3)] == pytest.approx(
        [-0.912871, -0.912871, -0.912871, 0.912871, 0.912871, 0.912871], abs=1e-6)


def test_each_manager_call_is_its_own_anchor_state():
    # 3 trajectories of one query: every first call sees [1]; the second sees [1,2] (after the same first op) in
    # trajectories 0 and 1 and [1,3] in 2. Rewards 1, 0, 1.
    traces = [Trace(episode_id=f"t{i}", item_id="q", query="q", reward=r, steps=[_manager_step([[1], second])])
              for i, (r, second) in enumerate([(1.0, [1, 2]), (0.0, [1, 2]), (1.0, [1, 3])])]
    groups = anchor_groups(traces, {("q",): [0, 1, 2]}, {"memory"})
    assert sorted(groups.values()) == [[(0, 0, 0), (1, 0, 0), (2, 0, 0)], [(0, 0, 1), (1, 0, 1)], [(2, 0, 1)]]
    adv = step_advantages(traces, {0: 1.0, 1: 0.0, 2: 1.0}, {("q",): [0, 1, 2]}, {"memory"}, eps=0.0)
    # first calls: [1, 0, 1], mean 2/3, unbiased std 0.57735 -> [0.57735, -1.1547, 0.57735]
    assert [adv[(i, 0, 0)] for i in range(3)] == pytest.approx([0.57735027, -1.15470054, 0.57735027])
    # second calls: [1, 0] in state [1,2] -> +-0.70711; trajectory 2's alone -> 0
    assert [adv[(i, 0, 1)] for i in range(3)] == pytest.approx([0.70710678, -0.70710678, 0.0])
    rows = build_rows(traces, {"memory": "memory"}, FlowGRPOConfig(credit={"adv_eps": 0.0, "advantage": "step"}))
    assert {(r.traj, tuple(r.prompt_ids)): round(r.advantage, 4) for r in rows} == {
        (0, (1,)): 0.5774, (1, (1,)): -1.1547, (2, (1,)): 0.5774, (0, (1, 2)): 0.7071, (1, (1, 2)): -0.7071}
