"""Data-parallel Flow-GRPO across processes (`masgraph.learn.data_parallel`, `masgraph.cli.learners`): two gloo
ranks, each computing its share of a step's rows, take the optimizer step one process takes on all of them; a rank
killed or hung mid-update stops the other with one error line; `masgraph train --learners 2` trains and resumes as
one learner does, and its checkpoint resumes with one learner too. The model is the unit tests' tiny random Llama
(not the embedded one); marked integration and slow for the slow tier: each test starts 2-3 Python processes (about
a minute each on a busy 2-core machine)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from masgraph.learn.data_parallel import token_shards
from masgraph.trace import LLMCall, Step, Trace
from masgraph.trainers.flow_grpo import Row

pytestmark = [pytest.mark.integration, pytest.mark.slow]

HERE = Path(__file__).resolve().parent
PER_RANK = {"rows/sequences", "rows/tokens_received", "rows/tokens_computed"}
"""The learner's packing counts (`pack_stats`): what this rank's own forward passes computed."""


def _module(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


dp_rank = _module("dp_rank", HERE / "dp_rank.py")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """The unit tests' tiny random Llama (tests/unit/conftest.py), built here the same way."""
    return _module("unit_conftest", HERE.parent / "unit" / "conftest.py").tiny.__wrapped__(tmp_path_factory)


def _traces(model: str, head: bool = False) -> list[Trace]:
    """One group of 4 trajectories: a planner call each (long rows), and a short verifier call in the first only,
    with logprobs recorded under the adapters as the update starts (ratios start at 1, so nothing is clipped)."""
    learn = dp_rank.learner(model, 0, head)
    prompts = [[1, 4, 5, 6, 7, 8, 9], [1, 4, 5, 6, 10, 11], [1, 4, 5, 12, 13], [1, 4, 14]]
    completions = [[16, 17, 18, 19, 2], [20, 21, 22, 2], [23, 24, 25, 2], [26, 27, 2]]
    traces = []
    for i, (reward, prompt, completion) in enumerate(zip([1.0, 0.0, 1.0, 0.5], prompts, completions)):
        calls = [("planner", "plan", prompt, completion)] + ([("verifier", "check", [1, 5], [29, 2])] if i == 0 else [])
        steps = []
        for k, (node, adapter, p, c) in enumerate(calls):
            with torch.no_grad():
                [lp] = learn.sequence_logprobs([Row(i, node, adapter, p, c, [], 0.0, 0)], adapter)
            call = LLMCall(policy=node, adapter=adapter, prompt_ids=p, completion_ids=c, logprobs=lp.tolist(),
                           text="x", temperature=1.0)
            steps.append(Step(episode_id=f"e{i}", index=k, node=node, role="planner", turn=1, llm=[call]))
        traces.append(Trace(episode_id=f"e{i}", item_id="q", query="q", steps=steps, reward=reward))
    return traces


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(model: Path, traces: Path, out: Path, seeds: list[int], sleep_s: list[float] | None = None,
           env_extra: dict[str, str] | None = None, **kw) -> list[subprocess.Popen]:
    """One dp_rank.py process per seed, started as torchrun would (env:// rendezvous on localhost)."""
    port, sleep_s = _free_port(), sleep_s or [-1.0] * len(seeds)
    procs = []
    for rank, seed in enumerate(seeds):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(len(seeds)),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", **(env_extra or {})}
        procs.append(subprocess.Popen([sys.executable, str(HERE / "dp_rank.py"), str(model), str(traces),
                                       str(out / f"rank{rank}.pt"), str(seed), str(sleep_s[rank])], env=env, **kw))
    return procs


def _ranks(model: Path, traces: Path, out: Path, seeds: list[int], timeout: float = 180) -> list[int]:
    """Run one dp_rank.py process per seed to the end; their exit codes."""
    return [p.wait(timeout) for p in _start(model, traces, out, seeds)]


@pytest.mark.parametrize("shard", [False, True], ids=["replicated", "fsdp2"])
def test_two_gloo_ranks_take_the_step_one_process_takes(tiny, tmp_path, shard):
    """Replicated: each rank holds the whole base and the gradients are all-reduced. FSDP2: the decoder layers
    (adapters included) are split across the ranks, and with one row per pass over 2 mini-batches x 2 epochs the
    ranks hold different numbers of passes (rank 1 none of the verifier's): every rank runs as many as the other;
    LoRA on the output head (outside the layers) is whole on each rank and its gradients summed; rank 0 saves the
    gathered adapters."""
    traces = _traces(str(tiny), head=shard)
    (tmp_path / "traces.jsonl").write_text("".join(t.model_dump_json() + "\n" for t in traces))
    # rank 1 never holds a verifier ("check") row: its share is the two middle-length planner rows
    lengths = [len(c.prompt_ids) + len(c.completion_ids) for t in traces for s in t.steps for c in s.llm]
    assert lengths == [12, 4, 10, 9, 6] and token_shards(lengths, 2) == [[0, 1, 4], [2, 3]]
    one = dp_rank.trainer(dp_rank.learner(str(tiny), 0, head=shard), passes=shard)
    metrics = one.update(traces, seed="0:0")
    want = dp_rank.snapshot(one, metrics)

    env = {"DP_SHARD": "1", "DP_HARD": "1"} if shard else {}
    procs = _start(tiny, tmp_path / "traces.jsonl", tmp_path, seeds=[0, 1], env_extra=env)  # rank 1 starts elsewhere
    assert [p.wait(180) for p in procs] == [0, 0]
    for rank in (0, 1):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for a in ("check", "plan"):
            for g, w in zip(got["grads"][a], want["grads"][a]):
                # fp32 (eps 1.2e-7): each rank's forward passes hold other rows (other packing, other batch shapes)
                # and the gradient is a sum of two partial sums, which moves the last bits of each token's term;
                # measured here up to 7e-7 of a tensor's largest entry. 1e-5 of it: a lost rank's share is ~50%
                assert torch.allclose(g, w, rtol=1e-4, atol=1e-5 * w.abs().max().item()), (rank, a)
            for p, w in zip(got["params"][a], want["params"][a]):
                # Adam's first step is lr * g / (|g| + eps), ~lr per element whatever the gradient's scale, and
                # sensitive where |g| nears eps (1e-8): measured up to 1.6e-4 lr (an entry with g = 2.5e-7); 1e-3 lr
                assert torch.allclose(p, w, rtol=0, atol=1e-3 * dp_rank.LR), (rank, a)
        assert got["sharded"] == shard
        assert got["metrics"].keys() == want["metrics"].keys()
        for k in want["metrics"].keys() - PER_RANK:  # loss, KL, clip fraction, grad norms: over both ranks' rows
            assert got["metrics"][k] == pytest.approx(want["metrics"][k], rel=1e-5, abs=1e-9), (rank, k)
    if shard:  # what rank 0 saved after the update: the whole adapters, gathered from both ranks' shards
        from safetensors.torch import load_file

        got = torch.load(tmp_path / "rank0.pt")
        for a in ("check", "plan"):
            saved = load_file(tmp_path / "rank0.pt.adapters" / a / "adapter_model.safetensors")
            names = [n.replace(f".{a}.", ".") for n in got["names"][a]]  # peft saves them without the adapter's name
            assert sorted(saved) == sorted(names) and len(names) == len(got["params"][a])
            assert all(torch.equal(saved[n], p) for n, p in zip(names, got["params"][a])), a


@pytest.mark.parametrize("fault", ["killed", "hung"])
def test_a_rank_killed_or_hung_mid_update_stops_the_other_with_one_error_line(tiny, tmp_path, fault):
    (tmp_path / "traces.jsonl").write_text("".join(t.model_dump_json() + "\n" for t in _traces(str(tiny))))
    timeout_s = 60 if fault == "killed" else 30  # the group's: how long a silent rank is waited for
    rank0, rank1 = _start(tiny, tmp_path / "traces.jsonl", tmp_path, seeds=[0, 0], sleep_s=[0, 600],
                          stderr=subprocess.PIPE, text=True, env_extra={"DP_TIMEOUT_S": str(timeout_s)})
    try:
        t0 = time.monotonic()
        while not all((tmp_path / f"rank{r}.pt.busy").exists() for r in (0, 1)):  # both reached the all-reduce
            assert time.monotonic() - t0 < 240 and rank0.poll() is None and rank1.poll() is None
            time.sleep(0.2)
        time.sleep(1.0)  # rank 0 waits inside it for rank 1, which stalls before joining
        if fault == "killed":
            rank1.send_signal(signal.SIGKILL)
        since = time.monotonic()
        code = rank0.wait(90)  # killed: its connections close, seen at once; hung: the group's timeout
        waited = time.monotonic() - since
    finally:
        rank1.kill()
    errors = [line for line in rank0.stderr.read().splitlines() if line.startswith("error:")]
    assert code == 1 and waited < (20 if fault == "killed" else timeout_s + 20), waited
    assert len(errors) == 1 and "learner rank 0 of 2" in errors[0] and "rank 1 stopped" in errors[0], errors
    assert "gradient all-reduce" in errors[0]
    assert not (tmp_path / "rank0.pt").exists()  # no half-updated adapters were saved


GRAPH = """\
name: one-node
policies:
  main: {{model: "{model}", adapter: answer, trainable: true, dtype: float32,
         sampling: {{temperature: 1.0, max_tokens: 4}}}}
nodes:
  answer: {{role: generator, policy: main, prompt: direct}}
entry: answer
exit: answer
train: {{steps: 1, queries_per_step: 2, eval_every: 0, eval_n: 1, seed: 3, flow_grpo: {{group_size: 2, lr: 0.01}}}}
"""
"""fp32 weights, as the tolerances above assume: in bf16 (`auto` where it measures faster, as on this project's 2-core
machines at one thread) one rank's and two ranks' packings round differently, ~3e-4 of a moment's largest entry."""
ALTERNATING = ("from masgraph.tasks import BasicArithmetic\n\n\nclass Alternating(BasicArithmetic):\n"
               "    name = 'alternating'\n\n    def reward(self, item, trace):\n"
               "        return float(trace.meta['sample'] % 2)\n")  # every group informative


def _same_step(one_run: Path, two_run: Path, step: int) -> None:
    """The two runs' checkpoints of `step` hold the same Adam moments and adapters, and their metrics of it agree.

    The moments are linear in the gradients and compared as the gradients are above (1e-5 of a tensor's largest
    entry; a lost rank's share is ~50%). The weights are Adam's steps, lr * m / (sqrt(v) + eps), which turn the fp32
    noise of an entry whose gradient cancels to ~eps (1e-8; this tiny model's LoRA-A gradients are 1e-9..1e-5) into
    differences of up to ~lr/10, as the sampled rows happen to fall (one run in CI: > 1e-3 lr; locally 1e-4 lr): so
    99% of each tensor's entries within 1e-3 lr, as above, and every entry within the 2 lr one sign flip moves."""
    from safetensors.torch import load_file

    ckpts = [run / "checkpoints" / f"step-{step}" for run in (one_run, two_run)]
    want, got = [load_file(next(c.rglob("adapter_model.safetensors"))) for c in ckpts]
    assert want.keys() == got.keys()
    for k in want:
        off = (got[k] - want[k]).abs()
        assert float((off <= 1e-3 * dp_rank.LR).float().mean()) >= 0.99 and float(off.max()) <= 2 * dp_rank.LR, k
    assert any("lora_B" in k and want[k].abs().max() > 0 for k in want)  # the steps moved B off its zero init
    m_want, m_got = [torch.load(c / "optimizer.pt")["answer"]["state"] for c in ckpts]
    assert m_want.keys() == m_got.keys() and m_want
    for i in m_want:
        for moment in ("exp_avg", "exp_avg_sq"):
            w, g = m_want[i][moment], m_got[i][moment]
            assert torch.allclose(g, w, rtol=1e-4, atol=1e-5 * w.abs().max().item()), (step, i, moment)
    m1, m2 = [next(m for line in (r / "metrics.jsonl").read_text().splitlines() if (m := json.loads(line))["step"]
                   == step) for r in (one_run, two_run)]
    assert m2["rows/trained"] == m1["rows/trained"] > 0
    for k in ("loss/total", "loss/policy", "kl/ref_k3", "grad_norm/answer"):  # the loss sums +-A: near 0 here
        assert m2[k] == pytest.approx(m1[k], rel=1e-5, abs=1e-6), (step, k)


def test_masgraph_train_with_two_learners_trains_and_resumes_as_one_learner_does(tiny, tmp_path):
    """Replicated and with the base sharded (`--shard`): each step equals one learner's, resumed with 2 ranks or 1."""
    (tmp_path / "g.yaml").write_text(GRAPH.format(model=tiny))
    (tmp_path / "alt.py").write_text(ALTERNATING)
    args = ["train", str(tmp_path / "g.yaml"), "--task", f"{tmp_path / 'alt.py'}:Alternating", "--device", "cpu"]
    # one learner in its own process too, at rank 0's one thread (other thread counts give other fp32 sums, other
    # samples). On a fresh machine the first of these runs measures bf16 vs fp32 (`pick_dtype`), which once drew on
    # torch's global RNG between the seed and the LoRA init: CI's two runs started 0.35 apart (test_dtype_choice)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def learners(n: int, *more: str) -> subprocess.CompletedProcess:
        done = subprocess.run([sys.executable, "-m", "masgraph", *args, *more, "--learners", str(n)], env=env,
                              capture_output=True, text=True, timeout=400)
        assert done.returncode == 0, done.stderr[-3000:]
        return done

    learners(1, "--runs-dir", str(tmp_path / "one"))
    two = learners(2, "--runs-dir", str(tmp_path / "two"))
    assert two.stdout.count("done: 1 steps") == 1  # rank 0 alone reports, and alone made a run directory
    # and with the base's decoder layers sharded across the two ranks (FSDP2; rollouts on a copy of the base)
    learners(2, "--shard", "--runs-dir", str(tmp_path / "sharded"))
    [one_run], [two_run] = list((tmp_path / "one").iterdir()), list((tmp_path / "two").iterdir())
    [sharded_run] = list((tmp_path / "sharded").iterdir())
    _same_step(one_run, two_run, 1)
    _same_step(one_run, sharded_run, 1)
    sharded_then_one = tmp_path / "sharded-then-one" / sharded_run.name
    shutil.copytree(sharded_run, sharded_then_one)
    two_then_sharded = tmp_path / "two-then-sharded" / two_run.name
    shutil.copytree(two_run, two_then_sharded)
    # resumed with 2 learners again (rank 1 loads the checkpoint too): the next step is the one learner's next step;
    # and the two learners' checkpoint resumed by one learner (another rank count): the same step again
    two_then_one = tmp_path / "two-then-one" / two_run.name
    shutil.copytree(two_run, two_then_one)
    learners(1, "--resume", str(one_run), "--steps", "2")
    learners(1, "--resume", str(two_then_one), "--steps", "2")
    assert learners(2, "--resume", str(two_run), "--steps", "2").stdout.count("done: 2 steps") == 1
    _same_step(one_run, two_run, 2)
    _same_step(one_run, two_then_one, 2)
    # the sharded run resumed sharded (each rank loads its shards), its checkpoint resumed by one learner, and the
    # replicated run's resumed sharded
    learners(2, "--shard", "--resume", str(sharded_run), "--steps", "2")
    learners(1, "--resume", str(sharded_then_one), "--steps", "2")
    learners(2, "--shard", "--resume", str(two_then_sharded), "--steps", "2")  # and a replicated run's, sharded
    _same_step(one_run, sharded_run, 2)
    _same_step(one_run, sharded_then_one, 2)
    _same_step(one_run, two_then_sharded, 2)


def test_learner_ranks_on_an_empty_cache_load_the_dtype_rank_0_measured(tiny, tmp_path):
    """`dtype: auto` under `--learners 2`, on a machine that has not measured yet: rank 0 measures (once; the choice
    is cached) and broadcasts it, and the run trains in it (`masgraph.cli.learners.agreed_dtype`)."""
    (tmp_path / "g.yaml").write_text(GRAPH.format(model=tiny).replace("dtype: float32,", "dtype: auto,"))
    (tmp_path / "alt.py").write_text(ALTERNATING)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASGRAPH_CACHE": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-m", "masgraph", "train", str(tmp_path / "g.yaml"), "--task",
                           f"{tmp_path / 'alt.py'}:Alternating", "--device", "cpu", "--learners", "2", "--runs-dir",
                           str(tmp_path / "runs")], env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0 and done.stdout.count("done: 1 steps") == 1, done.stderr[-3000:]
    [(key, choice)] = json.loads((tmp_path / "cache" / "dtype-choice.json").read_text()).items()
    assert key.endswith("|1") and f"learner on cpu, {choice}" in done.stderr
    [run] = list((tmp_path / "runs").iterdir())
    assert json.loads((run / "checkpoints" / "step-1" / "state.json").read_text())["dtype"] == choice


def _train_args(tmp_path: Path, model: Path, steps: int) -> list[str]:
    """`masgraph train --learners 2` of GRAPH for `steps` steps (a checkpoint each), with its files in `tmp_path`."""
    (tmp_path / "g.yaml").write_text(GRAPH.format(model=model).replace("steps: 1,",
                                                                       f"steps: {steps}, checkpoint_every: 1,"))
    (tmp_path / "alt.py").write_text(ALTERNATING)
    return [sys.executable, "-m", "masgraph", "train", str(tmp_path / "g.yaml"), "--task",
            f"{tmp_path / 'alt.py'}:Alternating", "--device", "cpu", "--learners", "2"]


@pytest.fixture(scope="module")
def two_steps(tiny, tmp_path_factory) -> Path:
    """An uninterrupted 2-step `masgraph train --learners 2` run (replicated): its run directory."""
    tmp = tmp_path_factory.mktemp("whole")
    done = subprocess.run([*_train_args(tmp, tiny, 2), "--runs-dir", str(tmp / "runs")], capture_output=True,
                          text=True, timeout=400, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    [run] = list((tmp / "runs").iterdir())
    return run


@pytest.mark.parametrize("shard", [False, True], ids=["replicated", "fsdp2"])
def test_a_rank_killed_mid_update_under_masgraph_train_stops_it_and_the_run_resumes_exactly(tiny, tmp_path, shard,
                                                                                           two_steps):
    """`masgraph train --learners 2 [--shard]`, rank 1 SIGKILLed in step 2's update while rank 0 waits in a
    collective (the gradient all-reduce; sharded: a layer's all-gather): the command ends within 60 s with rank 0's
    error line naming the last checkpoint and the launcher's line naming the killed rank, no traceback; `--resume`
    then takes the step the uninterrupted run took."""
    args = [*_train_args(tmp_path, tiny, 2), *(["--shard"] if shard else [])]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    stall = {**env, "PYTHONPATH": os.pathsep.join([str(HERE / "stall_rank"), env.get("PYTHONPATH", "")]),
             "STALL_DIR": str(tmp_path)}
    killed = subprocess.Popen([*args, "--runs-dir", str(tmp_path / "killed")], env=stall, stderr=subprocess.PIPE,
                              stdout=subprocess.DEVNULL, text=True)
    try:
        t0 = time.monotonic()
        while not (tmp_path / "stalled").exists():  # rank 1 is in step 2's update; rank 0 waits for it
            assert time.monotonic() - t0 < 300 and killed.poll() is None
            time.sleep(0.2)
        time.sleep(1.0)
        os.kill(int((tmp_path / "stalled").read_text()), signal.SIGKILL)
        since = time.monotonic()
        code = killed.wait(90)
        waited = time.monotonic() - since
    finally:
        killed.kill()
    err = killed.stderr.read()
    [run] = list((tmp_path / "killed").iterdir())
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 1 and waited < 60 and "Traceback" not in err, err[-3000:]
    what = "sharded update" if shard else "gradient all-reduce"
    assert len(errors) == 2 and f"learner rank 0 of 2: the {what} failed" in errors[0], errors
    assert f"the last checkpoint is {run}/checkpoints/step-1; resume with --resume {run}" in errors[0]
    assert errors[1] == "error: learner rank 1 was killed (SIGKILL); the other ranks were stopped"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step-1"]
    done = subprocess.run([*args, "--resume", str(run)], env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0 and "done: 2 steps" in done.stdout, done.stderr[-3000:]
    _same_step(two_steps, run, 2)


def test_ray_launched_learners_train_as_one_learner_does(tiny, tmp_path):
    """`masgraph train --ray --learners 2`: rank 1 is a Ray task beside the rollout worker (rank 0 is this
    command), and the step equals one learner's with the same Ray rollouts (deterministic: the rollouts repeat)."""
    (tmp_path / "g.yaml").write_text(GRAPH.format(model=tiny).replace("seed: 3,", "seed: 3, deterministic: true,"))
    (tmp_path / "alt.py").write_text(ALTERNATING)
    args = [sys.executable, "-m", "masgraph", "train", str(tmp_path / "g.yaml"), "--task",
            f"{tmp_path / 'alt.py'}:Alternating", "--device", "cpu", "--ray", "--workers", "1", "--address", "local"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    runs = {}
    for learners in (1, 2):
        done = subprocess.run([*args, "--learners", str(learners), "--runs-dir", str(tmp_path / str(learners))],
                              env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.count("done: 1 steps") == 1
        assert ("learner rank(s) as Ray tasks" in done.stderr) == (learners == 2)
        [runs[learners]] = list((tmp_path / str(learners)).iterdir())  # rank 1 made no run directory
    _same_step(runs[1], runs[2], 1)

    # a rank that fails before the ranks meet: rank 0 says so and stops (not after --learner-timeout's 30 minutes)
    (tmp_path / "bad.py").write_text("import os\nif os.environ.get('RANK') == '1':\n"
                                     "    raise SystemExit('rank 1 cannot load this task')\n" + ALTERNATING)
    t0 = time.monotonic()
    done = subprocess.run([*args[:6], f"{tmp_path / 'bad.py'}:Alternating", *args[7:], "--learners", "2",
                           "--runs-dir", str(tmp_path / "bad")], env=env, capture_output=True, text=True, timeout=600)
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 1 and time.monotonic() - t0 < 300, done.stderr[-3000:]
    assert errors == ["error: learner rank 1 (a Ray task) ended before the ranks met (exit 1: rank 1 cannot load "
                      "this task); rank 0 stops"]

