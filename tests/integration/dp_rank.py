"""One learner rank for test_data_parallel_ranks.py, run as a script under torchrun's environment (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT): the tiny model's learner with two adapters, one Flow-GRPO update on the traces given,
and what it left (adapters, their last gradients, the metrics) saved for the test to compare.

    python dp_rank.py MODEL_DIR TRACES.jsonl OUT.pt SEED [SLEEP_S]

SEED draws the adapters' starting values (rank 0's reach every rank); with SLEEP_S >= 0 this rank touches OUT.busy
when it reaches the gradient all-reduce, then waits SLEEP_S before joining it (a rank to kill mid-update, or a hung
one). DP_TIMEOUT_S in the environment: the process group's timeout (default 60). DP_SHARD=1: the base's decoder
layers sharded across the ranks (FSDP2), and rank 0 also saves the adapters to OUT.adapters/ after the update.
DP_HARD=1: one row per forward pass, 2 mini-batches, 2 epochs (ranks with different non-zero numbers of passes), and
LoRA on the output head too (outside the decoder layers: whole on every rank when the base is sharded)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from masgraph.backends.hf.learner import HFLearner
from masgraph.learn.data_parallel import DataParallel, PeerLost, init_from_env
from masgraph.learn.learner import LoraConfigSpec
from masgraph.learn.sharding import full_tensor
from masgraph.trace import Trace
from masgraph.trainers.flow_grpo import FlowGRPO, FlowGRPOConfig

TRAINABLE = {"planner": "plan", "verifier": "check"}
LR = 0.01


def learner(model: str, seed: int, head: bool = False) -> HFLearner:
    """fp32, one thread; both adapters moved off zero-effect (LoRA's B starts at 0, where A gets no gradient); with
    `head`, LoRA on the output head as well."""
    torch.manual_seed(seed)
    out = HFLearner(model, dtype="float32", threads=1)
    lora = LoraConfigSpec(target_modules=("q_proj", "v_proj", "lm_head")) if head else LoraConfigSpec()
    for a in sorted(set(TRAINABLE.values())):
        out.add_adapter(a, lora)
    with torch.no_grad():
        for a in out.adapters():
            for p in out.parameters(a):
                p.add_(0.1 * torch.randn_like(p))
    return out


def trainer(learn: HFLearner, passes: bool = False) -> FlowGRPO:
    """Flow-GRPO at LR; with `passes`, one row per forward pass over 2 mini-batches x 2 epochs."""
    config = FlowGRPOConfig(lr=LR, **({"batching": {"micro_batch": 1}, "ppo": {"num_mini_batches": 2, "epochs": 2}}
                                      if passes else {}))
    return FlowGRPO(learn, TRAINABLE, config)


def snapshot(algo: FlowGRPO, metrics: dict[str, float]) -> dict[str, Any]:
    """The adapters and their last gradients, whole (gathered on every rank when the base is sharded)."""
    names = {a: [n for n, p in algo.learner.weights.model.named_parameters() if "lora_" in n and f".{a}." in n]
             for a in algo.params}
    return {"params": {a: [full_tensor(p.detach()).clone() for p in ps] for a, ps in algo.params.items()},
            "names": names,
            "grads": {a: [torch.zeros(p.shape) if p.grad is None else full_tensor(p.grad).clone() for p in ps]
                      for a, ps in algo.params.items()}, "metrics": metrics, "sharded": algo.learner.sharded}


def main(model: str, traces: str, out: str, seed: str, sleep_s: str = "-1") -> int:
    dp = init_from_env(torch.device("cpu"), timeout_s=float(os.environ.get("DP_TIMEOUT_S", "60")))
    hard = os.environ.get("DP_HARD") == "1"
    learn = learner(model, int(seed), head=hard)
    if os.environ.get("DP_SHARD") == "1":
        learn.shard(dp)
    algo = trainer(learn, passes=hard)
    if float(sleep_s) >= 0:  # touch OUT.busy on reaching the gradient all-reduce, and stall there SLEEP_S first
        reduce = DataParallel.all_reduce_grads

        def stalled(self: DataParallel, *args: Any, **kw: Any) -> None:
            Path(out + ".busy").touch()
            time.sleep(float(sleep_s))
            reduce(self, *args, **kw)

        DataParallel.all_reduce_grads = stalled  # type: ignore[method-assign]
    batch = [Trace.model_validate_json(line) for line in Path(traces).read_text().splitlines()]
    try:
        metrics = algo.update(batch, seed="0:0")
    except PeerLost as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    torch.save(snapshot(algo, metrics), out)
    if learn.sharded and dp.writes:
        learn.save(out + ".adapters", learn.adapters())
    if dp:
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
