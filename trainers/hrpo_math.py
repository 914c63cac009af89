"""HRPO math (MasHost-style topology RL, reconstructed): advantages and losses for a topology policy.

A topology policy samples, per episode, a few discrete decisions (is a node on, which successor a router
picks). For one query, G episodes (a group) are run; episode i gets an outcome reward R_i, and each decision
d it actually made gets an action-wise reward r_{i,d} (e.g. minus the token cost of the node it switched on).
Decisions are aligned across a group's episodes by name; an episode that skipped decision d has None there.

    group advantage     g_i     = (R_i - mean_j R_j) / (std_j R_j + eps)            (unbiased std; 0 if G < 2
                                                                                      or all R equal)
    action advantage    a_{i,d} = (r_{i,d} - mean_j r_{j,d}) / (std_j r_{j,d} + eps) over the episodes j that
                                  took d (0 if fewer than 2 or all equal; None where i did not take d)
    combined            A_{i,d} = g_i + omega * a_{i,d}                              (None where a_{i,d} is None)
    surrogate           l_{i,d} = -min(rho A, clip(rho, 1 - clip, 1 + clip) A),  rho = exp(logp - old_logp)
    HRPO loss           L       = mean_{(i,d)} l_{i,d} - entropy_coef * mean_{(i,d)} H_{i,d}

The GPTSwarm-style baseline for comparison is REINFORCE with a moving-average baseline, no group
normalisation:

    advantage           u_i - b,   b = the baseline before this batch (mean of this batch's u if none yet)
    new baseline        b' = momentum * b + (1 - momentum) * mean_i u_i
    REINFORCE loss      L  = -mean_i(log p(G_i) * adv_i),  log p(G_i) = sum of episode i's decision log-probs

Everything here is a pure function, tested against hand-computed values; the normalisation and the PPO-clip
surrogate are Flow-GRPO's own (`pg_math`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from masgraph.trainers.pg_math import normalise, ppo_clip_loss

__all__ = ["action_advantages", "clipped_surrogate", "combine", "group_advantages", "has_signal", "hrpo_loss",
           "moving_average_advantages", "reinforce_loss"]


def group_advantages(rewards: Sequence[float], eps: float = 1e-6) -> list[float]:
    """Outcome advantage of each episode of one group: its reward normalised over the group (GRPO), so that
    only how an episode compares with its siblings on the same query pushes the policy."""
    return normalise(list(rewards), eps)


def has_signal(task_rewards: Sequence[float | None]) -> bool:
    """Whether a group's episodes disagree on the task reward (a failed episode's None counts as 0): only then does
    the group say which topology works; cost differences alone say only which is cheapest."""
    return len({0.0 if r is None else float(r) for r in task_rewards}) > 1


def action_advantages(action_rewards: Sequence[Sequence[float | None]],
                      eps: float = 1e-6) -> list[list[float | None]]:
    """Per-decision advantages of one group: column d (decision slot d, aligned by name) is normalised over
    the episodes that took d, so a decision's reward is compared only with other takes of the same decision.
    None (decision not taken) stays None; a column with fewer than 2 values or no variance gives 0.0."""
    rows = [list(r) for r in action_rewards]
    if not rows:
        return []
    width = len(rows[0])
    if any(len(r) != width for r in rows):
        raise ValueError(f"action_rewards rows must all have the same length (decision slots); got lengths "
                         f"{[len(r) for r in rows]}")
    out: list[list[float | None]] = [[None] * width for _ in rows]
    for d in range(width):
        taken = [(i, float(v)) for i, r in enumerate(rows) if (v := r[d]) is not None]
        normed = normalise([v for _, v in taken], eps)
        for (i, _), a in zip(taken, normed):
            out[i][d] = a
    return out


def combine(group_adv: Sequence[float], action_adv: Sequence[Sequence[float | None]],
            omega: float) -> list[list[float | None]]:
    """A_{i,d} = group_adv[i] + omega * action_adv[i][d]: each decision taken is pushed by its episode's
    outcome and, weighted by omega, by its own action-wise reward; None where the decision was not taken."""
    if len(group_adv) != len(action_adv):
        raise ValueError(f"group_adv has {len(group_adv)} episodes but action_adv has {len(action_adv)}")
    return [[None if a is None else g + omega * a for a in row] for g, row in zip(group_adv, action_adv)]


def moving_average_advantages(rewards: Sequence[float], baseline: float | None,
                              momentum: float) -> tuple[list[float], float]:
    """GPTSwarm-style REINFORCE advantages u_i - b against the baseline b from before this batch (this
    batch's mean when there is none yet, so the first batch is centred); returns them with the updated
    baseline momentum * b + (1 - momentum) * mean(rewards)."""
    if len(rewards) == 0:
        raise ValueError("moving_average_advantages needs at least one reward")
    mean = sum(float(u) for u in rewards) / len(rewards)
    b = mean if baseline is None else float(baseline)
    return [float(u) - b for u in rewards], momentum * b + (1 - momentum) * mean


def clipped_surrogate(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, clip: float) -> torch.Tensor:
    """Per-decision PPO-clip loss (`pg_math.ppo_clip_loss` with a symmetric trust region)."""
    return ppo_clip_loss(logp, old_logp, adv, clip, clip)


def hrpo_loss(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, entropy: torch.Tensor, clip: float,
              entropy_coef: float) -> tuple[torch.Tensor, dict[str, float]]:
    """mean(clipped_surrogate) - entropy_coef * mean(entropy) over every decision taken in the batch (1-D
    tensors, one entry per decision), with stats for logging: loss, policy_loss, entropy, clip_frac (share
    of ratios outside [1 - clip, 1 + clip]) and approx_kl (mean(old_logp - logp))."""
    shapes = {tuple(t.shape) for t in (logp, old_logp, adv, entropy)}
    if len(shapes) != 1 or logp.dim() != 1:
        raise ValueError(f"hrpo_loss needs 1-D tensors of one shape; got logp {tuple(logp.shape)}, old_logp "
                         f"{tuple(old_logp.shape)}, adv {tuple(adv.shape)}, entropy {tuple(entropy.shape)}")
    if logp.numel() == 0:
        raise ValueError("hrpo_loss got no decisions: the batch must hold at least one decision taken")
    policy_loss = clipped_surrogate(logp, old_logp, adv, clip).mean()
    mean_entropy = entropy.mean()
    loss = policy_loss - entropy_coef * mean_entropy
    with torch.no_grad():
        ratio = torch.exp(logp - old_logp)
        clipped = (ratio < 1 - clip) | (ratio > 1 + clip)
        stats = {"loss": loss.item(), "policy_loss": policy_loss.item(), "entropy": mean_entropy.item(),
                 "clip_frac": clipped.float().mean().item(), "approx_kl": (old_logp - logp).mean().item()}
    return loss, stats


def reinforce_loss(logp_episode: torch.Tensor, adv: torch.Tensor) -> torch.Tensor:
    """GPTSwarm's REINFORCE loss -mean_i(log p(G_i) * adv_i), logp_episode[i] being episode i's summed
    decision log-probs: raises the probability of whole topologies that beat the baseline."""
    if logp_episode.shape != adv.shape:
        raise ValueError(f"logp_episode {tuple(logp_episode.shape)} and adv {tuple(adv.shape)} differ in shape")
    if logp_episode.numel() == 0:
        raise ValueError("reinforce_loss got no episodes")
    return -(logp_episode * adv).mean()
