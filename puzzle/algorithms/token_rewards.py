"""Turning sequence-level scores into per-token PPO rewards, and score normalisation."""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from puzzle.algorithms.kl import kl_penalty
from puzzle.algorithms.masked import check_same_shape

__all__ = ["last_valid_index", "compute_token_rewards", "normalize_scores", "fold_moments", "running_std"]


def last_valid_index(mask: torch.Tensor) -> torch.Tensor:
    """Index of the last non-zero entry of each row of ``mask`` ``[B, R]``.

    Returns:
        ``[B]`` int64; ``-1`` for rows without any valid entry.
    """
    if mask.dim() != 2:
        raise ValueError(f"mask must be 2-D [B, R], got shape {tuple(mask.shape)}")
    positions = torch.arange(mask.shape[1], device=mask.device).expand(mask.shape)
    return torch.where(mask != 0, positions, torch.full_like(positions, -1)).max(dim=1).values


def compute_token_rewards(
    scores: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    kl_coef: float,
    kl_kind: str = "k1",
    clip_reward: Optional[float] = None,
    turn_rewards: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-token rewards ``-kl_coef * kl`` plus the sequence score on the last valid token; with
    ``turn_rewards`` (multi-turn: ``[B, R]``, the rewards an environment gave per turn, each at the
    last token of its turn) those stay where they are and the last valid token gets the rest of the
    score (score - their sum): GAE credits each turn's reward from its turn on, the row's sum (what
    the group estimators read) is the score either way.

    Args:
        scores: ``[B]`` reward-model score per sequence.
        logprobs: ``[B, R]`` actor (rollout) log-probs of the response tokens.
        ref_logprobs: ``[B, R]`` reference log-probs.
        mask: ``[B, R]`` 0/1 response mask; rows may have different lengths (and may
            be empty: such a row gets neither KL penalty nor score).
        kl_coef: KL penalty coefficient (``>= 0``), e.g. ``kl_controller.value``.
        kl_kind: estimator, see :func:`puzzle.algorithms.kl.kl_penalty`.
        clip_reward: if given (``> 0``), scores are clipped to ``[-clip_reward, clip_reward]``
            before being added (the KL part is not clipped).

    Returns:
        ``(token_rewards [B, R], kl [B, R])``; both are 0 at invalid positions.
        Gradients are not blocked here; call under ``torch.no_grad()`` as usual.
    """
    check_same_shape("logprobs", logprobs, ref_logprobs=ref_logprobs, mask=mask)
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be 2-D [B, R], got shape {tuple(logprobs.shape)}")
    if not isinstance(scores, torch.Tensor) or scores.shape != logprobs.shape[:1]:
        shape = tuple(scores.shape) if isinstance(scores, torch.Tensor) else type(scores).__name__
        raise ValueError(f"scores must have shape ({logprobs.shape[0]},), got {shape}")
    if not math.isfinite(kl_coef) or kl_coef < 0:
        raise ValueError(f"kl_coef must be a finite number >= 0, got {kl_coef}")
    if clip_reward is not None and not clip_reward > 0:
        raise ValueError(f"clip_reward must be > 0 or None, got {clip_reward}")

    valid = mask != 0
    zeros = torch.zeros_like(logprobs)
    kl = torch.where(valid, kl_penalty(logprobs, ref_logprobs, kl_kind), zeros)
    rewards = -kl_coef * kl

    scores = scores.to(dtype=logprobs.dtype, device=logprobs.device)
    if clip_reward is not None:
        scores = scores.clamp(min=-clip_reward, max=clip_reward)
    if turn_rewards is not None:  # the rest of the score on the last token; the turns' own on theirs
        check_same_shape("turn_rewards", turn_rewards, mask=mask)
        placed = torch.where(valid, turn_rewards.to(rewards.dtype), zeros)
        rewards = rewards + placed
        scores = scores - placed.sum(dim=1)
    last = last_valid_index(mask)  # -1 for empty rows -> never matches a position
    positions = torch.arange(logprobs.shape[1], device=logprobs.device).expand(logprobs.shape)
    at_last = positions == last.unsqueeze(1)
    rewards = rewards + torch.where(at_last, scores.unsqueeze(1).expand_as(rewards), zeros)
    return rewards, kl


def normalize_scores(scores: torch.Tensor, mean: float, std: float, eps: float = 1e-8) -> torch.Tensor:
    """``(scores - mean) / (std + eps)``, for ``--reward-normalize``. ``scores``: ``[B]``."""
    if std < 0:
        raise ValueError(f"std must be >= 0, got {std}")
    return (scores - mean) / (std + eps)


def fold_moments(mean: float, m2: float, count: int, scores: torch.Tensor) -> Tuple[float, float, int, float, float]:
    """Running moments ``(mean, m2, count)`` (``m2``: the sum of squared deviations from the
    mean) with a batch ``[N]`` of scores folded in (Chan et al.'s parallel variance update, in
    float64): ``(mean, m2, count, batch_mean, batch_std)``, the batch's std unbiased."""
    xs = scores.detach().reshape(-1).to(torch.float64)
    n = xs.numel()
    if n == 0:
        return mean, m2, count, 0.0, 0.0
    if not bool(torch.isfinite(xs).all()):
        raise ValueError("scores contain NaN/inf")
    b_mean = float(xs.mean())
    b_m2 = float(((xs - b_mean) ** 2).sum())
    total = count + n
    delta = b_mean - mean
    mean += delta * n / total
    m2 += b_m2 + delta * delta * count * n / total
    return mean, m2, total, b_mean, math.sqrt(b_m2 / (n - 1)) if n > 1 else 0.0


def running_std(m2: float, count: int) -> float:
    """The unbiased std of the running moments (1.0 while fewer than 2 scores were seen)."""
    return math.sqrt(m2 / (count - 1)) if count > 1 else 1.0
