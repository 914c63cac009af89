"""Bundles (`masgraph export`) on a tiny random Llama: what is written, that it answers like the checkpoint it came
from, that its adapters load with plain `peft`, and that a bundle that does not match its manifest is refused."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import yaml

from masgraph.errors import MasgraphError
from masgraph.graph import compile_spec
from masgraph.loader import parse_spec
from masgraph.serve.agent import Agent, load_agent, open_source
from masgraph.serve.bundle import export_bundle, load_bundle
from masgraph.tasks import Item, Task
from masgraph.trainers.loop import TrainLoop

QUESTIONS = ["1 + 1 ?", "3 + 1 ?", "7 + 1 ?"]


class Sums(Task):
    name = "sums"

    def generate(self, split: str, n: int, seed: int) -> list[Item]:
        if split == "train":
            return [Item(f"train-{seed}-{i}", f"{i % 19} + 1 ?", str(i % 19 + 1)) for i in range(n)]
        return [Item(f"test-{seed}-{i}", f"{i % 19} * 1 ?", str(i % 19)) for i in range(n)]

    def score(self, item: Item, answer: str) -> float:
        return float(answer.strip() == item.answer)

    def reward(self, item, trace) -> float:
        return float(trace.meta["sample"] % 2)  # every group has a signal, so the adapter moves


def graph_text(model: Path) -> str:
    return f"""\
name: tiny
policies:
  main: {{model: "{model}", adapter: answer, trainable: true, sampling: {{temperature: 0.0, max_tokens: 4}}}}
nodes:
  answer: {{role: generator, policy: main, prompt: direct}}
entry: answer
exit: answer
train: {{steps: 1, queries_per_step: 2, eval_every: 0, eval_n: 2, seed: 1,
         flow_grpo: {{group_size: 2, lr: 0.05, temperature: 1.0}}}}
"""


@pytest.fixture(scope="module")
def trained(tiny, tmp_path_factory) -> Path:
    """A finished training run of the tiny graph (one step)."""
    run = tmp_path_factory.mktemp("train") / "run"
    asyncio.run(TrainLoop(compile_spec(parse_spec(graph_text(tiny), "tiny.yaml")), Sums(), run,
                          dtype="float32").run())
    return run


def answers(agent: Agent) -> list[tuple[str | None, list[float]]]:
    """Each question's answer and the log-probs of its tokens (which tell adapters apart even when the greedy
    answer is the same)."""
    async def main():
        try:
            return [(a.answer, [lp for c in a.trace.llm_calls for lp in c.logprobs])
                    for a in [await agent.aask(q) for q in QUESTIONS]]
        finally:
            await agent.aclose()
    return asyncio.run(main())


@pytest.mark.slow
def test_a_bundle_answers_like_its_checkpoint_from_anywhere(trained, tiny, tmp_path):
    bundle = export_bundle(trained, tmp_path / "b")
    m = json.loads((bundle / "manifest.json").read_text())
    assert m["format_version"] == 2 and m["source"]["step"] == 1 and set(m["adapters"]) == {"answer"}
    assert m["evaluation"]["task"] == "sums" and m["evaluation"]["n"] == 2 and "masgraph run" in m["evaluation"][
        "command"]
    assert "train" not in yaml.safe_load((bundle / "graph.yaml").read_text())  # the train section is dropped
    assert m["models"][str(tiny)]["weights"]["model.safetensors"]
    moved = tmp_path / "elsewhere" / "b"  # copied away from the run
    shutil.copytree(bundle, moved)
    graph = compile_spec(parse_spec(graph_text(tiny), "tiny.yaml"))
    from_checkpoint = answers(Agent(graph, trained, deterministic=True))
    from_bundle = answers(load_agent(moved, deterministic=True))
    untrained = answers(Agent(graph, deterministic=True))
    assert from_bundle == from_checkpoint
    assert [lp for _, lp in untrained] != [lp for _, lp in from_checkpoint]  # the adapter is served, not the base


def test_bundle_adapters_load_with_plain_peft(trained, tiny, tmp_path):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    bundle = export_bundle(trained, tmp_path / "b")
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny), bundle / "adapters" / "answer")
    lora = {k: v for k, v in model.state_dict().items() if "lora_B" in k}
    assert lora and any(bool(torch.any(v != 0)) for v in lora.values())  # trained weights, not the zero init


def test_a_graph_file_exports_too_and_archives_round_trip(trained, tiny, tmp_path):
    graph = tmp_path / "tiny.yaml"
    graph.write_text(graph_text(tiny))
    plain = export_bundle(graph, tmp_path / "plain")
    assert json.loads((plain / "manifest.json").read_text())["adapters"] == {}
    archive = export_bundle(trained, tmp_path / "packed", archive=True)
    assert archive.name == "packed.tar.gz" and not (tmp_path / "packed").exists()
    elsewhere = tmp_path / "far"
    elsewhere.mkdir()
    shutil.copy(archive, elsewhere)
    g, b = open_source(elsewhere / "packed.tar.gz")
    assert b is not None and set(b.adapters) == {"answer"} and g.spec.name == "tiny"


def test_a_bundle_runs_wherever_it_is_served_not_on_the_training_device(tiny, tmp_path):
    """A run trained with `--device cpu` (recorded in its spec) exports policies on `auto`: the serving machine's."""
    graph = tmp_path / "pinned.yaml"
    graph.write_text(graph_text(tiny).replace("adapter: answer,", "device: cpu, adapter: answer,"))
    assert "device: cpu" in graph.read_text()
    g, _ = open_source(export_bundle(graph, tmp_path / "pinned"))
    assert {p.device for p in g.spec.policies.values()} == {"auto"}


@pytest.mark.parametrize("damage, match", [
    (lambda b: (b / "adapters/answer/adapter_model.safetensors").write_bytes(b"x"), "is 1 bytes, the manifest says"),
    (lambda b: _flip_first_byte(b / "adapters/answer/adapter_model.safetensors"), "does not match its sha256"),
    (lambda b: (b / "graph.yaml").unlink(), "graph.yaml is missing"),
    (lambda b: (b / "manifest.json").write_text("{"), "not valid JSON"),
    (lambda b: _edit(b, lambda m: m.update(format_version=99)), "format version 99"),
    (lambda b: _edit(b, lambda m: m["models"][next(iter(m["models"]))]["weights"].update(
        {"model.safetensors": "0" * 64})), "other weights of base model"),
    (lambda b: _edit(b, lambda m: m["files"].pop("graph.yaml")), "does not cover graph.yaml"),
    (lambda b: _retemplate(b), "prompt template direct.txt differs"),
])
def test_a_bundle_that_does_not_match_its_manifest_is_refused(trained, tmp_path, damage, match):
    bundle = export_bundle(trained, tmp_path / "b")
    damage(bundle)
    with pytest.raises(MasgraphError, match=match):
        load_bundle(bundle)


def _flip_first_byte(file: Path) -> None:
    data = file.read_bytes()
    file.write_bytes(bytes([data[0] ^ 1]) + data[1:])


def _edit(bundle: Path, change) -> None:
    m = json.loads((bundle / "manifest.json").read_text())
    change(m)
    (bundle / "manifest.json").write_text(json.dumps(m))


def _retemplate(bundle: Path) -> None:
    """Other prompt text than this masgraph's, with a manifest that agrees (so only the prompt check can catch it)."""
    from masgraph.serve.bundle import sha256_file

    (bundle / "prompts" / "direct.txt").write_text("Answer in French.\n")
    _edit(bundle, lambda m: m["files"].update({"prompts/direct.txt": {
        "sha256": sha256_file(bundle / "prompts/direct.txt"), "size": len("Answer in French.\n")}}))


SCRIPTED = ("name: s\npolicies:\n  main: {backend: scripted}\n"
            "nodes:\n  answer: {role: generator, policy: main}\nentry: answer\nexit: answer\n")


def scripted_bundle(tmp_path: Path) -> Path:
    """A bundle of a graph with no model (exports in milliseconds)."""
    graph = tmp_path / "s.yaml"
    graph.write_text(SCRIPTED)
    return export_bundle(graph, tmp_path / "b")


def _add_adapter(bundle: Path) -> None:
    (bundle / "adapters" / "evil").mkdir(parents=True)
    (bundle / "adapters" / "evil" / "adapter_model.safetensors").write_bytes(b"not trained here")


def _symlink_graph(bundle: Path) -> None:
    outside = bundle.parent / "other.yaml"
    outside.write_bytes((bundle / "graph.yaml").read_bytes())  # same bytes: only the link itself is wrong
    (bundle / "graph.yaml").unlink()
    (bundle / "graph.yaml").symlink_to(outside)


@pytest.mark.parametrize("damage, match", [
    (lambda b: (b / "manifest.json").write_bytes(b'{"format": "\xff"}'), "manifest.json is not UTF-8 text"),
    (lambda b: (b / "manifest.json").write_text("[1]"), "is not a masgraph bundle manifest"),
    (lambda b: _edit(b, lambda m: m.update(files=list(m["files"]))), "malformed: files: Input should be a valid dict"),
    (lambda b: _edit(b, lambda m: m["files"]["graph.yaml"].update(size="9")), r"files\['graph.yaml'\]\['size'\]"),
    (lambda b: _edit(b, lambda m: m["files"].update({"../s.yaml": m["files"]["graph.yaml"]})),
     "'../s.yaml' is not a relative path inside the bundle"),
    (lambda b: _edit(b, lambda m: m.update(adapters={"../..": {}})), "'../..' is not a plain file or directory name"),
    (lambda b: _edit(b, lambda m: m.update(format_version=1)), "format version 1; this masgraph reads version 2"),
    (_add_adapter, r"adapters/ is not in the manifest"),
    (_symlink_graph, "graph.yaml is a symbolic link"),
])
def test_a_malformed_manifest_or_an_unlisted_file_is_one_error_line(tmp_path, capsys, damage, match):
    """HEAD: UnicodeDecodeError and AttributeError tracebacks; an extra adapter and a symlinked graph loaded."""
    from masgraph.cli import main

    bundle = scripted_bundle(tmp_path)
    damage(bundle)
    with pytest.raises(MasgraphError, match=match):
        load_bundle(bundle)
    assert main(["run", str(bundle), "--task", "basic_arithmetic", "--n", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err


def test_a_file_of_the_wrong_size_is_refused_before_it_is_hashed(tmp_path, monkeypatch):
    """A 4 GiB (sparse) file where the manifest names a small one: refused on its size, never read (HEAD hashed it
    for ~35 s first)."""
    import masgraph.serve.bundle

    bundle = scripted_bundle(tmp_path)
    big = bundle / "prompts" / "direct.txt"
    with open(big, "r+b") as f:
        f.truncate(4 << 30)
    hashed = []
    monkeypatch.setattr(masgraph.serve.bundle, "sha256_file", lambda p: hashed.append(Path(p).name) or "0" * 64)
    with pytest.raises(MasgraphError, match=r"prompts/direct.txt is 4294967296 bytes, the manifest says \d+"):
        load_bundle(bundle)
    assert hashed == []


def test_a_bundle_plugin_loads_again_after_python_cached_its_bytecode(tmp_path, monkeypatch):
    """Importing a bundle's plugin writes plugins/__pycache__; the next load drops it (a .pyc there would run instead
    of the checked source) instead of refusing it as a file the manifest does not list."""
    graph = tmp_path / "s.yaml"
    monkeypatch.setattr(sys, "dont_write_bytecode", False)  # as Python runs by default
    graph.write_text(SCRIPTED + f"plugins: ['{tmp_path / 'plug.py'}']\n")
    (tmp_path / "plug.py").write_text("LOADED = True\n")
    bundle = export_bundle(graph, tmp_path / "b")
    open_source(bundle)
    assert any((bundle / "plugins" / "__pycache__").glob("plug.*.pyc"))  # Python cached it beside the plugin
    (bundle / "plugins" / "__pycache__" / "other.cpython-311.pyc").write_bytes(b"planted")
    _, loaded = open_source(bundle)
    assert loaded is not None and not (bundle / "plugins" / "__pycache__").exists()


def test_a_hostile_archive_is_refused(tmp_path):
    evil = tmp_path / "evil.tar.gz"
    payload = tmp_path / "payload"
    payload.write_text("pwned")
    with tarfile.open(evil, "w:gz") as tar:
        tar.add(payload, arcname="../escaped.txt")
    with pytest.raises(MasgraphError, match="cannot unpack"):
        load_bundle(evil)
    assert not (tmp_path.parent / "escaped.txt").exists()


def test_export_refuses_to_overwrite_and_names_bad_sources(trained, tmp_path):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(MasgraphError, match="not empty"):
        export_bundle(trained, out)
    assert (out / "keep.txt").read_text() == "mine"
    with pytest.raises(MasgraphError, match="does not exist"):
        export_bundle(tmp_path / "nope", tmp_path / "o1")
    no_spec = tmp_path / "nospec"
    shutil.copytree(trained, no_spec)
    (no_spec / "spec.yaml").unlink()
    with pytest.raises(MasgraphError, match="no spec.yaml"):
        export_bundle(no_spec, tmp_path / "o2")
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()


@pytest.mark.slow
def test_cli_errors_for_export_and_serving_a_run_dir(trained, tmp_path):
    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "masgraph.cli", *args], capture_output=True, text=True)

    r = cli("export", str(tmp_path / "missing"), "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and r.stderr.startswith("error: ") and "Traceback" not in r.stderr
    r = cli("serve", str(trained))
    assert r.returncode == 2 and "is a training run; export it first" in r.stderr
    r = cli("export", str(trained), "--out", str(tmp_path / "ok"))
    assert r.returncode == 0 and "masgraph serve" in r.stdout, r.stderr


def test_export_ships_the_plugin_beside_the_graph_from_any_directory(tmp_path, monkeypatch, capsys):
    """`plugins: [plug.py]` is the file beside the graph, as loading and `validate` take it. HEAD resolved it
    against the current directory: from one with its own plug.py it shipped that one, from one without it refused
    a graph that `validate` accepts."""
    from masgraph.cli import main

    (tmp_path / "g").mkdir()
    graph = tmp_path / "g" / "s.yaml"
    graph.write_text(SCRIPTED + "plugins: [plug.py]\n")
    (tmp_path / "g" / "plug.py").write_text("WHO = 'beside the graph'\n")
    impostor, empty = tmp_path / "impostor", tmp_path / "empty"
    impostor.mkdir()
    empty.mkdir()
    (impostor / "plug.py").write_text("WHO = 'the current directory'\n")
    for cwd in (impostor, empty):
        monkeypatch.chdir(cwd)
        assert main(["validate", str(graph)]) == 0
        assert main(["export", str(graph), "--out", str(cwd / "b")]) == 0, capsys.readouterr().err
        assert (cwd / "b" / "plugins" / "plug.py").read_text() == "WHO = 'beside the graph'\n"
        assert yaml.safe_load((cwd / "b" / "graph.yaml").read_text())["plugins"] == ["plugins/plug.py"]


def test_export_refuses_plugins_it_cannot_ship(tmp_path):
    """Two plugin files of one name (one would overwrite the other in plugins/), or `plugins:` not a list."""
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "plug.py").write_text(f"WHO = {folder!r}\n")
    graph = tmp_path / "s.yaml"
    graph.write_text(SCRIPTED + "plugins: [a/plug.py, b/plug.py]\n")
    with pytest.raises(MasgraphError, match="both named plug.py"):
        export_bundle(graph, tmp_path / "out")
    graph.write_text(SCRIPTED + "plugins: 5\n")
    with pytest.raises(MasgraphError, match="must be a list of module names or .py files"):
        export_bundle(graph, tmp_path / "out")
    assert not (tmp_path / "out").exists()
