"""The one device setting: `device:` per policy (checked with a located error), `--device` on run/train/serve,
`auto` resolving to the GPU only when torch sees one, and a GPU that is not there being an error line with the fix."""

from __future__ import annotations

import pytest
import torch

from masgraph.cli import main
from masgraph.device import resolve_device
from masgraph.errors import MasgraphError, SpecError
from masgraph.graph import compile_spec
from masgraph.loader import parse_spec
from masgraph.trainers.loop import base_device

GRAPH = """\
name: dev
policies:
  a: {{model: smollm2-135m, adapter: a, trainable: true, device: {a}}}
  b: {{model: smollm2-135m, device: {b}}}
nodes:
  one: {{role: planner, policy: a}}
  two: {{role: generator, policy: b}}
edges:
  - {{source: one, target: two}}
entry: one
exit: two
train: {{task: basic_arithmetic}}
"""


@pytest.mark.parametrize("bad", ["gpu", "cuda:x", "CUDA", "cpu0", "'cuda:1 '", "'cuda:-1'"])
def test_a_device_that_is_not_one_is_a_located_error(bad):
    with pytest.raises(SpecError) as err:
        parse_spec(GRAPH.format(a=bad, b="auto"), "dev.yaml")
    [problem] = err.value.problems
    assert problem.path == "policies.a.device" and "use auto, cpu, cuda or cuda:N" in problem.message
    assert "dev.yaml:3:" in str(err.value)  # located at the line that says it


def test_auto_is_the_gpu_only_when_torch_sees_one(monkeypatch):
    assert resolve_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(MasgraphError, match=r"device 'cuda'.*a CPU build and sees no GPU.*--device cpu.*make setup"):
        resolve_device("cuda")
    monkeypatch.setattr(torch.version, "cuda", "12.8")  # a CUDA build that sees nothing: not an install problem
    with pytest.raises(MasgraphError, match=r"built for CUDA 12.8\) sees no GPU.*CUDA_VISIBLE_DEVICES.*nvidia-smi"
                                            r".*--gpus-per-worker"):
        resolve_device("cuda:0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("auto") == torch.device("cuda")
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(MasgraphError, match=r"2 visible GPU\(s\) \(cuda:0..cuda:1\).*CUDA_VISIBLE_DEVICES"):
        resolve_device("cuda:2")


def test_training_needs_the_local_policies_on_one_device(monkeypatch):
    # on a CPU-only machine `auto` is the CPU: the same device, so no problem
    assert base_device(parse_spec(GRAPH.format(a="cpu", b="auto"), "dev.yaml")) == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    with pytest.raises(SpecError) as err:  # with a GPU, `auto` is the GPU
        base_device(parse_spec(GRAPH.format(a="cpu", b="auto"), "dev.yaml"))
    assert [p.path for p in err.value.problems] == ["policies.b.device"]
    assert "'auto' differs from 'cpu' of policy 'a'" in err.value.problems[0].message
    # the same GPU spelt three ways is one device; a vllm policy counts (the learner serves it too)
    assert base_device(parse_spec(GRAPH.format(a="cuda", b="cuda:0"), "dev.yaml")) == "cuda"
    spec = parse_spec(GRAPH.format(a="cuda:1", b="cuda:0"), "dev.yaml")
    vllm = {n: p.model_copy(update={"backend": "vllm"}) for n, p in spec.policies.items()}
    with pytest.raises(SpecError):
        base_device(spec.model_copy(update={"policies": vllm}))


@pytest.mark.parametrize("command", ["run", "train", "serve"])
def test_device_flag_asking_for_a_missing_gpu_is_one_error_line_before_anything_loads(command, tmp_path, capsys,
                                                                                       monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    graph = tmp_path / "g.yaml"
    graph.write_text(GRAPH.format(a="auto", b="auto"))
    extra = {"run": ["--task", "basic_arithmetic"], "train": [], "serve": ["--no-store"]}[command]
    code = main([command, str(graph), *extra, "--device", "cuda", "--runs-dir", str(tmp_path / "runs")])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: device 'cuda'") and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())  # no run dir left


def test_device_flag_sets_every_hf_policy_and_leaves_the_others(tmp_path):
    from masgraph.cli import with_device

    spec = parse_spec(GRAPH.format(a="auto", b="cuda:0"), "dev.yaml")
    api = spec.policies["b"].model_copy(update={"backend": "litellm", "model": "openai/x"})
    graph = compile_spec(spec.model_copy(update={"policies": {**spec.policies, "c": api}}), check_models=False)
    moved = with_device(graph, "cpu", "dev.yaml").spec.policies
    assert (moved["a"].device, moved["b"].device) == ("cpu", "cpu")
    assert moved["c"] == graph.spec.policies["c"]  # an API-served policy is not moved


def test_deterministic_mode_asks_a_gpu_for_repeatable_kernels_and_leaves_a_cpu_alone(monkeypatch):
    import os

    from masgraph.device import deterministic_kernels

    calls = []
    monkeypatch.setattr(torch, "use_deterministic_algorithms",
                        lambda on, warn_only=False: calls.append((on, warn_only)))
    deterministic_kernels(torch.device("cpu"))
    assert calls == []
    deterministic_kernels(torch.device("cuda", 0))
    assert calls == [(True, True)]
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"  # set by `import masgraph`, before CUDA starts
