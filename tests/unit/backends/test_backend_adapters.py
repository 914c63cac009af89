"""HFBackend adapter loading (the saved PEFT config decides the adapter's shape; every weight must load) on a
tiny random Llama, and backend errors being MasgraphErrors with a fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from masgraph.backends.base import BackendError
from masgraph.backends.hf import HFBackend, LoraConfigSpec
from masgraph.errors import MasgraphError
from masgraph.registry import default_registry
from masgraph.spec import PolicySpec

ODD = LoraConfigSpec(rank=4, alpha=7, target_modules=("k_proj", "o_proj", "up_proj"))


def _logits(backend: HFBackend, adapter: str) -> torch.Tensor:
    backend.model.set_adapter(adapter)
    with torch.inference_mode():
        return backend.model(input_ids=torch.tensor([[1, 5, 9, 30, 12, 2, 1, 6]])).logits


@pytest.fixture(scope="module")
def saved(tiny, tmp_path_factory) -> tuple[Path, torch.Tensor]:
    """An adapter saved at a non-default rank/alpha/target set with random weights, and its logits."""
    src = HFBackend(str(tiny), dtype="float32")
    src.add_adapter("x", ODD)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in src.model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    out = tmp_path_factory.mktemp("ckpt")
    src.model.save_pretrained(out, selected_adapters=["x"])
    return out / "x", _logits(src, "x")


@pytest.mark.slow
def test_load_over_a_default_adapter_uses_the_saved_config(tiny, saved):
    path, want = saved
    b = HFBackend(str(tiny), dtype="float32")
    b.add_adapter("x")  # default rank 16 on q/v, as a trainable graph's runner creates it
    b.load_adapter("x", str(path))
    cfg = b.model.peft_config["x"]
    assert (cfg.r, cfg.lora_alpha, set(cfg.target_modules)) == (4, 7, {"k_proj", "o_proj", "up_proj"})
    assert torch.equal(_logits(b, "x"), want)
    assert b.versions["x"] == 1  # bumped: cached prefix KV of the old weights is not reused


@pytest.mark.slow
def test_fresh_and_repeated_loads_give_the_saved_model(tiny, saved):
    path, want = saved
    b = HFBackend(str(tiny), dtype="float32")
    b.load_adapter("x", str(path))
    assert torch.equal(_logits(b, "x"), want) and b.versions["x"] == 0
    params = [p for n, p in b.model.named_parameters() if ".x." in n]
    b.load_adapter("x", str(path))  # same shape: weights in place, same parameter objects (an optimizer's)
    assert torch.equal(_logits(b, "x"), want) and b.versions["x"] == 1
    assert params and all(p is q for p, q in zip(params, (p for n, p in b.model.named_parameters() if ".x." in n)))


@pytest.mark.parametrize("damage", ["drop", "extra"])
def test_incomplete_or_foreign_weights_are_a_clear_error(tiny, saved, tmp_path, damage):
    path, _ = saved
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text((path / "adapter_config.json").read_text())
    state = load_file(path / "adapter_model.safetensors")
    if damage == "drop":
        state.pop(min(state))
    else:
        state["base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"] = torch.zeros(4, 64)
    save_file(state, bad / "adapter_model.safetensors")
    b = HFBackend(str(tiny), dtype="float32")
    b.add_adapter("x")
    with pytest.raises(BackendError, match=f"adapter checkpoint {bad} does not match") as err:
        b.load_adapter("x", str(bad))
    assert isinstance(err.value, MasgraphError) and "fix:" in str(err.value)
    assert "x" not in b.versions and "x" not in b.model.peft_config  # nothing half-loaded is served
    b.load_adapter("x", str(path))  # a good checkpoint loads after a bad one
    assert b.versions["x"] == 0


def test_unreadable_checkpoint_is_a_masgraph_error(tiny, tmp_path):
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA"}))
    b = HFBackend(str(tiny), dtype="float32")
    with pytest.raises(MasgraphError, match=f"cannot read adapter checkpoint {tmp_path}.*fix:"):
        b.load_adapter("x", str(tmp_path))


def test_unknown_backend_kind_is_a_masgraph_error_with_a_fix():
    with pytest.raises(MasgraphError, match=r"backend: scripted. .* no built-in instance.*; fix: .*backends="):
        default_registry().backend(PolicySpec(backend="scripted", model="m"), {})
