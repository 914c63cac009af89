"""Graph files and run directories written for the flat `train:` keys keep loading: a moved key loads in its new
place with a warning that gives its file:line and the new key; GPTSwarm's REINFORCE, once `hrpo.baseline:
moving_average`, fails with a located error naming `algorithm: reinforce`; never a silent change of meaning."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import yaml

from masgraph.errors import SpecError
from masgraph.loader import load_spec
from masgraph.spec import MovedKeysWarning
from masgraph.trainers.config import FlowGRPOConfig, HRPOTrainSpec, TrainSpec, with_overrides

ROOT = Path(__file__).resolve().parents[3]
GRAPH = """name: old
policies:
  p: {backend: hf, model: smollm2-135m, trainable: true, adapter: p}
nodes:
  answer: {role: generator, policy: p}
entry: answer
exit: answer
"""


def loaded(tmp_path: Path, train: str) -> tuple[object, list[MovedKeysWarning]]:
    path = tmp_path / "g.yaml"
    path.write_text(GRAPH + train)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        spec = load_spec(path)
    return spec, [w.message for w in caught if isinstance(w.message, MovedKeysWarning)]


def test_old_flat_flow_grpo_keys_load_in_their_new_place_with_a_located_warning(tmp_path):
    spec, [moved] = loaded(tmp_path, "train:\n  flow_grpo:\n    clip_eps_low: 0.1\n"
                                     "    counterfactual: {answer: [\"Answer: 1\", \"Answer: 2\"]}\n"
                                     "    counterfactual_rows: true\n    micro_batch: 4\n    ppo_epochs: 2\n")
    fg = spec.train.flow_grpo
    assert fg.ppo.clip_eps_low == 0.1 and fg.ppo.epochs == 2 and fg.batching.micro_batch == 4
    assert fg.counterfactual.alternatives == {"answer": ["Answer: 1", "Answer: 2"]} and fg.counterfactual.rows
    text = str(moved)
    assert f"{tmp_path / 'g.yaml'}:10: `train.flow_grpo.clip_eps_low` moved to `train.flow_grpo.ppo.clip_eps_low`" \
        in text
    assert "g.yaml:11: `train.flow_grpo.counterfactual` moved to `train.flow_grpo.counterfactual.alternatives`" in text
    assert "`train.flow_grpo.ppo_epochs` moved to `train.flow_grpo.ppo.epochs`" in text


def test_a_key_given_both_ways_is_refused_on_its_line(tmp_path):
    with pytest.raises(SpecError, match=r"g.yaml:9:\d+: train.flow_grpo: .*`clip_eps_low` moved to `ppo.clip_eps_low`"):
        loaded(tmp_path, "train:\n  flow_grpo:\n    clip_eps_low: 0.1\n    ppo: {clip_eps_low: 0.3}\n")


def test_the_former_moving_average_baseline_fails_on_its_line_naming_the_reinforce_algorithm(tmp_path):
    with pytest.raises(SpecError, match=r"g.yaml:11:\d+: train.hrpo: .*`algorithm: reinforce`"):
        loaded(tmp_path, "topology: {choices: {}}\ntrain:\n  algorithm: hrpo\n  hrpo: {baseline: moving_average}\n")


def test_reinforce_is_an_algorithm_of_its_own():
    from masgraph.registry import default_registry

    algo = default_registry().algorithm("reinforce")
    spec = algo.config.model_validate({"algorithm": "reinforce", "reinforce": {"momentum": 0.5}})
    assert spec.reinforce.momentum == 0.5 and algo.implementation().__name__ == "Reinforce"


def test_hrpo_carries_only_what_it_reads_and_an_old_dump_of_it_loads():
    """A run dir's spec.yaml from before holds HRPO's spec dumped with LoRA and flow_grpo knobs it never read."""
    old = {"algorithm": "hrpo", "lora_rank": 16, "lora_alpha": 32, "lora_targets": ["q_proj", "v_proj"],
           "gradient_checkpointing": False, "flow_grpo": {"clip_eps_low": 0.2},
           "hrpo": {"lr": 0.2, "baseline": "group", "momentum": 0.9}}
    assert not {"lora_rank", "flow_grpo", "gradient_checkpointing"} & set(HRPOTrainSpec.model_fields)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", MovedKeysWarning)
        spec = HRPOTrainSpec.model_validate(old, strict=True)
    said = " ".join(str(w.message) for w in caught if issubclass(w.category, MovedKeysWarning))
    assert "lora_rank" in said and "baseline" in said and "momentum" in said, said  # each dropped key named
    assert spec.hrpo.lr == 0.2 and "baseline" not in spec.hrpo.model_dump()


def flat(dump: dict) -> dict:
    """A new `flow_grpo` dump in the old flat keys (what config.json and spec.yaml of older runs hold)."""
    out = {k: v for k, v in dump.items() if k not in ("credit", "ppo", "batching", "counterfactual")}
    out |= dump["credit"] | dump["batching"]
    out |= {("ppo_epochs" if k == "epochs" else k): v for k, v in dump["ppo"].items()}
    cf = dump["counterfactual"]
    return out | {"counterfactual": cf["alternatives"]} | {f"counterfactual_{k}": v for k, v in cf.items()
                                                          if k != "alternatives"}


def test_an_older_runs_resolved_config_loads_with_the_same_values():
    new = TrainSpec(flow_grpo=FlowGRPOConfig.model_validate(
        {"credit": {"advantage": "episode+step"}, "counterfactual": {"alternatives": {"m": ["a", "b"]}, "rows": True}}))
    old = new.model_dump() | {"flow_grpo": flat(new.flow_grpo.model_dump())}
    assert len(old["flow_grpo"]) == 34  # every knob of the flat model
    with pytest.warns(MovedKeysWarning):
        again = TrainSpec.model_validate(old, strict=True)
    assert again == new


def test_benchmark_set_overrides_in_old_or_new_keys_apply():
    base = FlowGRPOConfig()
    with pytest.warns(MovedKeysWarning):
        old = with_overrides(base, {"advantage": "episode+step", "counterfactual": {"m": ["a", "b"]},
                                    "counterfactual_norm": True})
    new = with_overrides(base, {"credit": {"advantage": "episode+step"},
                                "counterfactual": {"alternatives": {"m": ["a", "b"]}, "norm": True}})
    assert old == new and new.credit.advantage == "episode+step" and new.ppo == base.ppo
    with pytest.warns(MovedKeysWarning):
        assert base.model_copy(update={"format_weight": 0.5}).credit.format_weight == 0.5


@pytest.mark.parametrize("path", sorted((ROOT / "graphs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_graph_loads_without_a_moved_key(path):
    with warnings.catch_warnings():
        warnings.simplefilter("error", MovedKeysWarning)
        load_spec(path)
    raw = yaml.safe_load(path.read_text())
    assert raw is not None


@pytest.mark.parametrize("path", sorted((ROOT / "tests" / "data" / "graphs_016c8eb").glob("*.yaml")),
                         ids=lambda p: p.name)
def test_the_previous_releases_shipped_graphs_load_as_they_meant(path):
    """graphs/ as of 016c8eb (before `flow_grpo` was nested): each loads to the same train section as today's copy,
    and a moved key is a warning naming its new place (mixed_router.yaml's `format_weight`)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", MovedKeysWarning)
        old = load_spec(path)
    moved = " ".join(str(w.message) for w in caught if issubclass(w.category, MovedKeysWarning))
    assert ("credit.format_weight" in moved) == (path.name == "mixed_router.yaml"), moved
    assert old.train == load_spec(ROOT / "graphs" / path.name).train
