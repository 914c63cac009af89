"""A saved adapter is checked against the model before anything is allocated for it (`check_adapter_fits`, in
`HFModel.load_adapter`: what `run`, `serve`, a bundle and `--checkpoint` load through): one made for another
architecture, a config claiming an absurd rank, weights of other shapes are each a MasgraphError naming the adapter
and the modules, never a peft traceback or an allocation the size of the claimed rank."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest

from masgraph.backends.base import LoraConfigSpec
from masgraph.backends.hf.adapter_shape import check_adapter_fits, read_lora_shape
from masgraph.backends.hf.model import HFModel
from masgraph.errors import MasgraphError


@pytest.fixture(scope="module")
def saved(tiny, tmp_path_factory) -> Path:
    """A rank-4 adapter of the tiny Llama on q_proj/v_proj, saved by peft."""
    weights = HFModel(str(tiny), dtype="float32", device="cpu")
    weights.add_adapter("main", LoraConfigSpec(rank=4, alpha=8, target_modules=["q_proj", "v_proj"]))
    out = tmp_path_factory.mktemp("adapter")
    weights.save(str(out), ["main"])
    return out / "main"


def edited(saved: Path, tmp_path: Path, **config) -> Path:
    copy = tmp_path / "edited"
    shutil.copytree(saved, copy)
    cfg = json.loads((copy / "adapter_config.json").read_text())
    cfg.update(config)
    (copy / "adapter_config.json").write_text(json.dumps(cfg))
    return copy


@pytest.fixture
def model(tiny, monkeypatch) -> HFModel:
    """The tiny model; attaching an adapter to it fails the test unless the check has passed."""
    return HFModel(str(tiny), dtype="float32", device="cpu")


def test_a_fitting_adapter_loads(saved, model):
    model.load_adapter("main", str(saved))
    assert model.adapters() == ["main"] and read_lora_shape(saved).key == (4, 8.0, ["q_proj", "v_proj"])


def test_target_modules_the_model_lacks_are_a_clear_error(saved, model, tmp_path):
    adapter = edited(saved, tmp_path, target_modules=["c_attn", "q_proj"])  # GPT-2's name: another architecture
    with pytest.raises(MasgraphError) as err:
        model.load_adapter("planner", str(adapter))
    text = str(err.value)
    assert "adapter 'planner'" in text and "['c_attn']" in text and "q_proj" in text and "another architecture" in text
    assert model.adapters() == []
    with pytest.raises(MasgraphError, match="matches no linear layer"):
        model.load_adapter("planner", str(edited(saved, tmp_path / "rx", target_modules=r".*\.nothing")))


def test_an_absurd_rank_is_refused_before_anything_is_allocated(saved, model, tmp_path, monkeypatch):
    adapter = edited(saved, tmp_path, r=1_000_000)
    attached = []
    monkeypatch.setattr(HFModel, "_attach", lambda self, name, cfg: attached.append(name))
    with pytest.raises(MasgraphError, match=r"adapter 'main'.*rank 1000000 is larger than module "
                                            r"'model.layers.0.self_attn.q_proj'.*at most 32"):
        model.load_adapter("main", str(adapter))
    assert attached == []
    for bad, match in ((0, "not a positive integer rank"), ("8", "not a positive integer rank"),
                       (True, "not a positive integer rank")):
        with pytest.raises(MasgraphError, match=match):
            model.load_adapter("main", str(edited(saved, tmp_path / f"r{bad!r}", r=bad)))
    assert attached == []


def test_weights_of_another_shape_are_refused_from_the_safetensors_header(saved, model, tmp_path):
    adapter = edited(saved, tmp_path, r=2)  # the config says rank 2, the weights are rank 4
    with pytest.raises(MasgraphError, match=r"lora_A.weight has shape \[4, 32\], but rank 2 .* makes it \[2, 32\]"):
        model.load_adapter("main", str(adapter))
    forged = tmp_path / "forged"
    shutil.copytree(saved, forged)
    file = forged / "adapter_model.safetensors"
    data = file.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    name = next(k for k in header if k != "__metadata__")
    header[name]["data_offsets"][1] = 10**12  # claims a terabyte
    raw = json.dumps(header).encode()
    file.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n:])
    with pytest.raises(MasgraphError, match="truncated or forged"):
        model.load_adapter("main", str(forged))


def test_the_check_works_on_module_shapes_alone(saved):
    modules = {f"model.layers.{i}.self_attn.{p}": (32, out) for i in range(2) for p, out in (("q_proj", 32),
                                                                                               ("v_proj", 16))}
    assert check_adapter_fits("main", saved, modules, "tiny").rank == 4
    narrow = {**modules, "model.layers.1.self_attn.v_proj": (32, 3)}
    with pytest.raises(MasgraphError, match=r"rank 4 is larger than module 'model.layers.1.self_attn.v_proj'"):
        check_adapter_fits("main", saved, narrow, "tiny")


def test_run_with_a_checkpoint_whose_adapter_targets_other_modules_is_one_error_line(saved, tiny, tmp_path, capsys):
    from masgraph.cli import main

    graph = tmp_path / "g.yaml"
    graph.write_text(f"""\
name: fit
policies:
  main: {{model: "{tiny}", adapter: main, sampling: {{temperature: 0.0, max_tokens: 2}}}}
nodes:
  answer: {{role: generator, policy: main, prompt: direct}}
entry: answer
exit: answer
""")
    run = tmp_path / "run" / "checkpoints" / "step-1"
    (run / "adapters").mkdir(parents=True)
    shutil.copytree(edited(saved, tmp_path, target_modules=["c_attn"]), run / "adapters" / "main")
    (run / "state.json").write_text(json.dumps({"step": 1, "adapters": ["main"]}))
    assert main(["run", str(graph), "--checkpoint", str(run), "--task", "basic_arithmetic", "--n", "1"]) == 2
    err = capsys.readouterr().err
    [line] = [x for x in err.splitlines() if x.startswith("error: ")]
    assert "adapter 'main'" in line and "c_attn" in line and "Traceback" not in err
