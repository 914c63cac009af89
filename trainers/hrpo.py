"""HRPO: trains a topology policy (which nodes, edges and routes each query gets) from the outcomes of its samples.

Per query, G topologies are sampled and run (a group). Each episode's outcome reward is the task reward minus
λ·tokens; its group-relative advantage is shared by every decision it made, and each decision adds ω times its
own normalised action-wise reward: minus the token cost of the nodes that decision switched on, minus a penalty
per step of those nodes that failed to parse or whose output nothing used (component rationality). The loss is
a PPO-clip surrogate on the decisions' log-probabilities plus an entropy bonus, on the policy's own Adam
optimizer. GPTSwarm's estimator (REINFORCE against a moving-average baseline) is its own algorithm,
`trainers/reinforce.py`. The formulas are in `hrpo_math.py`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from masgraph import metric_keys as keys
from masgraph.errors import MasgraphError
from masgraph.rundir.checkpoint import TOPOLOGY_FILE
from masgraph.topology.policy import TopologyPolicy, check_signature
from masgraph.trace import Trace
from masgraph.trainers.algorithm import TrainAlgorithm, TrainContext, query_groups
from masgraph.trainers.config import HRPOConfig
from masgraph.trainers.hrpo_math import (
    action_advantages,
    combine,
    group_advantages,
    has_signal,
    hrpo_loss,
)

__all__ = ["HRPO", "action_reward", "outcome_reward"]


def outcome_reward(trace: Trace, cost_lambda: float) -> float:
    """Task reward (0 when the episode failed or has none) minus λ · completion tokens / 1000."""
    return (trace.reward or 0.0) - cost_lambda * trace.completion_tokens / 1000


def scored_groups(groups: Sequence[Sequence[Trace]], no_signal: str, cost_lambda: float
                  ) -> tuple[list[tuple[list[Trace], list[float]]], int]:
    """The groups a topology update learns from, each with its episodes' outcome rewards (episodes without a recorded
    topology left out), and how many groups `no_signal: skip` left out for carrying no task-reward signal."""
    kept, skipped = [], 0
    for group in groups:
        group = [t for t in group if t.topology is not None]
        if not group:
            continue
        if no_signal == "skip" and not has_signal([t.reward if t.status == "ok" else None for t in group]):
            skipped += 1
            continue
        kept.append((group, [outcome_reward(t, cost_lambda) for t in group]))
    return kept, skipped


def action_reward(trace: Trace, nodes: frozenset[str] | set[str], token_cost: float, parse_penalty: float,
                  unused_penalty: float = 0.0) -> float:
    """Minus the cost of `nodes` in this episode: their completion tokens / 1000 · `token_cost`, `parse_penalty`
    per step of theirs whose output failed to parse and `unused_penalty` per step of theirs whose output nothing
    used."""
    steps = [s for s in trace.steps if s.node in nodes]
    tokens = sum(c.n_completion for s in steps for c in s.llm)
    unused = set(trace.unused_steps)
    return (-token_cost * tokens / 1000 - parse_penalty * sum(s.parse_error is not None for s in steps)
            - unused_penalty * sum(s.index in unused for s in steps))


class HRPO(TrainAlgorithm):
    """Updates a `TopologyPolicy` from groups of finished episodes that recorded their topology choice.

    Example:
        >>> hrpo = HRPO(policy, HRPOConfig(group_size=8))
        >>> metrics = hrpo.update([traces_of_query_1, traces_of_query_2])   # each a group of G traces
    """

    trains_adapters = False
    state_file = TOPOLOGY_FILE

    def __init__(self, policy: TopologyPolicy, config: HRPOConfig, group_size: int | None = None):
        self.policy, self.config = policy, config
        self.group_size = group_size or config.group_size
        self.optimizer = torch.optim.Adam(policy.parameters(), lr=config.lr)

    @classmethod
    def build(cls, ctx: TrainContext) -> HRPO:
        if ctx.topology is None:  # the compile check (`topology_problems`) refuses such a graph first
            raise MasgraphError("HRPO learns a topology, but the graph has no `topology:` section")
        return cls(ctx.topology, ctx.config.hrpo)

    def train_step(self, traces: list[Trace], step: int) -> dict[str, float]:
        return self.update(query_groups(traces, self.group_size))

    def update(self, groups: Sequence[Sequence[Trace]]) -> dict[str, float]:
        """One update (`ppo_epochs` optimizer steps) on these groups; bumps the policy version. Episodes
        without a recorded topology choice are ignored."""
        cfg = self.config
        rows: list[tuple[Trace, dict[str, float]]] = []  # (episode, decision -> advantage)
        rewards_seen: list[float] = []
        kept, skipped = scored_groups(groups, cfg.no_signal, cfg.cost_lambda)
        for group, rewards in kept:
            rewards_seen += rewards
            rows += [(t, adv) for t, adv in zip(group, self._advantages(group, rewards))]
        if not rows:
            return {"topology/episodes": 0.0, "topology/skipped_groups": float(skipped)}
        stats: dict[str, float] = {}
        for _ in range(cfg.ppo_epochs):
            loss, stats = self._loss(rows)
            if loss is None:
                break
            self.optimizer.zero_grad()
            loss.backward()
            self.optimizer.step()
        self.policy.version += 1
        out = {keys.TOPOLOGY_KL_OLD if k == "approx_kl" else f"{keys.TOPOLOGY}{k}": v for k, v in stats.items()}
        out["topology/episodes"] = float(len(rows))
        out["topology/skipped_groups"] = float(skipped)
        out["topology/reward"] = sum(rewards_seen) / len(rewards_seen)
        return out

    def _advantages(self, group: list[Trace], rewards: list[float]) -> list[dict[str, float]]:
        """Per episode, decision name -> A = Â_group + ω·Ã_action (decisions it made only)."""
        cfg, decisions = self.config, self.policy.space.decisions
        made = [t.topology.logprobs for t in group]  # type: ignore[union-attr]
        acts = [[action_reward(t, d.brings[d.options.index(t.topology.decisions[d.name])],  # type: ignore
                               cfg.token_cost, cfg.parse_penalty, cfg.unused_penalty) if d.name in m else None
                 for d in decisions]
                for t, m in zip(group, made)]
        combined = combine(group_advantages(rewards), action_advantages(acts), cfg.omega)
        return [{d.name: a for d, a in zip(decisions, row) if a is not None} for row in combined]

    def _loss(self, rows: list[tuple[Trace, dict[str, float]]]) -> tuple[torch.Tensor | None, dict[str, float]]:
        cfg = self.config
        new, old, adv, ent = [], [], [], []
        for t, a in rows:
            names, lp, h = self.policy.log_probs(t.query, t.topology)  # type: ignore[arg-type]
            for name, x, e in zip(names, lp, h):
                new.append(x)
                ent.append(e)
                old.append(t.topology.logprobs[name])  # type: ignore[union-attr]
                adv.append(a[name])
        if not new:
            return None, {}
        device = self.policy.device
        return hrpo_loss(torch.stack(new), torch.tensor(old, device=device), torch.tensor(adv, device=device),
                         torch.stack(ent), cfg.clip, cfg.entropy_coef)

    def state_dict(self) -> dict[str, Any]:
        """Everything a checkpoint needs for an exact resume: parameters, optimizer moments, version."""
        return {"policy": self.policy.state_dict(), "optimizer": self.optimizer.state_dict(),
                "version": self.policy.version, "decisions": self.policy.signature()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_signature(state, self.policy, "the checkpoint's topology state")
        self.policy.load_state_dict(state["policy"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.policy.version = state["version"]  # an older checkpoint's "baseline" (always None here) is ignored
