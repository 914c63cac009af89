"""A base model sharded across the learner ranks (PyTorch FSDP2 `fully_shard`), for a base that does not fit one
device: each decoder layer's weights, LoRA parameters included, are split across the ranks and gathered layer by
layer for each forward and backward pass; the gradients leave as each rank's shard of their sum over ranks.

What stays whole on every rank: the embeddings, the final norm and the output head (many models tie the head to the
embeddings, and the log-probs read the head's weight directly: `masgraph.backends.hf.logprobs`). They are a small
part of a large model: 4% of Llama-2-7B's weights, 14% of Qwen2.5-7B's (its 152k-token vocabulary).

Because every forward pass all-gathers every layer, the ranks must run the same number of passes in the same order:
the Flow-GRPO update pads a rank's passes with discarded ones (`masgraph.trainers.flow_grpo`), and the learner runs
each pass as one forward (no shared-prefix cache). Outside an update nothing may run the sharded model on one rank
alone; the adapters' full tensors are gathered after each update (`full_tensors`) for saving and publishing.

Example (every rank, under `torchrun --nproc-per-node 2`, after the adapters are attached, before an optimizer holds
their parameters):
    >>> dp = init_from_env(torch.device("cpu"))
    >>> learner.shard(dp)                    # HFLearner: shard_layers(its decoder blocks, dp)
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["full_state", "full_tensor", "full_tensors", "shard_layers", "shard_like", "shard_state"]


def shard_layers(layers: Iterable[torch.nn.Module], dp: Any) -> int:
    """`fully_shard` each of `layers` (a model's decoder blocks) over the ranks of `dp` (a `DataParallel`: one mesh
    dimension of its world size, on its device type), gradients reduced as a plain sum (the Flow-GRPO loss is
    normalised over the whole step already; gloo has no pre-scaled sum). Returns the number of layers sharded."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    layers = list(layers)
    mesh = init_device_mesh(dp.device.type, (dp.world,))
    for layer in layers:
        fully_shard(layer, mesh=mesh)
        layer.set_gradient_divide_factor(1.0)
        layer.set_force_sum_reduction_for_comms(True)
    return len(layers)


def full_tensor(t: Any) -> torch.Tensor:
    """The whole value of `t`: a sharded (or replicated) DTensor gathered from every rank (a collective: every rank
    calls it, in the same order), a plain tensor as it is."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def full_tensors(named: Iterable[tuple[str, Any]]) -> dict[str, torch.Tensor]:
    """Name -> detached whole tensor of each (name, parameter), in the given order (the same on every rank)."""
    return {name: full_tensor(p.detach()).clone() for name, p in named}


def shard_like(whole: torch.Tensor, param: Any) -> Any:
    """`whole` as `param` holds it: this rank's shard of it when `param` is a DTensor (cut locally: every rank has
    `whole`, so nothing is sent), else `whole` itself."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(param, DTensor):
        return whole
    return distribute_tensor(whole.to(param.device, param.dtype), param.device_mesh, param.placements,
                             src_data_rank=None)


def full_state(state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer's `state_dict()` with each DTensor gathered whole (a collective: every rank, same order), so a
    checkpoint holds what an unsharded run's holds and resumes with any number of ranks."""
    return {"state": {i: {k: full_tensor(v).clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
                      for i, s in state["state"].items()}, "param_groups": state["param_groups"]}


def shard_state(optimizer: torch.optim.Optimizer) -> None:
    """After `optimizer.load_state_dict` of whole tensors (`full_state`): each state tensor shaped like its sharded
    parameter becomes that parameter's shard (Adam's moments), the rest (its step count) stays as loaded."""
    from torch.distributed.tensor import DTensor

    for param, state in optimizer.state.items():
        if isinstance(param, DTensor):
            for k, v in state.items():
                if isinstance(v, torch.Tensor) and not isinstance(v, DTensor) and v.shape == param.shape:
                    state[k] = shard_like(v, param)
