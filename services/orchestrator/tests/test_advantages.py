import math

import pytest

from primerl_orchestrator.advantages import STD_EPSILON, group_advantages, is_zero_advantage


def test_reward_minus_group_mean():
    assert group_advantages([1.0, 0.0, 0.5, 0.5], std_normalize=False) == [0.5, -0.5, 0.0, 0.0]


def test_std_normalisation():
    advantages = group_advantages([1.0, 0.0], std_normalize=True)
    assert advantages == pytest.approx([0.5 / (0.5 + STD_EPSILON), -0.5 / (0.5 + STD_EPSILON)])
    assert math.fsum(advantages) == pytest.approx(0.0)


def test_equal_rewards_give_exact_zeros_and_are_filtered():
    # 0.1 * 3 / 3 is not 0.1 in floats: equal rewards must still give exact zeros.
    advantages = group_advantages([0.1, 0.1, 0.1], std_normalize=True)
    assert advantages == [0.0, 0.0, 0.0]
    assert is_zero_advantage(advantages)
    assert not is_zero_advantage(group_advantages([0.1, 0.2], std_normalize=False))


def test_single_and_empty_groups():
    assert group_advantages([0.7], std_normalize=True) == [0.0]
    assert group_advantages([], std_normalize=False) == []
