"""The GRPO-family estimators, DAPO shaping/filtering and clip-higher against hand-computed values."""

import pytest
import torch

from puzzle.algorithms import compute_gae, policy_loss
from puzzle.algorithms.advantage_estimators import (
    ESTIMATORS,
    compute_advantages,
    group_mean_std,
    grpo_advantages,
    reinforce_plus_plus_advantages,
    reinforce_plus_plus_baseline_advantages,
    remax_advantages,
    rloo_advantages,
)
from puzzle.algorithms.dapo import informative_groups, overlong_penalty

F64 = torch.float64


def close(a, b, tol=1e-5):
    torch.testing.assert_close(torch.as_tensor(a, dtype=F64), torch.as_tensor(b, dtype=F64), atol=tol, rtol=0)


# 4 samples, 2 groups of 2; valid lengths 3, 2, 1, 3; sequence scores 1, 2, 3, 5 (split over tokens,
# garbage at invalid positions must not count)
MASK = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]], dtype=torch.float32)
REW = torch.tensor([[0.0, 0.5, 0.5], [0.0, 2.0, 99.0], [3.0, 99.0, 99.0], [1.0, 0.0, 4.0]])
GROUPS = torch.tensor([0, 0, 1, 1])


def rows(per_row):
    return torch.tensor(per_row, dtype=F64).unsqueeze(1) * MASK.to(F64)


def test_grpo_and_dr_grpo():
    # group 0: mean 1.5, unbiased std sqrt(0.5); group 1: mean 4, std sqrt(2)
    adv, ret = grpo_advantages(REW, MASK, GROUPS)
    a = 0.5 / (0.5 ** 0.5 + 1e-6)
    b = 1.0 / (2 ** 0.5 + 1e-6)
    close(adv, rows([-a, a, -b, b]))
    close(ret, adv)
    adv, _ = grpo_advantages(REW, MASK, GROUPS, std_normalization=False)
    close(adv, rows([-0.5, 0.5, -1.0, 1.0]))


def test_rloo_is_score_minus_mean_of_the_others():
    adv, _ = rloo_advantages(REW, MASK, GROUPS)
    close(adv, rows([1 - 2, 2 - 1, 3 - 5, 5 - 3]))
    # groups of 3: s = 1, 2, 6 -> 1 - 4, 2 - 3.5, 6 - 1.5
    m = torch.ones(3, 1)
    adv, _ = rloo_advantages(torch.tensor([[1.0], [2.0], [6.0]]), m, torch.tensor([7, 7, 7]))
    close(adv.flatten(), [-3.0, -1.5, 4.5])


def test_singleton_group_keeps_its_score():
    mean, std, size = group_mean_std(torch.tensor([4.0, 1.0, 3.0]), torch.tensor([0, 1, 1]))
    close(mean, [0.0, 2.0, 2.0])
    close(std, [1.0, 2 ** 0.5, 2 ** 0.5])
    close(size, [1, 2, 2])


def test_reinforce_plus_plus_whitens_discounted_returns():
    rew = torch.tensor([[0.0, 1.0], [0.0, 3.0]])
    m = torch.ones(2, 2)
    adv, ret = reinforce_plus_plus_advantages(rew, m, gamma=0.5)
    close(ret, [[0.5, 1.0], [1.5, 3.0]])
    # mean 1.5, unbiased var 3.5 / 3
    std = (3.5 / 3) ** 0.5
    close(adv, [[-1.0 / std, -0.5 / std], [0.0, 1.5 / std]], tol=1e-4)


def test_reinforce_plus_plus_baseline():
    adv, centred = reinforce_plus_plus_baseline_advantages(REW, MASK, GROUPS)
    close(centred, rows([-0.5, 0.5, -1.0, 1.0]))
    # 9 valid entries: mean 1/6, sum of squared deviations 5 -> unbiased std sqrt(5/8)
    std = (5 / 8) ** 0.5
    close(adv, rows([(-0.5 - 1 / 6) / std, (0.5 - 1 / 6) / std, (-1 - 1 / 6) / std, (1 - 1 / 6) / std]), tol=1e-4)


def test_remax_subtracts_the_greedy_score():
    rew = torch.tensor([[0.0, 1.0], [3.0, 99.0]])  # 99 sits at an invalid position
    adv, ret = remax_advantages(rew, torch.tensor([[1.0, 1.0], [1.0, 0.0]]), torch.tensor([2.0, 1.0]))
    close(ret, [[1.0, 1.0], [3.0, 0.0]])
    close(adv, [[-1.0, -1.0], [2.0, 0.0]])


def test_registry_dispatch_and_gae_unchanged():
    assert set(ESTIMATORS) == {"gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax"}
    assert [n for n, s in ESTIMATORS.items() if s.needs_critic] == ["gae"]
    values = torch.tensor([[0.1, 0.2, 0.3], [0.0, 0.5, 0.0], [1.0, 0.0, 0.0], [0.2, 0.2, 0.2]])
    a1, r1 = compute_advantages("gae", REW, MASK, values=values, gamma=0.9, lam=0.8)
    a2, r2 = compute_gae(REW, values, MASK, 0.9, 0.8)
    assert torch.equal(a1, a2) and torch.equal(r1, r2)
    close(compute_advantages("rloo", REW, MASK, group_index=GROUPS)[0], rloo_advantages(REW, MASK, GROUPS)[0])
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'"):
        compute_advantages("ppo", REW, MASK)
    with pytest.raises(ValueError, match="group_index must have shape"):
        grpo_advantages(REW, MASK, torch.tensor([0, 1]))


def test_overlong_penalty_and_group_filter():
    # L = 10, buffer 4: free up to 6 tokens, then -1/4 per token
    close(overlong_penalty(torch.tensor([5, 6, 8, 10]), 10, 4, 1.0), [0.0, 0.0, -0.5, -1.0])
    close(overlong_penalty(torch.tensor([10]), 10, 4, 0.5), [-0.5])
    keep = informative_groups(torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5]), torch.tensor([0, 0, 1, 1, 2, 2]))
    assert keep.tolist() == [False, False, True, True, False, False]


def test_clip_higher():
    lp = torch.log(torch.tensor([[1.25]]))
    old, adv, m = torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1)
    sym = policy_loss(lp, old, adv, m, clip_eps=0.2)[0]
    high = policy_loss(lp, old, adv, m, clip_eps=0.2, clip_eps_high=0.28)[0]
    close(sym, -1.2)
    close(high, -1.25)
    # the lower bound still clips at 1 - 0.2 for negative advantages
    low = policy_loss(torch.log(torch.tensor([[0.5]])), old, -adv, m, clip_eps=0.2, clip_eps_high=0.28)[0]
    close(low, 0.8)
