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

from masgraph.errors import MasgraphError

__all__ = ["clip_grad_norm", "full_state", "full_tensor", "full_tensors", "is_sharded", "shard_layers",
           "shard_like", "shard_state"]


def shard_layers(layers: Iterable[torch.nn.Module], dp: Any) -> int:
    """`fully_shard` each of `layers` (a model's decoder blocks) over the ranks of `dp` (a `DataParallel`: one mesh
    dimension of its world size, on its device type), gradients reduced as a plain sum (the Flow-GRPO loss is
    normalised over the whole step already; gloo has no pre-scaled sum). Returns the number of layers sharded."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    if not hasattr(FSDPModule, "set_force_sum_reduction_for_comms"):
        raise MasgraphError(f"sharding the base needs FSDP2's summed reduce-scatter, which torch {torch.__version__} "
                            "lacks; fix: pip install 'torch>=2.13' (the version tested), or train without sharding")
    layers = list(layers)
    mesh = init_device_mesh(dp.device.type, (dp.world,))
    for layer in layers:  # each layer is a root of its own (the embeddings and head stay whole), and FSDP keeps a
        # root's weights gathered after its forward unless told otherwise: that would hold the whole base
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
        layer.set_gradient_divide_factor(1.0)
        layer.set_force_sum_reduction_for_comms(True)
    return len(layers)


def full_tensor(t: Any) -> torch.Tensor:
    """The whole value of `t`: a sharded (or replicated) DTensor gathered from every rank (a collective: every rank
    calls it, in the same order), a plain tensor as it is."""
    return t.full_tensor() if is_sharded(t) else t


def full_tensors(named: Iterable[tuple[str, Any]]) -> dict[str, torch.Tensor]:
    """Name -> detached whole tensor of each (name, parameter), in the given order (the same on every rank)."""
    return {name: full_tensor(p.detach()).clone() for name, p in named}


def shard_like(whole: torch.Tensor, param: Any) -> Any:
    """`whole` as `param` holds it: this rank's shard of it when `param` is a DTensor (cut locally: every rank has
    `whole`, so nothing is sent), else `whole` itself."""
    from torch.distributed.tensor import distribute_tensor

    if not is_sharded(param):
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
    for param, state in optimizer.state.items():
        if is_sharded(param):
            for k, v in state.items():
                if isinstance(v, torch.Tensor) and not is_sharded(v) and v.shape == param.shape:
                    state[k] = shard_like(v, param)


def is_sharded(t: Any) -> bool:
    """Whether `t` is a DTensor (a parameter of a sharded layer, or its gradient)."""
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def clip_grad_norm(params: list[Any], max_norm: float) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` (the total norm, gradients scaled to at most `max_norm`), also when some of
    `params` are sharded and some whole (LoRA inside and outside the decoder layers), which torch's cannot mix: the
    two groups' norms are combined, and every gradient is scaled by the same factor."""
    grads = [p.grad for p in params if p.grad is not None]
    sharded = [g for g in grads if is_sharded(g)]
    if not sharded or len(sharded) == len(grads):
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    whole = [g for g in grads if not is_sharded(g)]
    parts = [full_tensor(torch.nn.utils.get_total_norm(group)) for group in (sharded, whole)]
    total = torch.linalg.vector_norm(torch.stack([t.to(parts[1].device) for t in parts]))
    factor = min(1.0, max_norm / (float(total) + 1e-6))  # torch's rule (a float: DTensor and tensor do not mix)
    for g in grads:
        g.mul_(factor)
    return total
