"""A checkpoint is checked before anything loads from it (issue 58 #10-12): its state.json against a model of what
the loop writes, its adapters against its own directory and against the graph that will serve them, its position
against the run that resumes it. Each refusal is one `error:` line (or a MasgraphError), never a traceback."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from masgraph import load_agent
from masgraph.cli import main
from masgraph.errors import MasgraphError
from masgraph.rundir.checkpoint import checkpoint_adapters, checkpoint_states
from masgraph.trainers.checkpoints import Checkpoints


def _checkpoint(run: Path, step: int = 1, adapters: tuple[str, ...] = ("planner", "verifier"), **state: object) -> Path:
    """RUN/checkpoints/step-N with a state.json and an adapter directory (config and weights files) per adapter."""
    d = run / "checkpoints" / f"step-{step}"
    for name in adapters:
        (d / "adapters" / name).mkdir(parents=True)
        for f in ("adapter_config.json", "adapter_model.safetensors"):
            (d / "adapters" / name / f).write_text("{}")
    d.mkdir(parents=True, exist_ok=True)
    (d / "state.json").write_text(json.dumps({"step": step, "adapters": list(adapters),
                                              "versions": dict.fromkeys(adapters, step)} | state))
    return d


def _run(root: Path, checkpoint: Path, capsys) -> str:
    """`masgraph run graphs/agentflow.yaml --checkpoint ...`: its one error line (no model loads before it)."""
    code = main(["run", str(root / "graphs" / "agentflow.yaml"), "--task", "basic_arithmetic", "--n", "1",
                 "--checkpoint", str(checkpoint)])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and not err.startswith("loading"), err
    [line] = [x for x in err.splitlines() if x.startswith("error: ")]
    return line


def test_a_non_string_adapter_in_state_json_is_an_error_line(root, tmp_path, capsys):
    ck = _checkpoint(tmp_path / "run", adapters=("verifier",), versions={})
    state = json.loads((ck / "state.json").read_text())
    (ck / "state.json").write_text(json.dumps(state | {"adapters": [1, "verifier"]}))
    line = _run(root, ck, capsys)  # HEAD: TypeError traceback at checkpoint.py:84
    assert f"checkpoint {ck}: state.json has adapters.0 1 (input should be a valid string)" in line
    assert main(["train", str(root / "graphs" / "agentflow.yaml"), "--resume", str(tmp_path / "run")]) == 2
    assert "adapters.0 1" in capsys.readouterr().err
    with pytest.raises(MasgraphError, match="adapters.0 1"):  # what `serve --checkpoint` builds
        load_agent(root / "graphs" / "agentflow.yaml", checkpoint=ck)


@pytest.mark.parametrize("name", ["/etc", "../../outside", "..", "a/b"])
def test_an_adapter_name_that_is_a_path_is_refused(root, tmp_path, capsys, name):
    outside = tmp_path / "outside"  # an adapter someone placed beside the run
    (outside / "adapters").mkdir(parents=True)
    ck = _checkpoint(tmp_path / "run", adapters=("planner", "verifier"))
    state = json.loads((ck / "state.json").read_text())
    (ck / "state.json").write_text(json.dumps(state | {"adapters": ["planner", name]}))
    line = _run(root, ck, capsys)  # HEAD: /etc or ../../outside loaded as adapter directories
    assert f"adapters.1 {name!r} (value error, not an adapter name" in line


def test_an_adapter_directory_linked_out_of_the_checkpoint_is_refused(root, tmp_path, capsys):
    elsewhere = _checkpoint(tmp_path / "elsewhere", adapters=("verifier",)) / "adapters" / "verifier"
    ck = _checkpoint(tmp_path / "run", adapters=("planner",))
    (ck / "adapters" / "verifier").symlink_to(elsewhere)
    (ck / "state.json").write_text(json.dumps({"step": 1, "adapters": ["planner", "verifier"]}))
    line = _run(root, ck, capsys)
    assert f"adapters/verifier leads to {elsewhere}, outside the checkpoint" in line


def test_another_graphs_checkpoint_is_refused_naming_what_would_run_untrained(root, tmp_path, capsys):
    ck = _checkpoint(tmp_path / "run", adapters=("main",))  # a single-policy graph's run
    line = _run(root, ck, capsys)  # HEAD: ran agentflow with planner and verifier untrained, no warning
    assert "holds adapters ['main'], not ['planner', 'verifier'], which graph 'agentflow' trains" in line
    assert "pass a checkpoint of a training run of this graph" in line
    with pytest.raises(MasgraphError, match="not \\['planner', 'verifier'\\]"):
        load_agent(root / "graphs" / "agentflow.yaml", checkpoint=ck)
    assert main(["train", str(root / "graphs" / "agentflow.yaml"), "--resume", str(tmp_path / "run")]) == 2
    assert "which graph 'agentflow' trains" in capsys.readouterr().err  # before the model loads
    both = _checkpoint(tmp_path / "ok", adapters=("planner", "verifier", "extra"))
    assert set(checkpoint_adapters(both)) == {"planner", "verifier", "extra"}


@pytest.mark.parametrize("state, says", [
    ({"step": 3}, "state.json says step 3 but its directory is step-1"),  # another run's state.json
    ({"step": 10**30}, "says step 1000000000000000000000000000000 but its directory is step-1"),
    ({"cursor": -5}, "cursor -5 (input should be greater than or equal to 0)"),
    ({"train_seconds": float("nan")}, "train_seconds nan"),
    ({"versions": {"planner": -1}}, "versions.planner -1"),
])
def test_train_resume_refuses_a_state_json_that_does_not_fit_its_directory(root, tmp_path, capsys, state, says):
    ck = _checkpoint(tmp_path / "run")
    (ck / "state.json").write_text(json.dumps(json.loads((ck / "state.json").read_text()) | state))
    assert main(["train", str(root / "graphs" / "agentflow.yaml"), "--resume", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err  # HEAD: resumed; `done: 10**30 steps`; a KeyError traceback after "resumed"
    assert says in err and "Traceback" not in err
    assert checkpoint_states(tmp_path / "run") == []  # watch leaves it out


@pytest.mark.parametrize("state, n_items, says", [
    ({"step": 12}, 40, "is at step 12, past this run's 10 steps; resume with --steps 12 or more"),
    ({"step": 2, "cursor": 500}, 40, "data cursor 500 is past the 40 training items this run draws"),
])
def test_a_position_past_the_resuming_runs_end_is_refused_before_anything_loads(tmp_path, state, n_items, says):
    ck = _checkpoint(tmp_path / "run", **state)
    with pytest.raises(MasgraphError, match=says):  # learner and algorithm untouched: refused before them
        Checkpoints(tmp_path / "run").load(ck, None, None, ["planner", "verifier"], SimpleNamespace(steps=10),
                                           n_items=n_items)
