"""Counterfactual credit (masgraph/counterfactual.py, trainers/credit.counterfactual_advantages): the variants of an
episode, their scores on a scripted memory graph, hand-computed advantages, and the rows they give a group whose
episodes all scored alike (which has none without them); with probe questions (`counterfactual.probes`,
`Task.probes`), the probes of `memory_updates`, `as_made` and `asked`, the call's own score, and hand-computed
scores of a decision about a person the item does not ask about."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from masgraph.errors import SpecError
from masgraph.graph import compile_spec
from masgraph.learn.counterfactual import META, as_made, asked, sampled, variants
from masgraph.loader import load_spec
from masgraph.runtime.scheduler import EpisodeInput
from masgraph.tasks import Item, MemoryUpdates, Task, get_task
from masgraph.trace import LLMCall, Step, Trace
from masgraph.trainers.config import with_overrides
from masgraph.trainers.credit import counterfactual_advantages, counterfactual_scales, counterfactual_values
from masgraph.trainers.flow_grpo import FlowGRPOConfig, _alternatives_scored, build_rows

OPS = ["Operation: ADD", "Operation: UPDATE", "Operation: DELETE", "Operation: NOOP"]
# Kalo Mira moves, then visits: a store of every fact shows the reader the visit last, so it answers the visit
STREAM = ("Kalo Mira lives in Rafeport.\nIt rained all afternoon.\nTomo Rii lives in Velport.\n"
          "Kalo Mira moved to Orrinford.\nKalo Mira visited Ashmere last week.\n"
          "Question: In which city does Kalo Mira live now?")


def shaped(runner_for, graph, backend, *, branch_width=0, counterfactual=None, counterfactual_probes=False,
           counterfactual_decisions=0, **config):
    """A runner (`runner_for`) whose runs are shaped as training shapes them (`masgraph.learn.rollouts`)."""
    from masgraph.learn.rollouts import RolloutShape, Shaped

    return Shaped(runner_for(graph, backend, **config),
                  RolloutShape(branch_width, counterfactual or {}, counterfactual_probes, counterfactual_decisions))


class MoveThenVisit(Task):
    name = "move-then-visit"

    def generate(self, split, n, seed):
        return [Item(f"{split}-{i}", STREAM, "Orrinford", {"others": ["Rafeport", "Velport", "Ashmere"]})
                for i in range(n)]

    def score(self, item, answer):
        return get_task("memory_updates").score(item, answer)


def replies(req):
    """A manager collapsed to ADD; a reader that answers with the last city it is shown."""
    if req.key[1] == "generator":
        shown = req.messages[-1]["content"].split("Question:")[0].rstrip()
        return "Answer: " + shown.rsplit(" ", 1)[-1].rstrip(".")
    return "Operation: ADD"


def memory_graph(root):
    spec = load_spec(root / "graphs" / "memory.yaml")
    policies = {k: p.model_copy(update={"backend": "scripted"}) for k, p in spec.policies.items()}
    return compile_spec(spec.model_copy(update={"policies": policies, "train": None}))


def _call(text: str) -> LLMCall:
    return LLMCall(policy="p", prompt_ids=[1], completion_ids=[2], logprobs=[-0.1], text=text)


def _trace(reward: float, texts: list[str], scored: list | None = None, status: str = "ok") -> Trace:
    steps = [Step(episode_id="e", index=0, node="memory", role="memory", turn=1, llm=[_call(t) for t in texts]),
             Step(episode_id="e", index=1, node="generator", role="generator", turn=1, llm=[_call("Answer: x")])]
    return Trace(episode_id="e", item_id="q", query="q", steps=steps, reward=reward, status=status,
                 meta={META: scored} if scored is not None else {})


def test_variants_replay_the_record_with_one_call_replaced():
    trace = _trace(1.0, ["Operation: ADD", "NOOP"])
    out = variants(EpisodeInput("q", "q", 3, {"gold": "x"}), trace, {"memory": ["Operation: ADD", "Operation: NOOP"]})
    # call 0 wrote the first alternative (no variant for it); call 1 wrote neither
    assert [(ref, alt) for ref, alt, _ in out] == [((0, 0), "Operation: NOOP"), ((0, 1), "Operation: ADD"),
                                                   ((0, 1), "Operation: NOOP")]
    ep = out[0][2]
    assert ep.sample == 3 and ep.meta["gold"] == "x" and ep.meta[META] == {"root": "e", "step": 0, "call": 0}
    assert sorted(ep.replay) == [("memory", 1, 0), ("memory", 1, 1)]  # the reader's call is not replayed
    assert ep.replay[("memory", 1, 0)].text == "Operation: NOOP" and ep.replay[("memory", 1, 0)].completion_ids == []
    assert ep.replay[("memory", 1, 1)] is trace.steps[0].llm[1]
    assert variants(EpisodeInput("q", "q"), _trace(1.0, ["ADD"], status="error"), {"memory": OPS}) == []
    assert variants(EpisodeInput("q", "q"), trace, {"planner": OPS}) == []


def test_counterfactual_advantage_is_the_reward_less_the_mean_over_alternatives():
    alts = {"memory": ["A", "B", "C"]}
    # call 0 wrote "A" (its Q is the episode's reward, 1); B scored 0, C 1: baseline 2/3
    # call 1 wrote "junk" (none of them): A 0, B 0, C 0: baseline 0
    # call 2 lacks C's score: no advantage
    scored = [[0, 0, "B", 0.0], [0, 0, "C", 1.0], [0, 1, "A", 0.0], [0, 1, "B", 0.0], [0, 1, "C", 0.0],
              [0, 2, "B", 1.0]]
    traces = [_trace(1.0, ["A", "junk", "A"], scored), _trace(0.0, ["A"], [[0, 0, "B", 1.0], [0, 0, "C", 1.0]]),
              _trace(1.0, ["A"], [[0, 0, "B", 0.0], [0, 0, "C", 0.0]], status="error"), _trace(1.0, ["A"])]
    got = counterfactual_advantages(traces, alts)
    assert got == pytest.approx({(0, 0, 0): 1 / 3, (0, 0, 1): 1.0, (1, 0, 0): -2 / 3})


def test_replace_makes_the_counterfactual_advantage_a_scored_calls_whole_advantage():
    cfg = {"memory": ["A", "B", "C"]}
    # one group: the first episode scored 1, the second 0. First: call 0 wrote A (B 0, C 1: A^C = 1 - 2/3), call 1
    # wrote none of them (all 0: A^C = 1). Second: call 0 wrote A (B 1, C 1: A^C = 0 - 2/3), call 1 unscored.
    traces = [_trace(1.0, ["A", "junk"], [[0, 0, "B", 0.0], [0, 0, "C", 1.0], [0, 1, "A", 0.0], [0, 1, "B", 0.0],
                                          [0, 1, "C", 0.0]]),
              _trace(0.0, ["A", "A"], [[0, 0, "B", 1.0], [0, 0, "C", 1.0]])]
    outcome = {(r.traj, r.call): r.advantage for r in build_rows(traces, {"memory": "memory"}, FlowGRPOConfig())}
    assert outcome[(0, 0)] == pytest.approx(-outcome[(1, 0)]) and outcome[(0, 0)] > 0  # the group's ±
    added = build_rows(traces, {"memory": "memory"}, FlowGRPOConfig(counterfactual={"alternatives": cfg}))
    assert {(r.traj, r.call): r.advantage for r in added} == pytest.approx(
        {(0, 0): outcome[(0, 0)] + 1 / 3, (0, 1): outcome[(0, 1)] + 1.0, (1, 0): outcome[(1, 0)] - 2 / 3,
         (1, 1): outcome[(1, 1)]})
    replaced = build_rows(traces, {"memory": "memory"}, FlowGRPOConfig(
        counterfactual={"alternatives": cfg, "advantage": "replace"}))
    # scored calls: A^C alone; the unscored call keeps its outcome advantage
    assert {(r.traj, r.call): r.advantage for r in replaced} == pytest.approx(
        {(0, 0): 1 / 3, (0, 1): 1.0, (1, 0): -2 / 3, (1, 1): outcome[(1, 1)]})
    # ... the step (anchor-state) term too
    stepped = build_rows(traces, {"memory": "memory"}, FlowGRPOConfig(
        counterfactual={"alternatives": cfg, "advantage": "replace"}, credit={"advantage": "episode+step"}))
    assert {(r.traj, r.call): r.advantage for r in stepped if (r.traj, r.call) != (1, 1)} == pytest.approx(
        {(0, 0): 1 / 3, (0, 1): 1.0, (1, 0): -2 / 3})


def test_a_collapsed_manager_is_credited_against_what_it_did_not_do(root, scripted, runner_for, run):
    backend = scripted({"memory": replies, "generator": replies})
    runner = shaped(runner_for, memory_graph(root), backend, n=1, samples=2, counterfactual={"memory": OPS})
    traces = run(runner.run_items(MoveThenVisit(), MoveThenVisit().items("train", 1))).traces
    assert [t.reward for t in traces] == [0.0, 0.0]  # every fact added: the reader answers the visit
    scored = {(s, k, alt): r for s, k, alt, r in traces[0].meta[META]}
    assert len(scored) == 5 * 3  # 5 calls × the 3 operations each did not write
    # only skipping the visit saves it: the reader then sees the move last
    assert [alt for (s, k, alt), r in scored.items() if r] == ["Operation: NOOP"]
    assert scored[(0, 4, "Operation: NOOP")] == 1.0
    # variants replay the manager; only the reader decodes again, once per distinct input: the 30 variants show it
    # 7 different memories (counted with the memo off), the two roots decoded theirs in their own run
    nodes = [r.key[1] for r in backend.requests]
    assert nodes.count("memory") == 2 * 5 and nodes.count("generator") == 2 + 7

    plain = FlowGRPOConfig()
    assert build_rows(traces, {"memory": "memory"}, plain) == []  # a flat group: no signal without them
    rows = build_rows(traces, {"memory": "memory"}, FlowGRPOConfig(counterfactual={"alternatives": {"memory": OPS}}))
    # the visit's ADD: 0 - mean(ADD 0, UPDATE 0, DELETE 0, NOOP 1); no other call changed the outcome
    assert [(r.traj, r.call, r.advantage) for r in rows] == [(0, 4, -0.25), (1, 4, -0.25)]
    half = build_rows(traces, {"memory": "memory"}, FlowGRPOConfig(
        counterfactual={"alternatives": {"memory": OPS}, "weight": 2.0}))
    assert [r.advantage for r in half] == [-0.5, -0.5]


def test_without_the_knob_no_variant_runs(root, scripted, runner_for, run):
    backend = scripted({"memory": replies, "generator": replies})
    traces = run(runner_for(memory_graph(root), backend, n=1, samples=2).run_items(
        MoveThenVisit(), MoveThenVisit().items("train", 1))).traces
    assert META not in traces[0].meta and len(backend.requests) == 2 * 6


def test_counterfactual_on_ray_rollout_workers_is_refused_with_the_fix(root, scripted, runner_for, run):
    from masgraph.errors import MasgraphError

    runner = shaped(runner_for, memory_graph(root), scripted({"memory": replies, "generator": replies}), n=1,
                    samples=2, counterfactual={"memory": OPS})
    runner.runner.engine = SimpleNamespace(in_process=False)  # what Ray rollouts put there: not the driver's engine
    with pytest.raises(MasgraphError, match=r"counterfactual calls .* Ray rollouts yet; leave `counterfactual` empty"):
        run(runner.run_items(MoveThenVisit(), MoveThenVisit().items("train", 1)))


@pytest.mark.parametrize(("knob", "match"), [
    ({"planner": OPS}, r"counterfactual\.alternatives\.planner.*not a trainable node"),
    ({"memory": ["Operation: ADD"]}, r"counterfactual\.alternatives\.memory.*two or more distinct"),
    ({"memory": ["ADD", " ADD "]}, r"two or more distinct"),
    ({"memory": ["ADD", ""]}, r"non-empty"),
])
def test_the_knob_is_checked_against_the_graph(tiny, knob, match):
    from masgraph.backends.hf.learner import HFLearner
    from masgraph.learn.learner import LoraConfigSpec
    from masgraph.trainers.flow_grpo import FlowGRPO

    learner = HFLearner(str(tiny), dtype="float32")
    learner.add_adapter("memory", LoraConfigSpec())
    with pytest.raises(SpecError, match=match):
        FlowGRPO(learner, {"memory": "memory"}, FlowGRPOConfig(counterfactual={"alternatives": knob}))


def test_flow_grpo_counterfactual_reaches_the_training_rollouts(one_node_graph, tmp_path):
    import asyncio
    import json

    from masgraph.tasks import BasicArithmetic
    from masgraph.trainers.loop import TrainLoop

    graph = one_node_graph('group_size: 2, lr: 0.01, '
                           'counterfactual: {alternatives: {answer: ["Answer: 1", "Answer: 2", "Answer: 3"]}}')
    loop = TrainLoop(graph, BasicArithmetic(), tmp_path / "run", dtype="float32")
    asyncio.run(loop.run())
    [row] = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
             if '"counterfactual/calls"' in line]
    # 2 queries × 2 episodes, one call each, scored with the 3 alternatives (a call that wrote one skips it)
    assert row["counterfactual/calls"] == 4 and 8 <= row["counterfactual/variants"] <= 12
    # every variant's score is kept, beside the advantages, in the run's events (what was credited, and why)
    credited = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()
                if '"kind": "credit"' in line or '"kind":"credit"' in line]
    kept = [v for e in credited for v in e.get("counterfactual", [])]
    assert kept and len(kept) <= row["counterfactual/variants"] and all(len(v) == 4 for v in kept)

    # ... and `masgraph watch`'s episode view shows them under the call they replaced
    from masgraph.watch.index import RunIndex
    from masgraph.watch.render import step_text

    index = RunIndex(tmp_path / "run")
    index.poll()
    episode = next(e for e in credited if e.get("counterfactual"))
    step_index, call, alternative, score = episode["counterfactual"][0]
    [shown] = [r for r in index.rows if r.id == episode["episode_id"]]
    step = index.trace(shown).steps[step_index]
    scores = index.counterfactuals[shown.id]
    assert (alternative, score) in scores[(step_index, call)]
    text = step_text(step, credit=index.credits[shown.id], counterfactual=scores).plain
    assert "scored instead " in text and f"{alternative} {score:.2f}" in text
    assert "scored instead" not in step_text(step, credit=index.credits[shown.id]).plain


def test_the_greedy_memo_shares_one_decode_and_forgets_a_failure(run):
    import asyncio

    from masgraph.backends.base import Request
    from masgraph.runtime.scheduler import Scheduler

    class Flaky:
        calls = 0

        async def complete(self, requests):
            Flaky.calls += 1
            await asyncio.sleep(0.01)
            if Flaky.calls == 1:
                raise RuntimeError("backend down")
            return [f"done {Flaky.calls}"]

    sched = Scheduler.__new__(Scheduler)
    sched._memo = {}
    req = Request([{"role": "user", "content": "x"}], "p", None, None, 0)

    async def main():
        with pytest.raises(RuntimeError):
            await sched._memoised(("p", None, "x"), Flaky(), req)
        await asyncio.sleep(0)  # the failure's done-callback forgets it
        both = await asyncio.gather(*(sched._memoised(("p", None, "x"), Flaky(), req) for _ in range(2)))
        later = await sched._memoised(("p", None, "x"), Flaky(), req)
        return both, later

    both, later = run(main())
    assert both == [["done 2"], ["done 2"]] and later == ["done 2"] and Flaky.calls == 2


def test_norm_divides_each_nodes_decision_term_by_its_root_mean_square():
    """`counterfactual.norm`: the scored calls' A^C (1/3, 1, -2/3, as above) and the better alternatives' rows are
    divided by sqrt((1/9 + 1 + 4/9) / 3) = sqrt(14/27), the format term and the unscored call's outcome are not."""
    import math

    cfg = {"memory": ["A", "B", "C"]}
    traces = [_trace(1.0, ["A", "junk"], [[0, 0, "B", 0.0], [0, 0, "C", 1.0], [0, 1, "A", 0.0], [0, 1, "B", 0.0],
                                          [0, 1, "C", 0.0]]),
              _trace(0.0, ["A", "A"], [[0, 0, "B", 1.0], [0, 0, "C", 1.0]])]
    rms = math.sqrt(14 / 27)
    assert counterfactual_scales(traces, counterfactual_advantages(traces, cfg)) == pytest.approx({"memory": 1 / rms})
    knobs = FlowGRPOConfig(counterfactual={"alternatives": cfg, "advantage": "replace", "rows": True})

    def advantages(config):
        return {(r.traj, r.call, r.alternative): r.advantage
                for r in build_rows(traces, {"memory": "memory"}, config, encode=lambda text: [7])}

    raw, normed = advantages(knobs), advantages(with_overrides(knobs, {"counterfactual": {"norm": True}}))
    # the rows: the three scored calls, the unscored one (its outcome advantage), and the alternatives above their
    # call's mean: C for the first call of episode 0 (1 - 2/3), B and C for episode 1's first call (1 - 2/3 each)
    assert raw == pytest.approx({(0, 0, None): 1 / 3, (0, 1, None): 1.0, (1, 0, None): -2 / 3,
                                 (1, 1, None): raw[(1, 1, None)], (0, 0, "C"): 1 / 3, (1, 0, "B"): 1 / 3,
                                 (1, 0, "C"): 1 / 3})
    assert normed == pytest.approx({k: v if k == (1, 1, None) else v / rms for k, v in raw.items()})
    # the weight still scales the normalised term; a node none of whose decisions mattered is left as it is
    doubled = advantages(with_overrides(knobs, {"counterfactual": {"norm": True, "weight": 2.0}}))
    assert doubled[(0, 1, None)] == pytest.approx(2 / rms)
    flat = [_trace(1.0, ["A"], [[0, 0, "B", 1.0], [0, 0, "C", 1.0]])]
    assert counterfactual_scales(flat, counterfactual_advantages(flat, cfg)) == {"memory": 1.0}


def test_alternative_rows_push_the_better_choice_the_policy_did_not_sample(categorical):
    """Eight episodes all sampled the near-certain token 0 and all scored 0; with token 2 in its place each would have
    scored 1 (t1, t3: 0). Sampled rows alone push token 0 down and the other three up alike; the alternative rows
    (`counterfactual.rows`) also push token 2 up (the worse t1 and t3 get no row of their own), so token 2 alone
    gains."""
    import torch

    from masgraph.trainers.flow_grpo import FlowGRPO

    alts = ["t0", "t1", "t2", "t3"]

    class Tokenizer:
        def encode(self, text, add_special_tokens=True):
            return [int(text[1:])]

    def learner():
        toy = categorical()
        toy.weights = type("Weights", (), {"tokenizer": Tokenizer()})()
        return toy

    def traces(toy):
        lp = torch.log_softmax(toy.logits.detach(), -1).tolist()
        out = []
        for e in range(8):  # finish "length": no stop token to append to an alternative
            call = LLMCall(policy="m", adapter="m", prompt_ids=[9], completion_ids=[0], logprobs=[lp[0]], text="t0",
                           finish_reason="length")
            out.append(Trace(episode_id=f"e{e}", item_id="q", query="q", reward=0.0, meta={META: [
                [0, 0, "t1", 0.0], [0, 0, "t2", 1.0], [0, 0, "t3", 0.0]]}, steps=[
                Step(episode_id=f"e{e}", index=0, node="memory", role="memory", turn=1, llm=[call])]))
        return out

    sampled = learner()
    before = sampled.probs()
    cfg = FlowGRPOConfig(lr=0.1, ppo={"kl_coef": 0.0}, counterfactual={"alternatives": {"memory": alts}})
    assert FlowGRPO(sampled, {"memory": "m"}, cfg).update(traces(sampled))["rows/trained"] == 8
    after = sampled.probs()
    assert after[0] < before[0] and after[1] == pytest.approx(after[2]) == pytest.approx(after[3])

    every = learner()
    algo = FlowGRPO(every, {"memory": "m"}, with_overrides(cfg, {"counterfactual": {"rows": True}}))
    rows = build_rows(traces(every), {"memory": "m"}, algo.config, algo._encode)
    # per episode: its own call (0 - 0.25) and the one alternative above the mean (t2: +0.75); t1 and t3 (-0.25)
    # get no row: an unsampled completion is never pushed down
    assert [(r.alternative, r.completion_ids, r.advantage) for r in rows[7:]] == [
        (None, [0], -0.25), ("t2", [2], 0.75)] + [("t2", [2], 0.75)] * 7
    metrics = algo.update(traces(every))
    got = every.probs()
    # (Adam's first step moves each logit by about lr, whatever the gradient's size: the order is what shows)
    assert metrics["rows/trained"] == 8 * 2 and got[2] > after[2] and got[2] > 1.15 * max(got[1], got[3])
    assert got[1] == pytest.approx(got[3]) and got[1] < after[1]
    assert algo.credit() and all(len(c) == 1 for c in algo.credit().values())  # the calls as made, one each


def test_alternative_rows_need_the_alternatives_and_a_tokenizer(tiny):
    from masgraph.backends.hf.learner import HFLearner
    from masgraph.learn.learner import LoraConfigSpec
    from masgraph.trainers.flow_grpo import FlowGRPO

    learner = HFLearner(str(tiny), dtype="float32")
    learner.add_adapter("memory", LoraConfigSpec())
    with pytest.raises(SpecError, match=r"counterfactual.rows.*needs `counterfactual\.alternatives`"):
        FlowGRPO(learner, {"memory": "memory"}, FlowGRPOConfig(counterfactual={"rows": True}))
    algo = FlowGRPO(learner, {"memory": "memory"}, FlowGRPOConfig(
        counterfactual={"alternatives": {"memory": OPS}, "rows": True}))
    assert algo._encode("Operation: NOOP") == learner.weights.tokenizer.encode("Operation: NOOP",
                                                                                add_special_tokens=False)


# ---- probe questions (`counterfactual.probes`) ----

ADD_NOOP = {"memory": ["Operation: ADD", "Operation: NOOP"]}
# the item asks about Kalo Mira; Tomo Rii's visit is what a store of every fact gets wrong about Tomo Rii
PROBED_STREAM = ("Kalo Mira lives in Rafeport.\nTomo Rii lives in Velport.\nTomo Rii visited Ashmere last week.\n"
                 "Question: In which city does Kalo Mira live now?")


class AskAboutKalo(Task):
    name = "ask-about-kalo"

    def generate(self, split, n, seed):
        return [Item(f"{split}-{i}", PROBED_STREAM, "Rafeport", {"others": ["Velport", "Ashmere"]}) for i in range(n)]

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


@pytest.mark.parametrize("probes", [False, True])
def test_probes_give_the_visit_about_a_person_not_asked_its_score(root, scripted, runner_for, run, probes):
    """Kalo Mira is asked; the manager adds all three facts, and the reader answers Rafeport (right). Asked about
    Tomo Rii (the probe), it is shown Tomo's home and visit and answers the visit (wrong). Scores, mean over the
    item's question and the probe (hand-computed): as made (1 + 0) / 2 for every call; NOOP in place of
    Kalo's home: (0 + 0) / 2 (nothing shown about Kalo); of Tomo's home: (1 + 0) / 2 (the visit alone);
    of the visit: (1 + 1) / 2. Without probes only Kalo's home matters (1 vs 0)."""
    backend = scripted({"memory": replies, "generator": replies})
    runner = shaped(runner_for, memory_graph(root), backend, n=1, samples=1, counterfactual=ADD_NOOP,
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
    assert _alternatives_scored(trace) == 3  # the metric counts NOOP per call, not the recorded own scores
    rows = build_rows([trace], {"memory": "memory"}, FlowGRPOConfig(
        counterfactual={"alternatives": ADD_NOOP, "advantage": "replace"}))
    assert {r.call: r.advantage for r in rows if r.advantage} == pytest.approx(
        {k: a for (_, _, k), a in want.items() if a})


@pytest.mark.parametrize(("knob", "value", "written"), [("probes", True, "true"), ("decisions", 3, "3")])
def test_a_scoring_knob_needs_the_alternatives_and_reaches_the_rollouts(tiny, one_node_graph, tmp_path, knob, value,
                                                                       written):
    from masgraph.backends.hf.learner import HFLearner
    from masgraph.learn.learner import LoraConfigSpec
    from masgraph.trainers.flow_grpo import FlowGRPO
    from masgraph.trainers.loop import TrainLoop

    learner = HFLearner(str(tiny), dtype="float32")
    learner.add_adapter("memory", LoraConfigSpec())
    with pytest.raises(SpecError, match=rf"counterfactual\.{knob}.*needs `counterfactual\.alternatives`"):
        FlowGRPO(learner, {"memory": "memory"}, FlowGRPOConfig(counterfactual={knob: value}))
    graph = one_node_graph(
        f'group_size: 2, counterfactual: {{alternatives: {{answer: ["Answer: 1", "Answer: 2"]}}, {knob}: {written}}}')
    loop = TrainLoop(graph, get_task("basic_arithmetic"), tmp_path / "run", dtype="float32")
    got = getattr(loop.algo.shape, f"counterfactual_{knob}")  # what the training rollouts are shaped by
    assert got == value and type(got) is type(value)


def test_the_episode_view_shows_the_calls_own_score_apart_from_the_alternatives():
    from masgraph.watch.render import step_text

    trace = _trace(1.0, ["Operation: ADD"])
    scores = {(0, 0): [("Operation: NOOP", 1.0), ("Operation: ADD", 0.5)]}
    text = step_text(trace.steps[0], counterfactual=scores).plain
    assert "scored as made 0.50" in text and "scored instead Operation: NOOP 1.00\n" in text
    assert "as made" not in step_text(trace.steps[0], counterfactual={(0, 0): [("Operation: NOOP", 1.0)]}).plain


def test_sampled_draws_k_decisions_the_same_way_for_the_same_key():
    trace = _trace(1.0, ["Operation: ADD"] * 5)  # five decisions in step 0; the reader's step is not one
    assert sampled(trace, ADD_NOOP, 0, "k") is None and sampled(trace, ADD_NOOP, 5, "k") is None  # all of them
    draws = {frozenset(sampled(trace, ADD_NOOP, 2, f"7/q/{s}")) for s in range(20)}
    assert all(len(d) == 2 and d <= {(0, c) for c in range(5)} for d in draws)
    assert len(draws) > 3  # the draw depends on the key (10 pairs to draw from)...
    assert sampled(trace, ADD_NOOP, 2, "7/q/3") == sampled(trace, ADD_NOOP, 2, "7/q/3")  # ...and on nothing else
    only = sampled(trace, ADD_NOOP, 2, "7/q/3")
    root = EpisodeInput("q", "q", 3, {"gold": "x"})
    assert {ref for ref, _, _ in variants(root, trace, ADD_NOOP, only)} == only
    assert [step for step, _ in as_made(root, trace, ADD_NOOP, only)] == [0]
    assert as_made(root, trace, ADD_NOOP, set()) == [] and variants(root, trace, ADD_NOOP, set()) == []


@pytest.mark.parametrize("probes", [False, True])
def test_counterfactual_decisions_caps_the_scored_decisions_of_each_episode(root, scripted, runner_for, run, probes):
    """Five decisions an episode, at most two scored: each episode records the three alternatives of exactly two
    of its calls (and, with probes, their own scores), the draw differs between the samples of an item and repeats
    in a second run with the same seed; the manager is asked nothing more and the reader far less than with all."""
    def scored(cap: int) -> tuple[list[set], int]:
        backend = scripted({"memory": replies, "generator": replies})
        runner = shaped(runner_for, memory_graph(root), backend, n=1, samples=4, counterfactual={"memory": OPS},
                            counterfactual_decisions=cap, counterfactual_probes=probes, seed=11)
        traces = run(runner.run_items(MoveThenVisit(), MoveThenVisit().items("train", 1))).traces
        for t in traces:
            alts = {(s, k): set() for s, k, _, _ in t.meta[META]}
            for s, k, alt, _ in t.meta[META]:
                alts[(s, k)].add(alt)
            assert all(a == set(OPS) - {"Operation: ADD"} | ({"Operation: ADD"} if probes else set())
                       for a in alts.values())
        decodes = sum(r.key[1] == "generator" for r in backend.requests)
        return [{(s, k) for s, k, _, _ in t.meta[META]} for t in traces], decodes

    capped, capped_decodes = scored(2)
    assert [len(refs) for refs in capped] == [2, 2, 2, 2] and len({frozenset(r) for r in capped}) > 1
    assert scored(2)[0] == capped  # HEAD: every decision, 5 a trace
    every, every_decodes = scored(0)
    assert [len(refs) for refs in every] == [5] * 4 and capped_decodes < every_decodes


def test_the_decisions_knob_is_not_negative():
    with pytest.raises(ValueError, match="greater than or equal to 0"):
        FlowGRPOConfig(counterfactual={"alternatives": {"memory": OPS}, "decisions": -1})
