"""TrainLoop and FlowGRPO on a tiny random Llama built here (a few KB, loads in well under a second): the
backend comes from the policy's `model`, a step interrupted by cancellation leaves the data cursor of the last
completed step in the checkpoint, PPO epochs make the clip act, logprobs are recomputed at each call's
temperature, evaluation is deterministic, steps/evaluations/checkpoints are events (metrics.jsonl is a sink),
and broken checkpoints are MasgraphErrors."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from masgraph.errors import MasgraphError, SpecError
from masgraph.events import CheckpointSaved, Credited, EvalFinished, ListSink, TrainStep
from masgraph.graph import compile_spec
from masgraph.loader import parse_spec
from masgraph.runtime.runner import RunConfig, Runner
from masgraph.tasks import Item, Task
from masgraph.trainers.flow_grpo import FlowGRPO, FlowGRPOConfig, build_rows
from masgraph.trainers.loop import TrainLoop


class Sums(Task):
    """`i + 1 ?` (train) and `i * 1 ?` (test) questions; the reward alternates with the sample index, so every
    group has a learning signal."""

    name = "sums"

    def __init__(self) -> None:
        self.rewarded: list[str] = []
        self.on_reward = lambda: None

    def generate(self, split: str, n: int, seed: int) -> list[Item]:
        if split == "train":
            return [Item(f"train-{seed}-{i}", f"{i % 19} + 1 ?", str(i % 19 + 1)) for i in range(n)]
        return [Item(f"test-{seed}-{i}", f"{i % 19} * 1 ?", str(i % 19)) for i in range(n)]

    def score(self, item: Item, answer: str) -> float:
        return float(answer.strip() == item.answer)

    def reward(self, item, trace) -> float:
        self.rewarded.append(item.id)
        self.on_reward()
        return float(trace.meta["sample"] % 2)


def _graph(model: str | Path, train: str = "{}", temperature: float = 1.0, extra_policy: str = ""):
    text = f"""\
name: tiny
policies:
  main: {{model: "{model}", adapter: answer, trainable: true, sampling: {{temperature: {temperature}, max_tokens: 4}}}}
{extra_policy}
nodes:
  answer: {{role: generator, policy: main, prompt: direct}}
entry: answer
exit: answer
train: {train}
"""
    return compile_spec(parse_spec(text, "tiny.yaml"))


TRAIN = ("{steps: 3, queries_per_step: 2, eval_every: 0, eval_n: 2, checkpoint_every: 10, seed: 3, concurrency: 8, "
         "flow_grpo: {group_size: 4, lr: 0.01}}")


def _loop(tiny: Path, run_dir: Path, train: str = TRAIN, **kw) -> TrainLoop:
    return TrainLoop(_graph(tiny, train), Sums(), run_dir, dtype="float32", **kw)


def test_backend_is_built_from_the_trainable_policys_model(tiny, tmp_path):
    loop = _loop(tiny, tmp_path / "run")
    assert loop.backend.model_name == str(tiny)
    assert loop.backend.model.config.hidden_size == 32


def test_trainable_policies_on_different_models_is_a_located_spec_error(tiny, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(tiny, other)
    graph = _graph(tiny, TRAIN, extra_policy=f'  judge: {{model: "{other}", adapter: judge, trainable: true}}')
    with pytest.raises(SpecError) as err:
        TrainLoop(graph, Sums(), tmp_path / "run", dtype="float32")
    [problem] = err.value.problems
    assert problem.path == "policies.judge.model" and "one base model" in problem.message
    assert str(tiny) in problem.fix


def _losses_and_weights(run_dir: Path) -> tuple[dict[int, float], dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == sorted({m["step"] for m in lines})  # no step twice after a resume
    weights = run_dir / "checkpoints" / "step-3" / "adapters" / "answer" / "adapter_model.safetensors"
    return {m["step"]: m["loss/total"] for m in lines}, load_file(str(weights))


@pytest.mark.slow
def test_cancelled_step_checkpoints_the_last_completed_step_and_resumes_exactly(tiny, tmp_path):
    asyncio.run(_loop(tiny, tmp_path / "a").run())  # uninterrupted reference
    events = ListSink()
    loop = _loop(tiny, tmp_path / "b", sinks=[events])
    task = loop.task
    per_step = loop.cfg.queries_per_step * loop.cfg.flow_grpo.group_size

    async def interrupt_in_step_two():
        run = asyncio.create_task(loop.run())
        # Ctrl-C lands as a cancellation: here when the first episode of step 2 has finished
        task.on_reward = lambda: run.cancel() if len(task.rewarded) == per_step + 1 else None
        with pytest.raises(asyncio.CancelledError):
            await run

    asyncio.run(interrupt_in_step_two())
    assert [e.step for e in events.events if isinstance(e, TrainStep)] == [1]
    assert [(e.step, e.path) for e in events.events if isinstance(e, CheckpointSaved)] == [
        (1, str(tmp_path / "b" / "checkpoints" / "step-1"))]  # written when step 1 finished, not again
    state = json.loads((tmp_path / "b" / "checkpoints" / "step-1" / "state.json").read_text())
    assert state["step"] == 1 and state["cursor"] == loop.cfg.queries_per_step  # not moved by step 2's take
    resumed = _loop(tiny, tmp_path / "b")
    resumed.load(tmp_path / "b" / "checkpoints" / "step-1")
    asyncio.run(resumed.run())
    assert {i.id for i in resumed.items[2:4]} <= set(resumed.task.rewarded)  # step 2's queries, rolled out again
    (loss_a, w_a), (loss_b, w_b) = _losses_and_weights(tmp_path / "a"), _losses_and_weights(tmp_path / "b")
    assert loss_b == pytest.approx(loss_a, abs=1e-6)
    assert w_a.keys() == w_b.keys() and all(torch.allclose(w_a[k], w_b[k], atol=1e-6) for k in w_a)


def _rollouts(tiny: Path, temperature: float, samples: int = 4):
    from masgraph.backends.hf import HFBackend
    from masgraph.backends.hf.learner import HFLearner
    from masgraph.learn.learner import LoraConfigSpec, WeightSync

    torch.manual_seed(0)
    learner = HFLearner(str(tiny), dtype="float32")
    learner.add_adapter("answer", LoraConfigSpec())
    backend = HFBackend(learner.weights, seed=1)
    WeightSync(learner, [backend])()
    graph = _graph(tiny, temperature=temperature)
    runner = Runner(graph, RunConfig(n=3, split="train", samples=samples, concurrency=12), backends={"hf": backend})
    return learner, backend, asyncio.run(runner.run_task(Sums(), store=False)).traces


def test_ppo_epochs_and_mini_batches_make_the_clip_act(tiny):
    learner, _, traces = _rollouts(tiny, 1.0)
    one = FlowGRPO(learner, {"answer": "answer"}, FlowGRPOConfig(lr=0.05)).update(traces)
    # ratio 1: on-policy
    assert one["loss/optimizer_steps"] == 1 and one["loss/clip_frac"] == 0 and one["kl/old_k3"] < 1e-6
    learner, backend, traces = _rollouts(tiny, 1.0)
    many = FlowGRPO(learner, {"answer": "answer"}, FlowGRPOConfig(lr=0.05, ppo={"epochs": 4, "num_mini_batches": 2}))
    metrics = many.update(traces, seed=7)
    assert metrics["loss/optimizer_steps"] == 8 and metrics["loss/clip_frac"] > 0 and metrics["kl/old_k3"] > 1e-4
    assert learner.version("answer") == 1  # one new policy version per update, however many steps
    assert backend.versions["answer"] == 0  # served only once published (the loop's WeightSync)


def test_rows_are_recomputed_at_the_temperature_they_were_sampled_at(tiny):
    learner, _, traces = _rollouts(tiny, 0.5)
    rows = build_rows(traces, {"answer": "answer"}, FlowGRPOConfig(temperature=0.5))
    assert rows and all(r.temperature == 0.5 for r in rows)
    with torch.no_grad():
        recomputed = learner.sequence_logprobs(rows, "answer")
    for r, lp in zip(rows, recomputed):
        assert torch.allclose(lp, torch.tensor(r.old_logprobs), atol=1e-4)
    hot = [dataclasses.replace(r, temperature=1.0) for r in rows]
    with torch.no_grad():
        wrong = learner.sequence_logprobs(hot, "answer")
    assert max(float((a - torch.tensor(r.old_logprobs)).abs().max()) for r, a in zip(rows, wrong)) > 1e-2


def test_update_uses_each_calls_recorded_temperature_not_the_config(tiny):
    learner, _, traces = _rollouts(tiny, 0.5)
    metrics = FlowGRPO(learner, {"answer": "answer"}, FlowGRPOConfig(temperature=1.0)).update(traces)
    assert metrics["kl/old_k3"] < 1e-6 and metrics["loss/clip_frac"] == 0


def test_evaluation_runs_in_deterministic_mode_and_leaves_the_rng_alone(tiny, tmp_path):
    train = TRAIN.replace("seed: 3", "seed: 3, deterministic: false")
    events = ListSink()
    loop = _loop(tiny, tmp_path / "run", train, sinks=[events])
    seen: list[bool] = []
    generate = loop.eval_backend.generate
    loop.eval_backend.generate = lambda requests: seen.append(loop.eval_backend.deterministic) or generate(requests)
    loop.backend.generate = lambda requests: pytest.fail("evaluation decoded on the training backend")
    before = (torch.get_rng_state(), random.getstate())
    metrics = asyncio.run(loop.evaluate())
    assert seen and all(seen) and loop.backend.deterministic is False  # a deterministic view; nothing flipped
    assert loop.eval_backend.weights is loop.backend.weights  # over the same weights, not a copy
    assert torch.equal(before[0], torch.get_rng_state()) and before[1] == random.getstate()
    assert [(type(e), e.step, e.metrics) for e in events.events] == [(EvalFinished, 0, metrics)]


def test_a_train_run_emits_steps_evaluations_and_checkpoints_and_writes_metrics_through_a_sink(tiny, tmp_path):
    events = ListSink()
    loop = _loop(tiny, tmp_path / "run", TRAIN.replace("eval_every: 0", "eval_every: 2"), sinks=[events])
    asyncio.run(loop.run())
    kinds = [(type(e).__name__, e.step) for e in events.events if not isinstance(e, Credited)]
    assert kinds == [("EvalFinished", 0), ("TrainStep", 0), ("TrainStep", 1), ("CheckpointSaved", 1),
                     ("EvalFinished", 2), ("TrainStep", 2), ("CheckpointSaved", 2), ("EvalFinished", 3),
                     ("TrainStep", 3), ("CheckpointSaved", 3)]  # every finished step is checkpointed
    assert [p.name for p in (tmp_path / "run" / "checkpoints").glob("step-*")] == ["step-3"]  # the others replaced
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [e for e in events.events if isinstance(e, TrainStep)]
    for e in steps[1:]:  # each step's rows, one advantage per call, before its metrics
        credited = [c for c in events.events if isinstance(c, Credited) and c.step == e.step]
        assert sum(len(c.calls) for c in credited) == e.metrics["rows/trained"]
    assert lines == [{"step": e.step, **e.metrics} for e in steps]  # metrics.jsonl is the TrainStep stream
    assert next(iter(lines[1])) == "step" and "accuracy/test" in lines[0] and "loss/total" in lines[1]
    assert loop.sink_errors == 0


@pytest.fixture
def checkpoint(tiny, tmp_path) -> Path:
    loop = _loop(tiny, tmp_path / "run", TRAIN.replace("steps: 3", "steps: 1"))
    asyncio.run(loop.run())
    return tmp_path / "run" / "checkpoints" / "step-1"


def test_a_checkpoint_with_the_old_backend_rng_still_resumes(tiny, tmp_path, checkpoint):
    rng = torch.load(checkpoint / "rng.pt", weights_only=False)
    assert "backend" not in rng  # sampling is seeded per request: no backend generator is saved any more
    torch.save({**rng, "backend": torch.Generator().manual_seed(5).get_state()}, checkpoint / "rng.pt")
    loop = _loop(tiny, tmp_path / "again")
    loop.load(checkpoint)
    assert loop.step == 1 and torch.equal(torch.get_rng_state(), rng["torch"])
    assert loop.backend.versions["answer"] == loop.learner.version("answer") == 1  # published on load


@pytest.mark.parametrize("damage,match", [
    (lambda c: (c / "state.json").write_text('{"step": 1, "adap'), "unreadable state.json"),
    (lambda c: (c / "state.json").write_text('{"step": "one", "adapters": ["answer"]}'), "step 'one'.*; no `versions`"),
    (lambda c: (c / "optimizer.pt").unlink(), "cannot load .*optimizer.pt"),
    (lambda c: (c / "rng.pt").write_bytes(b"not a torch file"), "cannot load .*rng.pt"),
    (lambda c: (c / "adapters" / "answer" / "adapter_model.safetensors").write_bytes(b"\0" * 9), "answer"),
    (lambda c: (c / "adapters" / "answer" / "adapter_config.json").write_text(
        (c / "adapters" / "answer" / "adapter_config.json").read_text().replace('"r": 16', '"r": 8')),
     r"rank, alpha, targets \(8, 32, \['q_proj', 'v_proj'\]\) but the graph trains \(16,"),
])
@pytest.mark.slow
def test_broken_checkpoint_is_a_masgraph_error_with_the_path_and_a_fix(tiny, tmp_path, checkpoint, damage, match):
    damage(checkpoint)
    loop = _loop(tiny, tmp_path / "run")
    with pytest.raises(MasgraphError, match=match) as err:
        loop.load(checkpoint)
    message = str(err.value)
    fixes = ("earlier checkpoint", "another step", "resume with")
    assert str(checkpoint) in message and any(fix in message for fix in fixes)


class _Planted:
    """Unpickling it runs code: what a hostile rng.pt in someone else's run dir could hold."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (Path(self.marker), "ran"))


def test_resume_runs_no_code_from_a_checkpoint_file(tiny, tmp_path, checkpoint):
    marker = tmp_path / "planted-code-ran"
    rng = torch.load(checkpoint / "rng.pt", weights_only=True)
    torch.save({**rng, "extra": _Planted(str(marker))}, checkpoint / "rng.pt")
    loop = _loop(tiny, tmp_path / "again")
    with pytest.raises(MasgraphError, match="cannot load .*rng.pt"):
        loop.load(checkpoint)
    assert not marker.exists()  # refused as data, never unpickled into a call


def test_resume_keeps_metric_lines_that_are_not_a_steps_record(tiny, tmp_path):
    loop = _loop(tiny, tmp_path / "run", TRAIN.replace("checkpoint_every: 10", "checkpoint_every: 1"))
    asyncio.run(loop.run())
    metrics = tmp_path / "run" / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    odd = ["not json at all", '{"note": "no step"}', '["a", "list"]', '{"step": "two"}']
    metrics.write_text("\n".join(lines[:1] + odd + lines[1:]) + "\n" + '{"step": 3, "torn')
    again = _loop(tiny, tmp_path / "run", TRAIN.replace("checkpoint_every: 10", "checkpoint_every: 1"))
    again.load(tmp_path / "run" / "checkpoints" / "step-1")
    kept = metrics.read_text().splitlines()
    assert kept == lines[:1] + odd  # steps 2 and 3 go (they are redone), as does the torn last line


@pytest.mark.parametrize("clock, steps", [("cpu", 1), ("wall", 3)])
def test_the_budget_counts_the_chosen_clock(tiny, tmp_path, monkeypatch, clock, steps):
    # the process's CPU clock runs an hour per reading; the wall clock stays real (a few seconds for the run)
    ticks = iter(range(0, 10**9, 3600))
    monkeypatch.setattr("masgraph.trainers.loop.time.process_time", lambda: float(next(ticks)))
    loop = _loop(tiny, tmp_path / "run", TRAIN.replace("seed: 3", f"seed: 3, max_minutes: 1, budget_clock: {clock}"))
    asyncio.run(loop.run())
    assert loop.step == steps  # cpu: out of budget after the first step; wall: all 3 steps fit in a minute


def test_a_task_without_held_out_items_is_refused_before_training(tiny, tmp_path):
    class Leaky(Sums):
        def generate(self, split, n, seed):  # the same questions in both splits: no held-out item survives
            return super().generate("train", n, seed)

    with pytest.raises(MasgraphError, match="no test items left.*PartitionedTask"):
        TrainLoop(_graph(tiny, TRAIN), Leaky(), tmp_path / "run", dtype="float32")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_every_finished_step_is_resumable_and_checkpoint_every_says_which_are_kept(tiny, tmp_path):
    """Issue 58 #15: with the default checkpoint_every (5), a run of 2 steps killed in step 2 had no checkpoint.
    Now each finished step is saved; earlier ones that checkpoint_every does not keep go once the next is whole."""
    loop = _loop(tiny, tmp_path / "run", TRAIN.replace("checkpoint_every: 10", "checkpoint_every: 2"))
    kept = []
    loop.checkpoints.save = lambda *a, save=loop.checkpoints.save: kept.append(save(*a)) or kept[-1]
    asyncio.run(loop.run())
    assert [p.name for p in kept] == ["step-1", "step-2", "step-3"]
    steps = sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step-*"))
    assert steps == ["step-2", "step-3"] and (tmp_path / "run" / "checkpoints" / "latest").read_text() == "step-3"

