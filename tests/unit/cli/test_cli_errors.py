"""The CLI turns every user mistake into one `error:` line (never a traceback, never a model load first), and an
interrupted run (Ctrl-C or SIGTERM) still writes a summary that counts the episodes that finished."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from masgraph.backends.scripted import ScriptedBackend
from masgraph.cli import main
from masgraph.graph import GraphBuilder
from masgraph.runtime.runner import RunConfig, Runner
from masgraph.tasks import Item, Task

SCRIPTED_GRAPH = ("name: s\npolicies:\n  main: {backend: scripted}\n"
                  "nodes:\n  answer: {role: generator, policy: main}\nentry: answer\nexit: answer\n")

ENTRY = '''
import signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)  # a shell's background job starts with SIGINT ignored
from masgraph.backends.scripted import ScriptedBackend
from masgraph.cli import run_with_progress
from masgraph.graph import GraphBuilder
from masgraph.runtime.runner import RunConfig, Runner
from masgraph.tasks import Item, Task

class Ones(Task):
    name = "ones"
    def generate(self, split, n, seed):
        return [Item(f"{split}-{i}", f"What is {i} - {i - 1}?", "1") for i in range(n)]
    def score(self, item, answer):
        return float(answer.strip() == item.answer)

graph = GraphBuilder("slow").add_policy("main", backend="scripted").add_node("answer", role="generator",
                                                                             policy="main").compile()
runner = Runner(graph, RunConfig(n=400, concurrency=2, runs_dir=sys.argv[1]),
                backends={"scripted": ScriptedBackend(default="Answer: 1", delay_s=0.1)})
sys.exit(run_with_progress(runner, Ones(), Ones().items("test", 400)))  # 20 s: signalled long before
'''


class Ones(Task):
    name = "ones"

    def generate(self, split, n, seed):
        return [Item(f"{split}-{i}", f"What is {i} - {i - 1}?", "1") for i in range(n)]

    def score(self, item, answer):
        return float(answer.strip() == item.answer)


@pytest.fixture
def graph_file(tmp_path):
    """A graph whose policy is scripted: nothing loads a model, so a check that comes too late fails fast."""
    path = tmp_path / "s.yaml"
    path.write_text(SCRIPTED_GRAPH)
    return str(path)


@pytest.mark.parametrize("args, message", [
    (["--n", "0"], "argument --n: expected a whole number from 1 to 1,000,000, got '0'"),
    (["--n", "-5"], "argument --n: expected a whole number from 1 to 1,000,000, got '-5'"),
    (["--n", "99999999999999999999999"], "argument --n: expected a whole number from 1 to 1,000,000"),  # HEAD:
    # OverflowError traceback from the task's range()
    (["--samples", "0"], "argument --samples: expected a whole number >= 1"),
    (["--concurrency", "0"], "argument --concurrency: expected a whole number >= 1"),  # HEAD: hangs (after load)
    (["--concurrency", "-1"], "argument --concurrency: expected a whole number >= 1"),
    (["--seed", "-1"], "argument --seed: expected a whole number >= 0"),
])
def test_run_counts_are_checked_at_parse_time(graph_file, capsys, args, message):
    with pytest.raises(SystemExit) as exit_:
        main(["run", graph_file, "--task", "basic_arithmetic", *args])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--steps", "0"], "argument --steps: expected a whole number >= 1"),
    (["--queries-per-step", "-2"], "argument --queries-per-step: expected a whole number >= 1"),
    (["--eval-n", "0"], "argument --eval-n: expected a whole number >= 1"),
    (["--eval-every", "-1"], "argument --eval-every: expected a whole number >= 0"),
    (["--minutes", "0"], "argument --minutes: expected a number > 0"),
    (["--minutes", "nan"], "argument --minutes: expected a number > 0"),
    (["--seed", "-3"], "argument --seed: expected a whole number >= 0"),
])
def test_train_counts_are_checked_at_parse_time(graph_file, capsys, args, message):
    with pytest.raises(SystemExit) as exit_:
        main(["train", graph_file, *args])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("n", [10**23, 1_000_001, -1])
def test_a_task_refuses_an_item_count_out_of_range(n):
    """Task.items (the trainers' path too, not only --n) names the allowed range before generating anything;
    HEAD: OverflowError from a reasoning-gym task's range(), endless generation for a user task."""
    from masgraph.errors import MasgraphError
    from masgraph.tasks import PartitionedTask

    class Unreachable(Task):
        def generate(self, split, n, seed):
            raise AssertionError(f"generate({split!r}, {n}) was called")

    class UnreachablePartitioned(PartitionedTask, Unreachable):
        pass

    for task in (Unreachable(), UnreachablePartitioned()):
        with pytest.raises(MasgraphError, match="from 0 to 1,000,000"):
            task.items("test", n)


@pytest.mark.parametrize("source, ref, message", [
    ("raise RuntimeError('no network')\n", "X", "failed to import: RuntimeError: no network (line 1)"),
    ("x = (\n", "X", "failed to import: SyntaxError"),
    (None, "X", "not found; pass an existing FILE.py:ClassName"),
    ("from masgraph.tasks import Task\nclass A(Task):\n    name = 'a'\n", "B",
     "(it is not defined there); name one of: A"),
    ("Y = 3\n", "Y", "(it is not a class); subclass Task and implement generate() and score()"),
])
def test_bad_task_files_are_one_error_line(graph_file, tmp_path, capsys, source, ref, message):
    task_file = tmp_path / "mytasks.py"
    if source is not None:
        task_file.write_text(source)
    assert main(["run", graph_file, "--task", f"{task_file}:{ref}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and str(task_file) in err and "Traceback" not in err


def test_garbage_checkpoint_is_an_error_line_before_any_model_loads(graph_file, tmp_path, capsys):
    (tmp_path / "ckpt").write_text("not a directory")
    assert main(["run", graph_file, "--task", "basic_arithmetic", "--checkpoint", str(tmp_path / "ckpt")]) == 2
    assert "error: checkpoint" in capsys.readouterr().err  # HEAD: the scripted backend's ValueError first


def test_resume_from_a_bad_state_json_is_an_error_line(root, tmp_path, capsys):
    step = tmp_path / "run" / "checkpoints" / "step-2"
    step.mkdir(parents=True)
    (step / "state.json").write_text('{"step": 2, "adap')  # killed mid-write by hand
    assert main(["train", str(root / "graphs" / "single.yaml"), "--resume", str(tmp_path / "run")]) == 2
    assert "unreadable state.json" in capsys.readouterr().err  # HEAD: JSONDecodeError traceback



def test_resume_from_a_checkpoint_with_a_foreign_dtype_is_an_error_line(root, tmp_path, capsys):
    step = tmp_path / "run" / "checkpoints" / "step-2"
    (step / "adapters" / "solver").mkdir(parents=True)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (step / "adapters" / "solver" / name).write_text("{}")
    (step / "state.json").write_text('{"step": 2, "adapters": ["solver"], "dtype": "float99"}')
    assert main(["train", str(root / "graphs" / "single.yaml"), "--resume", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("loading") and "error: checkpoint" in err and "dtype 'float99'" in err
    assert "Traceback" not in err  # HEAD: the model loader's AttributeError (torch has no float99)

@pytest.mark.slow
def test_scripted_backend_from_the_cli_is_an_error_line(graph_file, capsys):
    assert main(["run", graph_file, "--task", "basic_arithmetic", "--n", "2"]) == 2
    err = capsys.readouterr().err
    assert "uses `backend: scripted`" in err and "backend: hf" in err  # HEAD: ValueError traceback


def test_an_os_error_on_a_user_path_is_an_error_line(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.5}\n')
    out = tmp_path / "no-such-dir" / "curve.png"
    assert main(["plot", str(tmp_path), "--out", str(out)]) == 2
    assert "error: No such file or directory" in capsys.readouterr().err  # HEAD: FileNotFoundError traceback


def test_serve_with_an_unusable_conversations_dir_is_an_error_line_before_the_model_loads(root, tmp_path, capsys,
                                                                                          free_port):
    (tmp_path / "file").write_text("")
    code = main(["serve", str(root / "graphs" / "memory.yaml"), "--no-store", "--port", str(free_port()),
                 "--conversations", str(tmp_path / "file" / "conv")])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: cannot use") and "loading" not in err, err


@pytest.mark.slow
def test_a_cancelled_run_summary_counts_what_finished(tmp_path):
    graph = GraphBuilder("g").add_policy("main", backend="scripted").add_node("answer", role="generator",
                                                                               policy="main").compile()
    runner = Runner(graph, RunConfig(concurrency=2, runs_dir=str(tmp_path)),
                    backends={"scripted": ScriptedBackend(default="Answer: 1", delay_s=0.02)})

    async def cancel_midway():
        task = asyncio.ensure_future(runner.run_items(Ones(), Ones().items("test", 20)))
        while _finished(tmp_path) < 4 and not task.done():
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_midway())
    [run_dir] = tmp_path.iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary == runner.last_result.summary
    assert summary["episodes"] >= 4 and summary["accuracy"] == 1.0  # HEAD: {"episodes": 0, ...}
    assert summary["cancelled"] == 20 - summary["episodes"] > 0 and summary["interrupted"] is True


@pytest.mark.slow
@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signalled_cli_run_stops_cleanly_with_a_summary(tmp_path, sig, code):
    (tmp_path / "entry.py").write_text(ENTRY)
    runs = tmp_path / "runs"
    proc = subprocess.Popen([sys.executable, str(tmp_path / "entry.py"), str(runs)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + 120
    while _finished(runs) < 3 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err
    [run_dir] = runs.iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())  # HEAD (SIGTERM): no summary.json
    assert summary["interrupted"] is True and 3 <= summary["episodes"] < 400
    assert summary["episodes"] + summary["cancelled"] == 400 and summary["episodes"] >= _finished(runs) - 2
    assert f"interrupted: {summary['episodes']} episodes finished" in err and "Traceback" not in err
    assert f"run dir  {run_dir}" in out


def _finished(runs) -> int:
    files = list(runs.glob("*/events.jsonl"))
    return files[0].read_text().count('"episode_finished"') if files else 0


@pytest.mark.parametrize("graph, args, message", [
    ("agentflow", ["--algorithm", "nope"], "training algorithm 'nope' is not registered; use one of"),
    ("agentflow", ["--algorithm", "hrpo"], "learns the graph's topology, but the graph has no `topology:` section"),
    ("mixed_router", ["--algorithm", "hrpo", "--resume", "runs/x"], "--algorithm cannot change a resumed run's"),
    ("mixed_router", ["--algorithm", "flow_grpo", "--steps", "0"], "argument --steps"),
])
def test_train_algorithm_override_is_checked_before_any_model_loads(root, capsys, graph, args, message):
    try:
        code = main(["train", str(root / "graphs" / f"{graph}.yaml"), *args])
    except SystemExit as exit_:  # argparse
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err


def test_train_algorithm_override_keeps_the_shared_knobs(root):
    import argparse

    from masgraph.cli import train_graph
    from masgraph.graph import compile_spec
    from masgraph.loader import load_spec
    from masgraph.registry import default_registry

    graph = compile_spec(load_spec(root / "graphs" / "mixed_router.yaml"))
    assert graph.spec.train.algorithm == "joint" and graph.spec.train.schedule == "staged"
    none = dict.fromkeys(["steps", "task", "queries_per_step", "eval_n", "eval_every", "seed", "minutes", "resume",
                          "report_to"])
    args = argparse.Namespace(**none, graph="mixed_router.yaml", algorithm="hrpo")
    train = train_graph(graph, default_registry(), args).spec.train
    assert train.algorithm == "hrpo" and not hasattr(train, "schedule")  # joint's own knob is dropped
    assert train.task == "mixed_routes" and train.hrpo.omega == 0.5 and train.eval_n == graph.spec.train.eval_n
    args.algorithm, args.steps = "flow_grpo", 3
    train = train_graph(graph, default_registry(), args).spec.train
    assert train.algorithm == "flow_grpo" and train.steps == 3 and train.flow_grpo.lr == 0.001
    args.algorithm = None
    assert train_graph(graph, default_registry(), args).spec.train.algorithm == "joint"


def test_validate_refuses_a_graph_file_over_the_size_cap_without_reading_it(tmp_path, capsys):
    big = tmp_path / "big.yaml"
    with open(big, "wb") as f:
        f.truncate((16 << 20) + 1)  # sparse: no disk
    assert main(["validate", str(big)]) == 1
    err = capsys.readouterr().err
    assert "the file is larger than 16 MiB, the most a graph file may be" in err and "Traceback" not in err


@pytest.mark.slow
def test_validate_dev_zero_is_an_error_not_a_memory_error(tmp_path):
    """HEAD read /dev/zero whole: MemoryError traceback (here under a 1 GiB address-space limit, so a regression
    fails fast instead of eating the machine's memory)."""
    import resource

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))

    p = subprocess.run([sys.executable, "-m", "masgraph.cli", "validate", "/dev/zero"], capture_output=True,
                       text=True, timeout=120, preexec_fn=limit)
    assert p.returncode == 1 and "larger than 16 MiB" in p.stderr and "Traceback" not in p.stderr, p.stderr


@pytest.mark.slow
def test_validate_checks_a_model_directory_and_run_stops_before_loading(tmp_path):
    """Issue 30, finding 10: validate passed a policy whose `model:` was an empty directory (run then failed after
    16 s of loading), and a directory that does not exist was 'not installed'. Each is now a located problem."""
    graph = "name: m\npolicies:\n  main: {model: %s}\nnodes:\n  answer: {role: generator, policy: main}\n" \
            "entry: answer\nexit: answer\n"
    (tmp_path / "empty").mkdir()
    (tmp_path / "nojson").mkdir()
    (tmp_path / "nojson" / "weights.gguf").write_text("x")
    (tmp_path / "noweights").mkdir()
    (tmp_path / "noweights" / "config.json").write_text("{}")
    (tmp_path / "ok").mkdir()
    (tmp_path / "ok" / "config.json").write_text("{}")
    (tmp_path / "ok" / "model.safetensors").write_text("")
    (tmp_path / "a_file").write_text("")
    cases = {"empty": "model directory './empty' is empty",
             "missing": "model directory './models/missing' does not exist (relative to the current directory",
             "bare": "model 'qwen7b' is not installed: it is not an embedded model, and no directory of that name",
             "file": "model './a_file' is a file, not a model directory",
             "nojson": "model directory './nojson' has no config.json",
             "noweights": "model directory './noweights' has config.json but no weights"}
    models = {"empty": "./empty", "missing": "./models/missing", "bare": "qwen7b", "file": "./a_file",
              "nojson": "./nojson", "noweights": "./noweights", "ok": "./ok"}
    for name, model in models.items():
        (tmp_path / f"{name}.yaml").write_text(graph % model)
    p = subprocess.run([sys.executable, "-m", "masgraph.cli", "validate", *(f"{n}.yaml" for n in models)],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert p.returncode == 1 and p.stdout == "ok  ok.yaml  (1 node, 0 edges)\n", (p.stdout, p.stderr)
    for name, message in cases.items():
        assert f"{name}.yaml:3:10: policies.main.model: {message}" in p.stderr, (name, p.stderr)
    assert p.stderr.count("not installed") == 1 and "Traceback" not in p.stderr  # the bare name only

    t0 = time.perf_counter()  # run: the same located error, before anything loads, and no run dir
    p = subprocess.run([sys.executable, "-m", "masgraph.cli", "run", "empty.yaml", "--task", "basic_arithmetic",
                        "--n", "1", "--runs-dir", "runs"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert p.returncode == 2 and "empty.yaml:3:10: policies.main.model: model directory './empty' is empty" \
        in p.stderr and "loading" not in p.stderr, p.stderr
    assert not (tmp_path / "runs").exists() or not list((tmp_path / "runs").iterdir())
    assert time.perf_counter() - t0 < 60
