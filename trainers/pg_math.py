"""Policy-gradient math every algorithm shares: group-relative advantages, the PPO-clip surrogate, the k3 KL.

    group advantage   A_i = (R_i - mean_j R_j) / (std_j R_j + eps)      unbiased std; all 0 when the group has one
                                                                        member or no variance (GRPO)
    PPO-clip          l   = -min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A),  rho = exp(logp - old_logp)
    dual clip         l   = min(l, -c A) where A < 0                      (Ye et al. 2020; verl's clip_ratio_c)
    k3 KL             k3  = r - log r - 1,  r = pi_ref / pi_theta        (>= 0; an unbiased KL(pi_theta || pi_ref))

Flow-GRPO applies them to LLM tokens, HRPO to topology decisions; both import them from here, so the two cannot
drift apart. Pure functions, tested against hand-computed values.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["group_advantages", "kl_k3", "normalise", "ppo_clip_loss"]


def group_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """(R - mean) / (std + eps) over one group (unbiased std, as verl's GRPO); all 0 when the group has one member
    or no variance (a group that cannot tell its members apart pushes nothing)."""
    if rewards.numel() < 2 or bool((rewards == rewards[0]).all()):
        return torch.zeros_like(rewards)
    return (rewards - rewards.mean()) / (rewards.std() + eps)


def normalise(values: Sequence[float], eps: float = 1e-6) -> list[float]:
    """`group_advantages` of host floats, computed in float64 on the CPU (for per-decision bookkeeping)."""
    if not values:
        return []
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device="cpu")
    return group_advantages(t, eps).tolist()


def ppo_clip_loss(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor,
                  eps_low: float, eps_high: float, dual_clip: float | None = None) -> torch.Tensor:
    """Per-element -min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A), rho = exp(logp - old_logp): the policy is
    not pushed further once an action's probability has left the trust region (asymmetric: DAPO's clip-higher).
    For A < 0 that term is -rho A, unbounded as rho grows (the clip keeps the worse of the two): with `dual_clip`
    c > 1 it is capped at -c A, and a token whose ratio passed c pushes nothing (dual-clip PPO, Ye et al. 2020)."""
    ratio = torch.exp(logp - old_logp)
    loss = -torch.minimum(ratio * adv, torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * adv)
    if dual_clip is None:
        return loss
    return torch.where(adv < 0, torch.minimum(loss, -dual_clip * adv), loss)


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-element k3 estimator of KL(pi_theta || pi_ref): r - log r - 1 with r = pi_ref / pi_theta (>= 0)."""
    log_r = ref_logp - logp
    return torch.exp(log_r) - log_r - 1


def surprisal_bonus(old_logp: torch.Tensor, beta: float) -> torch.Tensor:
    """Per-token advantage term beta * (-log pi_old(a_t)): in expectation over sampled tokens, its policy gradient is
    beta times the gradient of the policy's entropy (grad H = -E[(log pi + 1) grad log pi], the +1 having mean 0)."""
    return -beta * old_logp
