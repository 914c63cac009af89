"""HRPO math (masgraph.trainers.hrpo_math) against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from masgraph.trainers.hrpo_math import (
    action_advantages,
    clipped_surrogate,
    combine,
    group_advantages,
    hrpo_loss,
    moving_average_advantages,
    reinforce_loss,
)


def _approx_rows(got: list[list[float | None]], want: list[list[float | None]]) -> None:
    """Row-by-row comparison where None must match None exactly and floats approximately."""
    assert len(got) == len(want)
    for g_row, w_row in zip(got, want):
        assert len(g_row) == len(w_row)
        for g, w in zip(g_row, w_row):
            if w is None:
                assert g is None
            else:
                assert g is not None and g == pytest.approx(w)


# ---- group_advantages ------------------------------------------------------------------------------------

def test_group_advantages_hand_computed():
    # mean 0.5; deviations +-0.5; unbiased var = (4 * 0.25) / 3 = 1/3; 0.5 / sqrt(1/3) = 0.8660254
    adv = group_advantages([1.0, 0.0, 0.0, 1.0], eps=0.0)
    s = 0.5 / math.sqrt(1 / 3)
    assert adv == pytest.approx([s, -s, -s, s])
    assert s == pytest.approx(0.8660254)
    # mean 2; deviations 1, -1, 0; unbiased var = 2 / 2 = 1 -> std 1 (+ eps in the denominator)
    assert group_advantages([3.0, 1.0, 2.0]) == pytest.approx([1 / (1 + 1e-6), -1 / (1 + 1e-6), 0.0])


def test_group_advantages_zero_for_equal_or_single():
    assert group_advantages([0.7, 0.7, 0.7]) == [0.0, 0.0, 0.0]
    assert group_advantages([0.7, 0.7, 0.7], eps=0.0) == [0.0, 0.0, 0.0]  # guarded, not 0/0
    assert group_advantages([1.0]) == [0.0]
    assert group_advantages([]) == []


# ---- action_advantages -----------------------------------------------------------------------------------

def test_action_advantages_columns():
    rows = [[1.0, None, 0.0, 2.0],
            [None, 5.0, 3.0, 2.0],
            [3.0, None, 6.0, None]]
    got = action_advantages(rows, eps=0.0)
    # col 0: values 1, 3 -> mean 2, deviations -1, +1, unbiased var = 2 / 1 = 2 -> +-1/sqrt(2); None stays None
    # col 1: one value -> 0.0
    # col 2: values 0, 3, 6 -> mean 3, deviations -3, 0, 3, unbiased var = 18 / 2 = 9 -> std 3 -> -1, 0, 1
    # col 3: all equal -> 0.0
    r = 1 / math.sqrt(2)
    _approx_rows(got, [[-r, None, -1.0, 0.0],
                       [None, 0.0, 0.0, 0.0],
                       [r, None, 1.0, None]])
    assert got[1][1] == 0.0 and got[0][3] == 0.0
    assert action_advantages([[0.1], [0.1], [0.1]], eps=0.0) == [[0.0], [0.0], [0.0]]  # all equal, not 0/0


def test_action_advantages_ragged_rows_rejected():
    with pytest.raises(ValueError, match="same length"):
        action_advantages([[1.0, 2.0], [1.0]])


# ---- combine ---------------------------------------------------------------------------------------------

def test_combine_hand_computed_and_none_propagates():
    got = combine([1.0, -1.0], [[0.5, None], [-2.0, 1.0]], omega=0.5)
    # 1 + 0.5 * 0.5 = 1.25; None; -1 + 0.5 * -2 = -2.0; -1 + 0.5 * 1 = -0.5
    _approx_rows(got, [[1.25, None], [-2.0, -0.5]])


# ---- moving_average_advantages ---------------------------------------------------------------------------

def test_moving_average_first_batch_is_centred():
    adv, b = moving_average_advantages([1.0, 0.0, 0.5], baseline=None, momentum=0.9)
    # mean = 1.5 / 3 = 0.5 is the baseline; new = 0.9 * 0.5 + 0.1 * 0.5 = 0.5
    assert adv == pytest.approx([0.5, -0.5, 0.0])
    assert b == pytest.approx(0.5)


def test_moving_average_second_batch_uses_previous_baseline():
    adv, b = moving_average_advantages([1.0, 1.0, 0.0, 1.0], baseline=0.5, momentum=0.9)
    # advantages against the old baseline 0.5 (not the batch mean 0.75)
    assert adv == pytest.approx([0.5, 0.5, -0.5, 0.5])
    # new baseline = 0.9 * 0.5 + 0.1 * 0.75 = 0.45 + 0.075 = 0.525
    assert b == pytest.approx(0.525)


# ---- clipped_surrogate -----------------------------------------------------------------------------------

def test_clipped_surrogate_hand_computed():
    ratios = torch.tensor([1.5, 1.5, 0.5, 0.5, 1.1, 1.1], dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0, 2.0, -2.0], dtype=torch.float64)
    old = torch.full_like(ratios, math.log(0.3))
    loss = clipped_surrogate(old + torch.log(ratios), old, adv, clip=0.2)
    assert loss.shape == ratios.shape
    expected = [
        -1.2,   # rho 1.5, A 1: min(1.5, 1.2) = 1.2
        1.5,    # rho 1.5, A -1: min(-1.5, -1.2) = -1.5
        -0.5,   # rho 0.5, A 1: min(0.5, 0.8) = 0.5
        0.8,    # rho 0.5, A -1: min(-0.5, -0.8) = -0.8
        -2.2,   # rho 1.1 inside the range, A 2: 2.2
        2.2,    # rho 1.1 inside the range, A -2: -2.2
    ]
    assert loss.tolist() == pytest.approx(expected)


# ---- hrpo_loss -------------------------------------------------------------------------------------------

def _hrpo_example() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    old = torch.log(torch.tensor([0.5, 0.4, 0.2], dtype=torch.float64))
    logp = torch.log(torch.tensor([0.75, 0.4, 0.1], dtype=torch.float64)).requires_grad_(True)  # ratios 1.5, 1, .5
    adv = torch.tensor([1.0, -2.0, -1.0], dtype=torch.float64)
    entropy = torch.tensor([0.6, 0.9, 0.3], dtype=torch.float64)
    return logp, old, adv, entropy


def test_hrpo_loss_hand_computed():
    logp, old, adv, entropy = _hrpo_example()
    loss, stats = hrpo_loss(logp, old, adv, entropy, clip=0.2, entropy_coef=0.1)
    # surrogates: rho 1.5 A 1 -> -1.2; rho 1 A -2 -> 2.0; rho 0.5 A -1 -> min(-0.5, -0.8) = -0.8 -> 0.8
    policy = (-1.2 + 2.0 + 0.8) / 3  # = 0.5333...
    ent = (0.6 + 0.9 + 0.3) / 3  # = 0.6
    assert loss.item() == pytest.approx(policy - 0.1 * ent)  # 0.5333 - 0.06 = 0.4733
    assert stats["loss"] == pytest.approx(0.47333333)
    assert stats["policy_loss"] == pytest.approx(policy)
    assert stats["entropy"] == pytest.approx(0.6)
    assert stats["clip_frac"] == pytest.approx(2 / 3)  # ratios 1.5 and 0.5 are outside [0.8, 1.2]
    # mean(old - logp) = (log(0.5/0.75) + 0 + log(0.2/0.1)) / 3 = log(4/3) / 3
    assert stats["approx_kl"] == pytest.approx(math.log(4 / 3) / 3)
    assert set(stats) == {"loss", "policy_loss", "entropy", "clip_frac", "approx_kl"}
    assert all(isinstance(v, float) for v in stats.values())


def test_hrpo_loss_gradient_flows_to_logp():
    logp, old, adv, entropy = _hrpo_example()
    loss, _ = hrpo_loss(logp, old, adv, entropy, clip=0.2, entropy_coef=0.1)
    loss.backward()
    assert logp.grad is not None
    assert bool(logp.grad.abs().sum() > 0)
    # clipped decisions (0 and 2) get no gradient; decision 1: d/dlogp of -(rho * A) / 3 = -(1 * -2) / 3 = 2/3
    assert logp.grad.tolist() == pytest.approx([0.0, 2 / 3, 0.0])


def test_hrpo_loss_empty_raises():
    e = torch.empty(0)
    with pytest.raises(ValueError, match="no decisions"):
        hrpo_loss(e, e, e, e, clip=0.2, entropy_coef=0.01)


# ---- reinforce_loss --------------------------------------------------------------------------------------

def test_reinforce_loss_hand_computed_and_gradient_sign():
    logp = torch.tensor([-1.0, -2.0, -0.5], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([0.5, -0.5, 0.0], dtype=torch.float64)
    loss = reinforce_loss(logp, adv)
    # products: -0.5, 1.0, 0.0 -> mean 0.5 / 3 -> loss -1/6
    assert loss.item() == pytest.approx(-1 / 6)
    loss.backward()
    assert logp.grad is not None
    # d loss / d logp_i = -adv_i / 3
    assert logp.grad.tolist() == pytest.approx([-1 / 6, 1 / 6, 0.0])
    assert logp.grad[0] < 0  # positive advantage: descending the loss raises log p
    assert logp.grad[1] > 0
