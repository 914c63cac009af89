"""`resolve_targets`: requested LoRA targets fitted to the linear modules an architecture really has (hand-made module
name lists, as `named_modules()` gives them), with fused q/k/v layers mapped and a clear error otherwise."""

from __future__ import annotations

import pytest

from masgraph.backends.hf.lora_targets import resolve_targets
from masgraph.errors import MasgraphError
from masgraph.trainers.config import TrainSpec


def layers(*leaves: str, prefix: str = "model.layers", n: int = 2, head: str = "lm_head") -> list[str]:
    """Full names of `leaves` in `n` decoder layers, plus the output head."""
    return [f"{prefix}.{i}.{leaf}" for i in range(n) for leaf in leaves] + [head]


LLAMA = layers("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj")
PHI3 = layers("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
PHI = layers("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.dense", "mlp.fc1", "mlp.fc2")
NEOX = layers("attention.query_key_value", "attention.dense", "mlp.dense_h_to_4h", "mlp.dense_4h_to_h",
              prefix="gpt_neox.layers", head="embed_out")
GPT2 = layers("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj", prefix="transformer.h")


def test_fused_attention_stands_in_for_q_k_v_and_the_rest_is_kept():
    assert resolve_targets(PHI3, ["q_proj", "v_proj"]) == ["qkv_proj"]
    assert resolve_targets(PHI3, ["q_proj", "k_proj", "v_proj", "o_proj"]) == ["qkv_proj", "o_proj"]
    assert resolve_targets(NEOX, ["q_proj", "v_proj"]) == ["query_key_value"]
    assert resolve_targets(GPT2, ("q_proj", "v_proj", "c_proj")) == ["c_attn", "c_proj"]


def test_phi3_fused_gate_up_stands_in_for_gate_and_up():
    every = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert resolve_targets(PHI3, every) == ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]


def test_names_a_model_has_are_used_as_given_in_order_once():
    assert resolve_targets(LLAMA, ["v_proj", "q_proj", "v_proj", "self_attn.o_proj"]) == [
        "v_proj", "q_proj", "self_attn.o_proj"]  # a dotted suffix matches too, as in peft
    assert resolve_targets(PHI, ["q_proj", "v_proj", "dense", "fc1"]) == ["q_proj", "v_proj", "dense", "fc1"]


def test_all_linear_passes_through_to_peft_as_the_string():
    for requested in ("all-linear", "ALL-LINEAR", ["all-linear"], ("all-linear",)):  # peft expands the string
        assert resolve_targets(PHI3, requested) == "all-linear"
        assert resolve_targets(LLAMA, requested) == "all-linear"


@pytest.mark.parametrize(("names", "requested", "missing"), [
    (PHI, ["q_proj", "o_proj"], "['o_proj']"),  # Phi's output projection is `dense`
    (PHI, ["gate_proj"], "['gate_proj']"),  # no fused gate/up layer to stand in
    (LLAMA, ["q_proj", "qkv_prj"], "['qkv_prj']"),  # a typo is not silently dropped
    (LLAMA, ["proj"], "['proj']"),  # a name matches whole dotted parts only
])
def test_a_name_the_model_lacks_is_an_error_listing_its_modules(names, requested, missing):
    with pytest.raises(MasgraphError) as err:
        resolve_targets(names, requested)
    text = str(err.value)
    leaves = sorted({n.rsplit(".", 1)[-1] for n in names})
    assert missing in text and str(leaves) in text and "all-linear" in text


@pytest.mark.parametrize("requested", [[], ["all-linear", "q_proj"], "q_proj|v_proj"])
def test_empty_mixed_or_regex_requests_are_refused(requested):
    with pytest.raises(MasgraphError, match="all-linear"):
        resolve_targets(LLAMA, requested)


def test_the_train_section_takes_a_list_or_all_linear():
    assert TrainSpec().lora_targets == ["q_proj", "v_proj"]
    assert TrainSpec(lora_targets="all-linear").lora_targets == ["all-linear"]  # as `tuple(...)` keeps it whole
    assert TrainSpec(lora_targets=["qkv_proj", "o_proj"]).lora_targets == ["qkv_proj", "o_proj"]
    with pytest.raises(ValueError):
        TrainSpec(lora_targets="q_proj")  # one name is a list of one


@pytest.mark.parametrize("bad, says", [
    ("q_proj", "is one string: write a list"),
    ([], "an empty list targets nothing"),
    (["all-linear", "q_proj"], "write it alone"),
    ([1], "module names are strings"),
    (["q_proj", " "], "module names are strings"),
])
def test_lora_targets_a_graph_cannot_train_are_refused_when_it_is_validated(bad, says):
    with pytest.raises(ValueError, match=says):
        TrainSpec(lora_targets=bad)
    assert TrainSpec(lora_targets="ALL-Linear").lora_targets == ["all-linear"]
    assert TrainSpec(lora_targets=["All-Linear"]).lora_targets == ["all-linear"]
