"""The LLM judge (masgraph/judge.py): its verdicts, its cache, its calls in the trace, and a data task scored by it
through a run; a scripted judge here (tests/integration/test_judge_real.py judges with the embedded model)."""

from __future__ import annotations

import json

import pytest

from masgraph.backends.base import BackendError
from masgraph.backends.scripted import ScriptedBackend
from masgraph.errors import MasgraphError
from masgraph.registry import default_registry
from masgraph.runtime.scheduler import Policy
from masgraph.tasks.data import load_data_task
from masgraph.tasks.judge import Judge, JudgeSpec, VerdictCache, parse_verdict
from masgraph.trace import Trace


@pytest.mark.parametrize("text,score", [("yes", 1.0), ("Yes.", 1.0), (" no", 0.0), ("No, it is Paris", 0.0),
                                        ("Correct", 1.0), ("incorrect", 0.0), ("The answer is wrong", 0.0),
                                        ("true", 1.0), ("maybe", None), ("", None), ("yesterday", None),
                                        ("nobody knows; yes", 1.0)])
def test_parse_verdict(text, score):
    assert parse_verdict(text) == score


def test_the_judge_prompt_holds_the_question_the_references_and_the_response():
    messages = default_registry().judge_prompts["judge"]("Capital of France?", ["Paris", "paris city"], "It is Paris.")
    assert messages[0]["role"] == "system" and "yes or no" in messages[0]["content"]
    assert messages[-1] == {"role": "user", "content": "Question: Capital of France?\nReference: Paris | paris city\n"
                                                       "Response: It is Paris."}
    assert [m["role"] for m in messages[1:]] == ["user", "assistant"] * 4 + ["user"]
    assert "judge" not in default_registry().prompts  # not a node's prompt


def _judge(tmp_path, reply, **spec) -> tuple[Judge, ScriptedBackend]:
    backend = ScriptedBackend(default=reply)
    spec = JudgeSpec(cache_path=str(tmp_path / "verdicts.sqlite"), **spec)
    return Judge(Policy("judge", spec.policy, backend), spec, default_registry()), backend


def test_a_verdict_is_scored_recorded_and_cached(tmp_path, run):
    judge, backend = _judge(tmp_path, lambda req: "yes" if "Response: Paris" in req.messages[-1]["content"] else "no")
    v = run(judge.verdict("Capital of France?", ["Paris"], "Paris."))
    assert (v.score, v.text, v.cached) == (1.0, "yes", False)
    assert v.call is not None and v.call.policy == "judge" and v.call.text == "yes" and v.call.completion_ids
    assert run(judge.verdict("Capital of France?", ["Paris"], "Lyon.")).score == 0.0
    assert len(backend.requests) == 2
    again = run(judge.verdict("Capital of France?", ["Paris"], "Paris."))
    assert (again.score, again.cached, again.call) == (1.0, True, None)
    assert len(backend.requests) == 2  # no call: the cache answered
    judge.close()
    reopened, backend2 = _judge(tmp_path, "no")  # a new process finds the verdicts on disk
    assert run(reopened.verdict("Capital of France?", ["Paris"], "Paris.")).cached
    assert backend2.requests == []
    other_model, backend3 = _judge(tmp_path, "no", policy={"model": "another-model"})
    assert run(other_model.verdict("Capital of France?", ["Paris"], "Paris.")).score == 0.0  # not its verdict
    assert len(backend3.requests) == 1


def test_without_the_cache_every_verdict_is_a_call(tmp_path, run):
    judge, backend = _judge(tmp_path, "yes", cache=False)
    for _ in range(3):
        assert not run(judge.verdict("q", ["a"], "a")).cached
    assert len(backend.requests) == 3 and judge.cache is None
    assert not (tmp_path / "verdicts.sqlite").exists()


def test_a_reply_that_is_neither_yes_nor_no_scores_0_and_says_so(tmp_path, run):
    judge, _ = _judge(tmp_path, "I am not sure about this one")
    trace = Trace(episode_id="e", item_id="i", query="q", answer="maybe Paris")
    assert run(judge.score("q", ["Paris"], trace)) == 0.0
    assert trace.meta["judge"] == {"verdict": "I am not sure about this one", "score": 0.0, "cached": False,
                                   "unparsed": True}
    assert len(trace.judge_calls) == 1


def test_no_answer_is_0_without_a_call(tmp_path, run):
    judge, backend = _judge(tmp_path, "yes")
    for answer in (None, "  "):
        trace = Trace(episode_id="e", item_id="i", query="q", answer=answer)
        assert run(judge.score("q", ["Paris"], trace)) == 0.0
        assert trace.judge_calls == [] and trace.meta["judge"]["why"] == "no answer"
    assert backend.requests == []


def test_an_unwritable_cache_is_a_clear_error(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(MasgraphError, match="judge cache .* cache: false"):
        VerdictCache(tmp_path / "f" / "v.sqlite")


@pytest.fixture
def single(root):
    from masgraph.graph import compile_spec
    from masgraph.loader import load_spec

    return compile_spec(load_spec(root / "graphs" / "single.yaml"), check_models=False)


def _qa_task(tmp_path, **judge):
    data = [{"question": f"Where does person {i} live?", "answer": ["Rafeport"] if i % 2 else "Brabraport"}
            for i in range(4)]
    (tmp_path / "qa.json").write_text(json.dumps(data))
    task = {"file": "qa.json", "scorer": "judge", "split": "test",
            "judge": {"cache_path": str(tmp_path / "v.sqlite"), **judge}}
    (tmp_path / "qa.yaml").write_text(json.dumps(task))  # JSON is YAML
    return load_data_task(str(tmp_path / "qa.yaml"))


def test_a_data_task_scored_by_the_judge_through_a_run(tmp_path, run, single, runner_for):
    """Rewards and accuracy are the judge's; its calls are in the trace, not in the episode's tokens; a second run
    takes every verdict from the cache."""
    task = _qa_task(tmp_path)

    def reply(req):
        if req.policy == "judge":
            said = req.messages[-1]["content"]
            return "yes" if said.split("Reference: ")[1].split("\n")[0] in said.split("Response: ")[1] else "no"
        return "Answer: Rafeport"
    runner = runner_for(single, ScriptedBackend(default=reply), n=4, split="test")
    items = task.items("test", 4)
    result = run(runner.run_items(task, items))
    assert [t.reward for t in result.traces] == [0.0, 1.0, 0.0, 1.0]
    assert result.summary["accuracy"] == 0.5
    assert result.summary["judge"] == {"verdicts": 4, "cached": 0, "unparsed": 0, "calls": 4,
                                       "prompt_tokens": result.summary["judge"]["prompt_tokens"],
                                       "completion_tokens": len("no") * 2 + len("yes") * 2}
    for t in result.traces:
        [call] = t.judge_calls
        assert call.policy == "judge" and "Response: Rafeport" in bytes(call.prompt_ids).decode()
        assert t.completion_tokens == len("Answer: Rafeport")  # the graph's tokens only
    stored = (result.run_dir / "episodes.jsonl").read_text()
    assert stored.count("Rafeport") >= 4
    again = run(runner.run_items(task, items)).traces
    assert [t.reward for t in again] == [0.0, 1.0, 0.0, 1.0]
    assert all(t.meta["judge"]["cached"] and t.judge_calls == [] for t in again)
    with pytest.raises(MasgraphError, match="scored by an LLM judge"):
        task.score(items[0], "Rafeport")


def test_a_failing_judge_fails_that_episodes_scoring_not_the_run(tmp_path, run, single, runner_for):
    task = _qa_task(tmp_path, cache=False)
    calls = {"n": 0}

    def reply(req):
        if req.policy != "judge":
            return "Answer: Rafeport"
        calls["n"] += 1
        if calls["n"] == 2:
            raise BackendError("judge server is down")
        return "yes"
    runner = runner_for(single, ScriptedBackend(default=reply), n=4, split="test", concurrency=1)
    result = run(runner.run_items(task, task.items("test", 4)))
    errors = [t.error for t in result.traces]
    assert errors[1] == "reward failed: BackendError: judge server is down"
    assert [e for i, e in enumerate(errors) if i != 1] == [None] * 3
    assert result.summary["failures"]["error"] == 1 and result.summary["correct"] == 3


def test_judge_fields_are_checked(tmp_path):
    (tmp_path / "qa.json").write_text(json.dumps([{"question": "q", "answer": "a"}]))
    (tmp_path / "t.yaml").write_text("file: qa.json\nscorer: contains\njudge: {cache: false}\n")
    with pytest.raises(MasgraphError, match="judge: is read only with scorer: judge"):
        load_data_task(str(tmp_path / "t.yaml"))
    (tmp_path / "t.yaml").write_text("file: qa.json\nscorer: judge\njudge: {policy: {backend: hf, temp: 1}}\n")
    with pytest.raises(MasgraphError, match=r"t.yaml: judge.policy.temp: Extra inputs are not permitted"):
        load_data_task(str(tmp_path / "t.yaml"))
    (tmp_path / "t.yaml").write_text("file: qa.json\nscorer: judge\n")
    assert load_data_task(str(tmp_path / "t.yaml")).judge == JudgeSpec()


def test_an_unknown_judge_prompt_is_named(tmp_path):
    with pytest.raises(MasgraphError, match=r"judge prompt 'mine' is not registered \(known: \['judge'\]\)"):
        _judge(tmp_path, "yes", prompt="mine")


def test_the_judge_is_a_training_reward(tiny, tmp_path):
    """A data task scored by a judge trains: the rollouts' rewards are the judge's verdicts (its calls in their
    traces), and the step updates the adapter from them. The judge is a registered backend kind here (a scripted
    verdict on the tiny random model's output), reached through the judge's `policy:` as any backend would be."""
    import asyncio

    from masgraph.graph import compile_spec
    from masgraph.loader import parse_spec
    from masgraph.registry import BackendKind
    from masgraph.rundir.store import read_traces
    from masgraph.trainers.loop import TrainLoop

    def verdict(req):  # "yes" for responses of even length: a signal that varies within groups
        return "yes" if len(req.messages[-1]["content"].split("Response: ")[1]) % 2 == 0 else "no"
    default_registry().backends["judgebot"] = BackendKind(
        "judgebot", lambda policy, **_: ScriptedBackend(default=verdict), returns_tokens=False)
    data = [{"question": f"{i} + 1 ?", "answer": str(i + 1)} for i in range(40)]
    (tmp_path / "sums.json").write_text(json.dumps(data))
    (tmp_path / "sums.yaml").write_text(
        f"file: sums.json\nscorer: judge\njudge: {{policy: {{backend: judgebot, model: bot}}, "
        f"cache_path: {tmp_path / 'v.sqlite'}}}\n")
    task = load_data_task(str(tmp_path / "sums.yaml"))
    text = f"""\
name: judged
policies:
  main: {{model: "{tiny}", adapter: answer, trainable: true, sampling: {{temperature: 1.0, max_tokens: 6}}}}
nodes:
  answer: {{role: generator, policy: main, prompt: direct}}
entry: answer
exit: answer
train: {{steps: 1, queries_per_step: 2, eval_every: 0, eval_n: 2, seed: 3, flow_grpo: {{group_size: 4, lr: 0.01}}}}
"""
    loop = TrainLoop(compile_spec(parse_spec(text, "judged.yaml")), task, tmp_path / "run", dtype="float32")
    last = asyncio.run(loop.run())
    stored = list(read_traces(tmp_path / "run"))
    rollouts = [t for t in stored if "evaluation" not in t.meta]  # the final evaluation's are marked as such
    assert len(rollouts) == 8 and [t.meta["evaluation"] for t in stored if t not in rollouts] == [1, 1]
    for t in rollouts:  # an empty answer is 0 without a call
        assert t.reward == t.meta["judge"]["score"] and len(t.judge_calls) == int(bool((t.answer or "").strip()))
    assert {t.reward for t in rollouts} == {0.0, 1.0}
    assert last["rows/trained"] > 0 and last["grad_norm/answer"] > 0
    assert last["reward/mean"] == pytest.approx(sum(t.reward for t in rollouts) / len(rollouts))
