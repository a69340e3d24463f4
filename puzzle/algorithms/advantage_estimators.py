"""Advantage estimators of the GRPO family, and the registry behind ``--advantage-estimator``.

Every estimator is a pure function over masked ``[B, R]`` token tensors (B samples, R response
positions). Group-based estimators take ``group_index`` ``[B]`` (long): samples with the same
index were generated from the same prompt (``--n-samples-per-prompt``). Meanings follow verl's
``core_algos`` (GRPO, Dr. GRPO, RLOO, REINFORCE++, REINFORCE++-baseline, ReMax):

* the *sequence score* of a sample is the sum of its valid token rewards (the reward function's
  score on the last token, minus the per-token KL penalty when KL is in the reward);
* every estimator returns ``(advantages [B, R], returns [B, R])``, 0 at invalid positions;
  ``returns`` are the critic's targets for GAE and the (unwhitened) reward-to-go elsewhere.

``ESTIMATORS[name]`` says what each needs (a critic, groups, a greedy baseline), which is what
the role set (no critic unless GAE) and the argument checks are built from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch

from puzzle.algorithms.advantages import compute_gae
from puzzle.algorithms.masked import check_same_shape, masked_sum, masked_whiten

__all__ = ["ESTIMATORS", "EstimatorSpec", "compute_advantages", "group_mean_std", "grpo_advantages",
           "reinforce_plus_plus_advantages", "reinforce_plus_plus_baseline_advantages",
           "remax_advantages", "rloo_advantages", "sequence_scores"]

GROUP_EPS = 1e-6  # verl's epsilon in (score - mean) / (std + eps)


def _check(token_rewards: torch.Tensor, mask: torch.Tensor, group_index: Optional[torch.Tensor] = None):
    check_same_shape("token_rewards", token_rewards, mask=mask)
    if token_rewards.dim() != 2:
        raise ValueError(f"token_rewards must be 2-D [B, R], got shape {tuple(token_rewards.shape)}")
    if group_index is not None and tuple(group_index.shape) != (token_rewards.shape[0],):
        raise ValueError(f"group_index must have shape ({token_rewards.shape[0]},), "
                         f"got {tuple(group_index.shape)}")


def sequence_scores(token_rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B, R] -> [B]``: the sum of each row's valid token rewards."""
    return masked_sum(token_rewards, mask, dim=-1)


def group_mean_std(scores: torch.Tensor, group_index: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor,
                                                                               torch.Tensor]:
    """Per-sample mean, unbiased std and size of its group.

    Args:
        scores: ``[B]``.
        group_index: ``[B]`` long, any labels (not necessarily contiguous or sorted).

    Returns:
        ``(mean [B], std [B], size [B])``. A group of one sample has mean 0 and std 1 (verl's
        convention: its score passes through unchanged).
    """
    _, inverse = torch.unique(group_index, return_inverse=True)
    G = int(inverse.max()) + 1 if inverse.numel() else 0
    x = scores.to(torch.float64)
    zeros = torch.zeros(G, dtype=torch.float64, device=x.device)
    size = zeros.index_add(0, inverse, torch.ones_like(x))
    total = zeros.index_add(0, inverse, x)
    mean = total / size
    sq = zeros.index_add(0, inverse, (x - mean[inverse]) ** 2)
    std = torch.sqrt(sq / (size - 1).clamp(min=1))
    single = size < 2
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    return (mean[inverse].to(scores.dtype), std[inverse].to(scores.dtype), size[inverse].to(scores.dtype))


def _broadcast(per_sample: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B] -> [B, R]``: the per-sample value on every valid position, 0 elsewhere."""
    x = per_sample.unsqueeze(1).expand(mask.shape)
    return torch.where(mask != 0, x, torch.zeros_like(x))


def grpo_advantages(token_rewards: torch.Tensor, mask: torch.Tensor, group_index: torch.Tensor,
                    std_normalization: bool = True, eps: float = GROUP_EPS):
    """GRPO (Shao et al. 2024): ``A_i = (s_i - mean_g) / (std_g + eps)`` on every valid token;
    with ``std_normalization=False`` (Dr. GRPO, Liu et al. 2025) ``A_i = s_i - mean_g``.

    Args:
        token_rewards, mask: ``[B, R]``; group_index: ``[B]``.
    Returns:
        ``(advantages [B, R], returns [B, R])`` with returns = advantages (verl).
    """
    _check(token_rewards, mask, group_index)
    with torch.no_grad():
        s = sequence_scores(token_rewards, mask)
        mean, std, _ = group_mean_std(s, group_index)
        a = (s - mean) / (std + eps) if std_normalization else s - mean
        adv = _broadcast(a, mask)
    return adv, adv


def rloo_advantages(token_rewards: torch.Tensor, mask: torch.Tensor, group_index: torch.Tensor):
    """RLOO (Ahmadian et al. 2024): ``A_i = s_i - mean_{j != i} s_j = n/(n-1) * (s_i - mean_g)``;
    a group of one sample keeps its score. Shapes as :func:`grpo_advantages`."""
    _check(token_rewards, mask, group_index)
    with torch.no_grad():
        s = sequence_scores(token_rewards, mask)
        mean, _, n = group_mean_std(s, group_index)
        a = torch.where(n > 1, (s - mean) * n / (n - 1).clamp(min=1), s)
        adv = _broadcast(a, mask)
    return adv, adv


def _reward_to_go(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """``G_t = r_t + gamma * G_{t+1}`` over the valid positions of each row (0 elsewhere)."""
    valid = mask != 0
    r = torch.where(valid, token_rewards, torch.zeros_like(token_rewards))
    out = torch.zeros_like(r)
    running = r.new_zeros(r.shape[0])
    for t in reversed(range(r.shape[1])):
        running = torch.where(valid[:, t], r[:, t] + gamma * running, running)
        out[:, t] = torch.where(valid[:, t], running, torch.zeros_like(running))
    return out


def reinforce_plus_plus_advantages(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0):
    """REINFORCE++ (Hu 2025): discounted reward-to-go, whitened over the whole batch.

    Returns ``(masked_whiten(G), G)`` with ``G_t = r_t + gamma * G_{t+1}`` ``[B, R]``."""
    _check(token_rewards, mask)
    with torch.no_grad():
        ret = _reward_to_go(token_rewards, mask, gamma)
        adv = masked_whiten(ret, mask, shift_mean=True)
    return adv, ret


def reinforce_plus_plus_baseline_advantages(token_rewards: torch.Tensor, mask: torch.Tensor,
                                            group_index: torch.Tensor):
    """REINFORCE++-baseline: ``s_i - mean_g`` on every valid token, whitened over the batch.
    Shapes as :func:`grpo_advantages`; returns are the unwhitened group-centred scores."""
    _check(token_rewards, mask, group_index)
    with torch.no_grad():
        s = sequence_scores(token_rewards, mask)
        mean, _, _ = group_mean_std(s, group_index)
        centred = _broadcast(s - mean, mask)
        adv = masked_whiten(centred, mask, shift_mean=True)
    return adv, centred


def remax_advantages(token_rewards: torch.Tensor, mask: torch.Tensor, baseline_scores: torch.Tensor):
    """ReMax (Li et al. 2023): reward-to-go (gamma 1) minus the score of the greedy response to
    the same prompt, ``baseline_scores`` ``[B]``. Returns ``(G - b, G)`` ``[B, R]``."""
    _check(token_rewards, mask)
    if tuple(baseline_scores.shape) != (token_rewards.shape[0],):
        raise ValueError(f"baseline_scores must have shape ({token_rewards.shape[0]},), "
                         f"got {tuple(baseline_scores.shape)}")
    with torch.no_grad():
        ret = _reward_to_go(token_rewards, mask, 1.0)
        adv = torch.where(mask != 0, ret - baseline_scores.to(ret.dtype).unsqueeze(1), torch.zeros_like(ret))
    return adv, ret


@dataclass(frozen=True)
class EstimatorSpec:
    fn: Callable
    needs_critic: bool = False      # GAE: values from a critic, which is then trained
    needs_groups: bool = False      # a baseline from the other samples of the prompt (N >= 2)
    needs_greedy_baseline: bool = False  # ReMax: one greedy response per prompt, scored


ESTIMATORS = {
    "gae": EstimatorSpec(compute_gae, needs_critic=True),
    "grpo": EstimatorSpec(grpo_advantages, needs_groups=True),
    "rloo": EstimatorSpec(rloo_advantages, needs_groups=True),
    "reinforce_plus_plus": EstimatorSpec(reinforce_plus_plus_advantages),
    "reinforce_plus_plus_baseline": EstimatorSpec(reinforce_plus_plus_baseline_advantages, needs_groups=True),
    "remax": EstimatorSpec(remax_advantages, needs_greedy_baseline=True),
}


def compute_advantages(name: str, token_rewards: torch.Tensor, mask: torch.Tensor, *,
                       values: Optional[torch.Tensor] = None, group_index: Optional[torch.Tensor] = None,
                       baseline_scores: Optional[torch.Tensor] = None, gamma: float = 1.0,
                       lam: float = 0.95, whiten_advantages: bool = True,
                       std_normalization: bool = True) -> Tuple[torch.Tensor, torch.Tensor]:
    """Dispatch to the estimator ``name`` with the arguments it takes (see ``ESTIMATORS``)."""
    if name not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}; expected one of {', '.join(ESTIMATORS)}")
    fn = ESTIMATORS[name].fn
    if name == "gae":
        return fn(token_rewards, values, mask, gamma, lam, whiten_advantages=whiten_advantages)
    if name == "grpo":
        return fn(token_rewards, mask, group_index, std_normalization=std_normalization)
    if name in ("rloo", "reinforce_plus_plus_baseline"):
        return fn(token_rewards, mask, group_index)
    if name == "reinforce_plus_plus":
        return fn(token_rewards, mask, gamma)
    return fn(token_rewards, mask, baseline_scores)
