"""GPTSwarm's topology trainer: REINFORCE on each episode's whole-topology log-probability against a moving-average
baseline (no group normalisation, no action-wise terms), the baseline HRPO is compared with (`algorithm: reinforce`).

Its checkpoint file and state are HRPO's (`topology.pt`: policy, optimizer, baseline, version), so a run trained
with the former `hrpo.baseline: moving_average` resumes under this algorithm. The formulas are in `hrpo_math.py`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from masgraph.errors import MasgraphError
from masgraph.rundir.checkpoint import TOPOLOGY_FILE
from masgraph.topology.policy import TopologyPolicy, check_signature
from masgraph.trace import Trace
from masgraph.trainers.algorithm import TrainAlgorithm, TrainContext, query_groups
from masgraph.trainers.config import ReinforceConfig
from masgraph.trainers.hrpo import outcome_reward, scored_groups
from masgraph.trainers.hrpo_math import moving_average_advantages, reinforce_loss

__all__ = ["Reinforce"]


class Reinforce(TrainAlgorithm):
    """Updates a `TopologyPolicy` by REINFORCE from finished episodes that recorded their topology choice.

    Example:
        >>> algo = Reinforce(policy, ReinforceConfig(momentum=0.9))
        >>> metrics = algo.update([traces_of_query_1, traces_of_query_2])
    """

    trains_adapters = False
    state_file = TOPOLOGY_FILE

    def __init__(self, policy: TopologyPolicy, config: ReinforceConfig):
        self.policy, self.config, self.group_size = policy, config, config.group_size
        self.optimizer = torch.optim.Adam(policy.parameters(), lr=config.lr)
        self.baseline: float | None = None

    @classmethod
    def build(cls, ctx: TrainContext) -> Reinforce:
        if ctx.topology is None:  # the compile check (`topology_problems`) refuses such a graph first
            raise MasgraphError("REINFORCE learns a topology, but the graph has no `topology:` section")
        return cls(ctx.topology, ctx.config.reinforce)

    def train_step(self, traces: list[Trace], step: int) -> dict[str, float]:
        return self.update(query_groups(traces, self.group_size))

    def update(self, groups: Sequence[Sequence[Trace]]) -> dict[str, float]:
        """`epochs` optimizer steps on these groups' episodes (those without a recorded topology are ignored);
        moves the baseline once and bumps the policy version."""
        cfg = self.config
        episodes: list[tuple[Trace, float]] = []
        kept, skipped = scored_groups(groups, cfg.no_signal, cfg.cost_lambda)
        for group, rewards in kept:
            adv, self.baseline = moving_average_advantages(rewards, self.baseline, cfg.momentum)
            episodes += list(zip(group, adv))
        if not episodes:
            return {"topology/episodes": 0.0, "topology/skipped_groups": float(skipped)}
        loss = None
        for _ in range(cfg.epochs):
            loss = self._loss(episodes)
            if loss is None:
                break
            self.optimizer.zero_grad()
            loss.backward()
            self.optimizer.step()
        self.policy.version += 1
        rewards = [outcome_reward(t, cfg.cost_lambda) for t, _ in episodes]
        out = {"topology/loss": float(loss.detach())} if loss is not None else {}
        return out | {"topology/baseline": float(self.baseline or 0.0), "topology/episodes": float(len(episodes)),
                      "topology/skipped_groups": float(skipped), "topology/reward": sum(rewards) / len(rewards)}

    def _loss(self, episodes: list[tuple[Trace, float]]) -> torch.Tensor | None:
        logps, advs = [], []
        for t, adv in episodes:
            names, lp, _ = self.policy.log_probs(t.query, t.topology)  # type: ignore[arg-type]
            if names:
                logps.append(lp.sum())
                advs.append(adv)
        if not logps:
            return None
        return reinforce_loss(torch.stack(logps), torch.tensor(advs, device=self.policy.device))

    def state_dict(self) -> dict[str, Any]:
        """Parameters, optimizer moments, the baseline and the version (HRPO's layout, plus the baseline)."""
        return {"policy": self.policy.state_dict(), "optimizer": self.optimizer.state_dict(),
                "baseline": self.baseline, "version": self.policy.version, "decisions": self.policy.signature()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_signature(state, self.policy, "the checkpoint's topology state")
        self.policy.load_state_dict(state["policy"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.baseline, self.policy.version = state["baseline"], state["version"]
