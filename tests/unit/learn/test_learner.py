"""The learner is not the inference server: an HFLearner trains, `WeightSync` publishes each new adapter version to
the backends that serve rollouts (in process: the same model object; elsewhere: the saved PEFT directory), and
the training loop works with a backend that has only complete / aclose / publish."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch

from masgraph.backends.base import Completion, Request
from masgraph.backends.hf import HFBackend
from masgraph.backends.hf.learner import HFLearner
from masgraph.events import EvalFinished, ListSink, TrainStep
from masgraph.graph import compile_spec
from masgraph.learn.learner import LoraConfigSpec, WeightSync
from masgraph.loader import parse_spec
from masgraph.rundir.metrics import MetricsSink
from masgraph.spec import SamplingSpec
from masgraph.tasks import Item, Task
from masgraph.trainers.flow_grpo import Row
from masgraph.trainers.loop import TrainLoop

# a system prompt of >= 16 tokens: its KV is cached and reused across calls (the static prefix)
SYSTEM = " ".join(["Answer:"] + [str(i) for i in range(19)])
GREEDY = SamplingSpec(temperature=0.0, max_tokens=4)


def _request(q: str, seed: int = 0) -> Request:
    return Request([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}], adapter="pol",
                   sampling=GREEDY, seed=seed)


def _perturb(learner: HFLearner, adapter: str, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in learner.parameters(adapter):
            p.add_(torch.randn(p.shape, generator=gen) * 0.5)


@pytest.fixture
def pair(tiny):
    torch.manual_seed(0)
    learner = HFLearner(str(tiny), dtype="float32")
    learner.add_adapter("pol", LoraConfigSpec(rank=4, alpha=8))
    backend = HFBackend(learner.weights)
    return learner, backend, WeightSync(learner, [backend])


def test_backend_serves_the_learners_model_without_a_copy(pair):
    learner, backend, sync = pair
    assert backend.weights is learner.weights and backend.model is learner.weights.model
    assert sync() == ["pol"] and backend.versions["pol"] == 0
    assert sync() == []  # nothing moved, nothing published


@pytest.mark.slow
def test_publishing_a_new_version_serves_the_new_weights_and_drops_the_old_prefix_kv(pair):
    learner, backend, sync = pair
    sync()
    [before] = backend.generate([_request("1 + 1 ?")])
    assert before.policy_version == 0 and backend.stats["prefix_misses"] == 1
    backend.generate([_request("2 + 1 ?")])
    assert backend.stats["prefix_hits"] == 1  # same adapter version: the prefix KV is reused

    _perturb(learner, "pol", 1)
    assert learner.new_version("pol") == 1
    assert backend.versions["pol"] == 0  # not served until published
    assert sync() == ["pol"]
    [after] = backend.generate([_request("1 + 1 ?")])
    assert after.policy_version == 1
    assert backend.stats["prefix_misses"] == 2  # the old version's prefix KV is not reused
    assert all(key[0] != "pol" or key[1] == 1 for key in backend._prefix_kv)

    # the new weights serve: a cold backend on the same model decodes the same, and the learner agrees
    cold = HFBackend(learner.weights)
    WeightSync(learner, [cold])()
    [cold] = cold.generate([_request("1 + 1 ?")])
    assert (after.completion_ids, after.logprobs) == (cold.completion_ids, cold.logprobs)
    assert after.logprobs != before.logprobs
    row = Row(0, "n", "pol", after.prompt_ids, after.completion_ids, after.logprobs, 1.0, 1, 1.0)
    with torch.no_grad():
        [lp] = learner.sequence_logprobs([row], "pol")
    assert torch.allclose(lp, torch.tensor(after.logprobs), atol=1e-4)


def test_a_backend_on_another_copy_of_the_model_gets_the_weights_through_the_peft_directory(tiny, pair):
    learner, _, _ = pair
    _perturb(learner, "pol", 2)
    learner.new_version("pol")
    remote = HFBackend(str(tiny), dtype="float32")  # as a server in another process would hold its own copy
    WeightSync(learner, [remote])()
    assert remote.weights is not learner.weights and remote.versions["pol"] == 1
    names = [n for n, _ in learner.weights.model.named_parameters() if ".pol." in n]
    mine = dict(zip(names, learner.parameters("pol")))
    theirs = {n: p for n, p in remote.model.named_parameters() if ".pol." in n}
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[n], theirs[n]) for n in mine)
    assert set(learner.source("pol").state_dict()) == {k.replace(".pol.", ".") for k in mine}


def test_completions_carry_how_many_rows_decoded_together(pair):
    _, backend, sync = pair
    sync()
    reqs = [_request(f"{i} + 1 ?") for i in range(3)]
    assert [c.batch_size for c in backend.generate(reqs)] == [3, 3, 3]
    backend.deterministic = True
    assert [c.batch_size for c in backend.generate(reqs)] == [1, 1, 1]


def test_learner_errors_say_what_to_fix(pair):
    learner, _, _ = pair
    with pytest.raises(Exception, match=r"adapter 'b' is not on the learner.*fix: learner.add_adapter"):
        learner.parameters("b")


class Remote:
    """A rollout backend with nothing but complete / aclose / publish (like a vLLM server client): it serves from
    its own copy of the model and takes each published version through the learner's saved PEFT directory."""

    returns_tokens = True

    def __init__(self, model: Path):
        self._server = HFBackend(str(model), dtype="float32")
        self.published: list[tuple[str, int]] = []

    async def complete(self, requests: list[Request]) -> list[Completion]:
        return await self._server.complete(requests)

    async def aclose(self) -> None:
        await self._server.aclose()

    def publish(self, adapter, version, source) -> None:
        self.published.append((adapter, version))
        self._server.publish(adapter, version, source)


class Alternating(Task):
    """`i + 1 ?` (train) and `i * 1 ?` (test) questions whose reward alternates with the sample index (every group
    has a learning signal)."""

    name = "alternating"

    def generate(self, split: str, n: int, seed: int) -> list[Item]:
        op = "+" if split == "train" else "*"
        return [Item(f"{split}-{i}", f"{i % 19} {op} 1 ?", str(i % 19 + (op == "+"))) for i in range(n)]

    def score(self, item: Item, answer: str) -> float:
        return float(answer.strip() == item.answer)

    def reward(self, item, trace) -> float:
        return float(trace.meta["sample"] % 2)


def _graph(model: Path):
    text = f"""\
name: tiny
policies:
  main: {{model: "{model}", adapter: answer, trainable: true, sampling: {{temperature: 1.0, max_tokens: 4}}}}
nodes:
  answer: {{role: generator, policy: main, prompt: direct}}
entry: answer
exit: answer
train: {{steps: 2, queries_per_step: 2, eval_every: 1, eval_n: 2, checkpoint_every: 10, seed: 3, concurrency: 8,
         flow_grpo: {{group_size: 4, lr: 0.05}}}}
"""
    return compile_spec(parse_spec(text, "tiny.yaml"))


def test_the_train_loop_needs_only_complete_aclose_and_publish_of_its_backend(tiny, tmp_path):
    torch.manual_seed(3)
    learner = HFLearner(str(tiny), dtype="float32")
    remote = Remote(tiny)
    events = ListSink()
    loop = TrainLoop(_graph(tiny), Alternating(), tmp_path / "run", learner=learner, backend=remote, sinks=[events])
    assert loop.eval_backend is remote and remote.published == [("answer", 0)]
    asyncio.run(loop.run())
    assert remote.published == [("answer", 0), ("answer", 1), ("answer", 2)]
    steps = {e.step: e.metrics for e in events.events if isinstance(e, TrainStep)}
    assert sorted(steps) == [0, 1, 2]
    # step 2 rolled out on the published v1 weights: its recorded logprobs are the learner's (ratio 1, on-policy)
    assert steps[2]["rows/trained"] > 0 and steps[2]["kl/old_k3"] < 1e-6 and steps[2]["loss/clip_frac"] == 0
    theirs = {n: p for n, p in remote._server.model.named_parameters() if ".answer." in n}
    assert [torch.equal(a, b) for a, b in zip(learner.parameters("answer"), theirs.values())] == [True] * len(theirs)


def test_trainers_do_not_reach_into_backend_internals():
    root = Path(__file__).resolve().parents[3] / "trainers"
    for path in root.glob("*.py"):
        text = path.read_text()
        for internal in ("backend.model", "backend.pad_id", "backend.versions", "backend._rng",
                         "backend.deterministic", "backend.dtype", "backend.add_adapter", "backend.load_adapter"):
            assert internal not in text, f"{path.name} uses {internal}"


def test_metrics_sink_writes_one_flushed_line_per_train_step(tmp_path):
    sink = MetricsSink(tmp_path / "metrics.jsonl")
    sink.emit(TrainStep(step=0, metrics={"accuracy/test": 0.25}))
    sink.emit(EvalFinished(step=1, metrics={"accuracy/test": 0.5}))  # only train steps are metrics lines
    sink.emit(TrainStep(step=1, metrics={"reward/mean": 0.5, "loss/total": -0.1}))
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x) for x in lines] == [{"step": 0, "accuracy/test": 0.25},
                                             {"step": 1, "reward/mean": 0.5, "loss/total": -0.1}]


def test_masgraph_train_prints_progress_from_train_step_events():
    import io

    from masgraph.cli import TrainProgress

    out = io.StringIO()
    progress = TrainProgress(steps=2, out=out)
    progress.emit(TrainStep(step=0, metrics={"accuracy/test": 0.25}))
    progress.emit(EvalFinished(step=0, metrics={"accuracy/test": 0.25}))  # not a progress line
    progress.emit(TrainStep(step=1, metrics={"reward/mean": 0.5, "tokens_per_s": 10.0, "time/train_s": 60.0}))
    assert out.getvalue().splitlines() == [
        "step 0/2  (untrained)  acc(test) 0.250",
        "step 1/2  reward 0.500  acc(train) 0.000  kl 0.0000  loss +0.0000  rows 0 (each group scored alike: "
        "no update)  10.0 tok/s  1.0 min"]
