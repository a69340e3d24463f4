"""Generalised Advantage Estimation (Schulman et al. 2016) over masked responses."""

from __future__ import annotations

from typing import Tuple

import torch

from puzzle.algorithms.masked import check_same_shape, masked_whiten

__all__ = ["compute_gae"]


def compute_gae(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float,
    whiten_advantages: bool = True,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """GAE advantages and value targets.

    For the valid positions ``t_1 < t_2 < ... < t_n`` of a row (mask != 0)::

        delta_k = r[t_k] + gamma * V[t_{k+1}] - V[t_k]      (V[t_{n+1}] := 0)
        A[t_k]  = delta_k + gamma * lam * A[t_{k+1}]        (A[t_{n+1}] := 0)
        R[t_k]  = A[t_k] + V[t_k]

    i.e. bootstrapping is 0 after the last valid token, and invalid positions (trailing
    padding, or holes such as masked-out tool output) are skipped entirely: their
    rewards/values never enter the recursion.

    Args:
        token_rewards: ``[B, R]`` per-token rewards (e.g. from ``compute_token_rewards``).
        values: ``[B, R]`` critic values of the rollout (old values).
        mask: ``[B, R]`` 0/1 response mask.
        gamma: discount in ``[0, 1]``.
        lam: GAE lambda in ``[0, 1]``.
        whiten_advantages: whiten the advantages over the valid entries of the whole
            batch (``masked_whiten``, mean shifted to 0). Returns are never whitened.

    Returns:
        ``(advantages [B, R], returns [B, R])``, detached, 0 at invalid positions.
    """
    check_same_shape("token_rewards", token_rewards, values=values, mask=mask)
    if token_rewards.dim() != 2:
        raise ValueError(f"token_rewards must be 2-D [B, R], got shape {tuple(token_rewards.shape)}")
    for name, x in (("gamma", gamma), ("lam", lam)):
        if not 0.0 <= x <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {x}")

    with torch.no_grad():
        valid = mask != 0
        zeros = torch.zeros_like(values)
        rewards = torch.where(valid, token_rewards.to(values.dtype), zeros)
        vals = torch.where(valid, values, zeros)

        next_value = values.new_zeros(values.shape[0])
        last_gae = values.new_zeros(values.shape[0])
        advs_reversed = []
        for t in reversed(range(values.shape[1])):
            m = valid[:, t]
            delta = rewards[:, t] + gamma * next_value - vals[:, t]
            gae = delta + gamma * lam * last_gae
            advs_reversed.append(torch.where(m, gae, torch.zeros_like(gae)))
            next_value = torch.where(m, vals[:, t], next_value)
            last_gae = torch.where(m, gae, last_gae)
        if advs_reversed:
            advantages = torch.stack(advs_reversed[::-1], dim=1)
        else:  # R == 0
            advantages = zeros
        returns = torch.where(valid, advantages + vals, zeros)
        if whiten_advantages:
            advantages = masked_whiten(advantages, mask, shift_mean=True)
    return advantages, returns
