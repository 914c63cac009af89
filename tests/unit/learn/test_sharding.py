"""A learner whose base is sharded with FSDP2 (`masgraph.learn.sharding`), here over a process group of one rank: the
log-probs and gradients are the whole model's, `save` writes whole tensors and `load_adapter` loads them back in
place, and what would run the sharded model on one rank alone (decoding) or reshape it (a new adapter, another LoRA
shape) is refused with a fix. Two ranks: tests/integration/test_data_parallel_ranks.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from masgraph.backends.hf import HFBackend
from masgraph.backends.hf.learner import HFLearner
from masgraph.errors import MasgraphError
from masgraph.learn.data_parallel import DataParallel
from masgraph.learn.learner import LoraConfigSpec
from masgraph.trainers.flow_grpo import Row


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield DataParallel(0, 1)
    finally:
        dist.destroy_process_group()


def test_a_sharded_learner_computes_and_saves_what_the_whole_one_does(tiny, tmp_path, one_rank):
    from safetensors.torch import load_file
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    learner = HFLearner(str(tiny), dtype="float32", threads=1)
    learner.add_adapter("plan", LoraConfigSpec())
    with torch.no_grad():
        for p in learner.parameters("plan"):
            p.add_(0.1 * torch.randn_like(p))
    rows = [Row(0, "n", "plan", [1, 4, 5, 6], [16, 17, 2], [], 0.0, 0),
            Row(1, "n", "plan", [1, 4, 9], [20, 2], [], 0.0, 0)]
    with torch.no_grad():
        whole = learner.sequence_logprobs(rows, "plan")
    weights = {n: p.detach().clone() for n, p in learner.weights.model.named_parameters() if "lora_" in n}

    assert learner.shard(one_rank) == 2 and learner.sharded  # the tiny Llama's two decoder layers
    assert all(isinstance(p, DTensor) for p in learner.parameters("plan"))
    with torch.no_grad():
        sharded = learner.sequence_logprobs(rows, "plan")
    layers = learner.weights._decoder_layers()
    assert all(isinstance(p, DTensor) for layer in layers for p in layer.parameters())  # resharded after the pass
    for a, b in zip(whole, sharded):
        assert torch.allclose(a, b, atol=1e-6)  # one forward per pass instead of a shared prefix: fp32 rounding

    learner.train()  # with gradient checkpointing the recomputed layers all-gather again: the same gradients
    grads = {}
    for ckpt in (False, True):
        learner.gradient_checkpointing(ckpt)
        sum(lp.sum() for lp in learner.sequence_logprobs(rows, "plan")).backward()
        grads[ckpt] = [p.grad.full_tensor().clone() for p in learner.parameters("plan")]
        for p in learner.parameters("plan"):
            p.grad = None
    assert all(isinstance(p, DTensor) for layer in layers for p in layer.parameters())  # and after backward
    assert any(g.abs().max() > 0 for g in grads[False])
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(grads[True], grads[False]))
    learner.gradient_checkpointing(False)
    learner.train(False)

    learner.save(str(tmp_path), ["plan"])  # whole tensors, under PEFT's names
    saved = load_file(tmp_path / "plan" / "adapter_model.safetensors")
    assert len(saved) == len(weights) and all(not isinstance(t, DTensor) for t in saved.values())
    assert sorted(t.sum().item() for t in saved.values()) == sorted(t.sum().item() for t in weights.values())
    assert learner.source("plan").state_dict().keys() == saved.keys()

    with pytest.raises(MasgraphError, match="cannot decode in one process.*fix: give the rollouts their own model"):
        HFBackend(learner.weights)
    with pytest.raises(MasgraphError, match="cannot add adapter 'verify' once the model is sharded"):
        learner.add_adapter("verify", LoraConfigSpec())
    # a checkpoint's adapter loads in place, each rank keeping its shard; another shape or name is refused as is
    with torch.no_grad():
        for p in learner.parameters("plan"):
            p.mul_(0.0)
    learner.load_adapter("plan", str(tmp_path / "plan"), version=3)
    assert learner.version("plan") == 3
    assert sorted(p.full_tensor().sum().item() for p in learner.parameters("plan")) == sorted(
        t.sum().item() for t in weights.values())
    assert all(torch.equal(learner.weights.full[n], w) for n, w in weights.items())
    other = HFLearner(str(tiny), dtype="float32", threads=1)
    other.add_adapter("plan", LoraConfigSpec(rank=4))
    other.add_adapter("verify", LoraConfigSpec())
    other.save(str(tmp_path / "other"), ["plan", "verify"])
    for name, match in (("plan", "in another LoRA shape"), ("verify", "in another LoRA shape")):
        with pytest.raises(MasgraphError, match=f"cannot load adapter '{name}' {match}.*once the model is sharded"):
            learner.load_adapter(name, str(tmp_path / "other" / name))
    assert learner.adapters() == ["plan"] and learner.version("plan") == 3  # the refusals changed nothing
    with pytest.raises(MasgraphError, match="sharded already"):
        learner.shard(one_rank)
