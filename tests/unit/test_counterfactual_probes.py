"""Counterfactual credit on probe questions (`counterfactual_probes`, `Task.probes`): a decision about a person the
item does not ask about is scored on a question about that person too. The probes of `memory_updates`, the pure
parts (`as_made`, `asked`, the call's own score), and hand-computed scores on a scripted memory graph."""

from __future__ import annotations

import pytest

from masgraph.counterfactual import META, as_made, asked
from masgraph.errors import SpecError
from masgraph.scheduler import EpisodeInput
from masgraph.tasks import Item, MemoryUpdates, Task, get_task
from masgraph.trace import LLMCall, Step, Trace
from masgraph.trainers.credit import counterfactual_advantages, counterfactual_values
from masgraph.trainers.flow_grpo import FlowGRPOConfig, build_rows

ADD_NOOP = {"memory": ["Operation: ADD", "Operation: NOOP"]}
# the item asks about Kalo Mira; Tomo Rii's visit is what a store of every fact gets wrong about Tomo Rii
STREAM = ("Kalo Mira lives in Rafeport.\nTomo Rii lives in Velport.\nTomo Rii visited Ashmere last week.\n"
          "Question: In which city does Kalo Mira live now?")


class AskAboutKalo(Task):
    name = "ask-about-kalo"

    def generate(self, split, n, seed):
        return [Item(f"{split}-{i}", STREAM, "Rafeport", {"others": ["Velport", "Ashmere"]}) for i in range(n)]

    def score(self, item, answer):
        return get_task("memory_updates").score(item, answer)

    def probes(self, item):
        return MemoryUpdates().probes(item)


def test_memory_updates_probes_ask_where_each_other_person_lives_now():
    stream = ("Kalo Mira lives in Rafeport.\nIt rained all afternoon.\nTomo Rii lives in Velport.\n"
              "Kalo Mira moved to Orrinford.\nVela Dorn lives in Ashmere.\nVela Dorn visited Brightwater last week.\n"
              "Question: In which city does Tomo Rii live now?")
    task = MemoryUpdates()
    probes = task.probes(Item("x", stream, "Velport", {"others": []}))
    facts = stream.splitlines()[:-1]
    assert [(p.question.splitlines()[:-1], p.question.splitlines()[-1], p.answer) for p in probes] == [
        (facts, "Question: In which city does Kalo Mira live now?", "Orrinford"),  # the move, not the home
        (facts, "Question: In which city does Vela Dorn live now?", "Ashmere")]  # the home, not the visit
    assert len({p.id for p in probes}) == 2 and all(p.id.startswith("x-probe-") for p in probes)
    assert probes[0].meta["others"] == ["Ashmere", "Brightwater", "Rafeport", "Velport"]
    # scored as the item is: the city, and no other city of the stream
    assert task.score(probes[0], "Orrinford") == 1.0 and task.score(probes[0], "Orrinford or Rafeport") == 0.0
    assert task.score(probes[1], "Brightwater") == 0.0
    # every generated item: one probe per other person, each answer among the stream's cities
    for item in task.items("train", 20, seed=3):
        got = task.probes(item)
        assert len(got) == MemoryUpdates.PEOPLE - 1 and all(p.answer in p.question for p in got)
        assert item.question.splitlines()[-1] not in {p.question.splitlines()[-1] for p in got}
    assert Task().probes(Item("y", "q", "a")) == []  # a task without probes


def _call(text: str) -> LLMCall:
    return LLMCall(policy="p", prompt_ids=[1], completion_ids=[2], logprobs=[-0.1], text=text)


def _trace(reward: float, texts: list[str], scored: list | None = None, status: str = "ok") -> Trace:
    steps = [Step(episode_id="e", index=0, node="memory", role="memory", turn=1, llm=[_call(t) for t in texts]),
             Step(episode_id="e", index=1, node="generator", role="generator", turn=1, llm=[_call("Answer: x")])]
    return Trace(episode_id="e", item_id="q", query="q", steps=steps, reward=reward, status=status,
                 meta={META: scored} if scored is not None else {})


def test_as_made_replays_the_record_unchanged_and_asked_swaps_the_question():
    trace = _trace(1.0, ["Operation: ADD", "Operation: NOOP"])
    [(step, ep)] = as_made(EpisodeInput("q", "q", 3, {"gold": "x"}), trace, ADD_NOOP)
    assert step == 0 and ep.sample == 3 and ep.meta[META] == {"root": "e", "step": 0}
    assert ep.replay == {("memory", 1, 0): trace.steps[0].llm[0], ("memory", 1, 1): trace.steps[0].llm[1]}
    again = asked(ep, "q-probe-1", "facts\nQuestion: where?", "Velport")
    assert (again.item_id, again.query, again.meta["gold"], again.replay) == (
        "q-probe-1", "facts\nQuestion: where?", "Velport", ep.replay)
    assert ep.query == "q" and ep.meta["gold"] == "x"  # the original is left alone
    assert as_made(EpisodeInput("q", "q"), _trace(1.0, ["ADD"], status="error"), ADD_NOOP) == []


def test_a_recorded_own_score_stands_in_for_the_episode_reward():
    alts = {"memory": ["A", "B"]}
    # call 0 wrote A: its own score is recorded (0.5, the mean over probes), B scored 1 -> 0.5 - 0.75
    # call 1 wrote A, no own score recorded: the episode's reward (0) -> 0 - mean(0, 1)
    # call 2 wrote "junk" (neither): own 0.25 recorded, A 0, B 1 -> 0.25 - 0.5
    scored = [[0, 0, "A", 0.5], [0, 0, "B", 1.0], [0, 1, "B", 1.0], [0, 2, " junk", 0.25], [0, 2, "A", 0.0],
              [0, 2, "B", 1.0]]
    trace = _trace(0.0, ["A", "A", "junk"], scored)
    assert counterfactual_values(trace, alts) == {(0, 0): [0.5, 1.0], (0, 1): [0.0, 1.0], (0, 2): [0.0, 1.0]}
    assert counterfactual_advantages([trace], alts) == pytest.approx(
        {(0, 0, 0): -0.25, (0, 0, 1): -0.5, (0, 0, 2): -0.25})


def _memory_graph(root):
    from masgraph.graph import compile_spec
    from masgraph.loader import load_spec

    spec = load_spec(root / "graphs" / "memory.yaml")
    policies = {k: p.model_copy(update={"backend": "scripted"}) for k, p in spec.policies.items()}
    return compile_spec(spec.model_copy(update={"policies": policies, "train": None}))


def _replies(req):
    """A manager collapsed to ADD; a reader that answers with the last city it is shown."""
    if req.key[1] == "generator":
        shown = req.messages[-1]["content"].split("Question:")[0].rstrip()
        return "Answer: " + shown.rsplit(" ", 1)[-1].rstrip(".")
    return "Operation: ADD"


@pytest.mark.parametrize("probes", [False, True])
def test_probes_give_the_visit_about_a_person_not_asked_its_score(root, scripted, runner_for, run, probes):
    """Kalo Mira is asked; the manager adds all three facts, and the reader answers Rafeport (right). Asked about
    Tomo Rii (the probe), it is shown Tomo's home and visit and answers the visit (wrong). Scores, mean over the
    item's question and the probe (hand-computed): as made (1 + 0) / 2 for every call; NOOP in place of
    Kalo's home: (0 + 0) / 2 (nothing shown about Kalo); of Tomo's home: (1 + 0) / 2 (the visit alone);
    of the visit: (1 + 1) / 2. Without probes only Kalo's home matters (1 vs 0)."""
    backend = scripted({"memory": _replies, "generator": _replies})
    runner = runner_for(_memory_graph(root), backend, n=1, samples=1, counterfactual=ADD_NOOP,
                        counterfactual_probes=probes)
    [trace] = run(runner.run_items(AskAboutKalo(), AskAboutKalo().items("train", 1))).traces
    assert trace.reward == 1.0 and [c.text for c in trace.steps[0].llm] == ["Operation: ADD"] * 3
    got = {(s, k, alt): score for s, k, alt, score in trace.meta[META]}
    if probes:
        assert got == {(0, 0, "Operation: NOOP"): 0.0, (0, 1, "Operation: NOOP"): 0.5, (0, 2, "Operation: NOOP"): 1.0,
                       (0, 0, "Operation: ADD"): 0.5, (0, 1, "Operation: ADD"): 0.5, (0, 2, "Operation: ADD"): 0.5}
        want = {(0, 0, 0): 0.5 - 0.25, (0, 0, 1): 0.0, (0, 0, 2): 0.5 - 0.75}
    else:
        assert got == {(0, 0, "Operation: NOOP"): 0.0, (0, 1, "Operation: NOOP"): 1.0, (0, 2, "Operation: NOOP"): 1.0}
        want = {(0, 0, 0): 0.5, (0, 0, 1): 0.0, (0, 0, 2): 0.0}
    assert counterfactual_advantages([trace], ADD_NOOP) == pytest.approx(want)
    rows = build_rows([trace], {"memory": "memory"}, FlowGRPOConfig(counterfactual=ADD_NOOP,
                                                                    counterfactual_advantage="replace"))
    assert {r.call: r.advantage for r in rows if r.advantage} == pytest.approx(
        {k: a for (_, _, k), a in want.items() if a})


def test_the_probes_knob_needs_the_alternatives_and_reaches_the_rollouts(tiny, one_node_graph, tmp_path):
    from masgraph.backends.hf_learner import HFLearner
    from masgraph.learner import LoraConfigSpec
    from masgraph.trainers.flow_grpo import FlowGRPO
    from masgraph.trainers.loop import TrainLoop

    learner = HFLearner(str(tiny), dtype="float32")
    learner.add_adapter("memory", LoraConfigSpec())
    with pytest.raises(SpecError, match=r"counterfactual_probes.*needs `counterfactual`"):
        FlowGRPO(learner, {"memory": "memory"}, FlowGRPOConfig(counterfactual_probes=True))
    graph = one_node_graph('group_size: 2, counterfactual: {answer: ["Answer: 1", "Answer: 2"]}, '
                           'counterfactual_probes: true')
    loop = TrainLoop(graph, get_task("basic_arithmetic"), tmp_path / "run", dtype="float32")
    assert loop.rollouts.config.counterfactual_probes is True


def test_the_episode_view_shows_the_calls_own_score_apart_from_the_alternatives():
    from masgraph.watch.render import step_text

    trace = _trace(1.0, ["Operation: ADD"])
    scores = {(0, 0): [("Operation: NOOP", 1.0), ("Operation: ADD", 0.5)]}
    text = step_text(trace.steps[0], counterfactual=scores).plain
    assert "scored as made 0.50" in text and "scored instead Operation: NOOP 1.00\n" in text
    assert "as made" not in step_text(trace.steps[0], counterfactual={(0, 0): [("Operation: NOOP", 1.0)]}).plain
