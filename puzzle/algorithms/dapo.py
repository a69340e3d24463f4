"""DAPO (Yu et al. 2025) pieces that are not losses: overlong reward shaping and the group filter
of dynamic sampling. Pure functions over ``[B]`` tensors."""

from __future__ import annotations

import torch

__all__ = ["overlong_penalty", "informative_groups"]


def overlong_penalty(response_lengths: torch.Tensor, max_new_tokens: int, buffer_len: int,
                     penalty_factor: float = 1.0) -> torch.Tensor:
    """Soft overlong punishment, added to the sequence score.

    With ``L = max_new_tokens`` and the buffer ``[L - buffer_len, L]``, a response of ``n`` tokens
    gets ``min(0, -(n - (L - buffer_len)) / buffer_len * penalty_factor)``: 0 up to the buffer,
    then linearly down to ``-penalty_factor`` at ``L``.

    Args:
        response_lengths: ``[B]`` tokens per response (EOS included).
    Returns:
        ``[B]`` float32 penalties (<= 0).
    """
    if not 0 < buffer_len <= max_new_tokens:
        raise ValueError(f"buffer_len must be in [1, max_new_tokens={max_new_tokens}], got {buffer_len}")
    exceed = response_lengths.to(torch.float64) - (max_new_tokens - buffer_len)
    return (-exceed / buffer_len * penalty_factor).clamp(max=0.0).to(torch.float32)


def informative_groups(scores: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """DAPO dynamic sampling keeps the groups whose scores are not all equal.

    Args:
        scores: ``[B]``; group_index: ``[B]`` long labels.
    Returns:
        ``[B]`` bool: True where the sample's group has at least two different scores.
    """
    _, inverse = torch.unique(group_index, return_inverse=True)
    G = int(inverse.max()) + 1 if inverse.numel() else 0
    x = scores.to(torch.float64)
    lo = torch.full((G,), float("inf"), dtype=torch.float64, device=x.device).scatter_reduce(0, inverse, x, "amin")
    hi = torch.full((G,), float("-inf"), dtype=torch.float64, device=x.device).scatter_reduce(0, inverse, x, "amax")
    return (hi > lo)[inverse]
