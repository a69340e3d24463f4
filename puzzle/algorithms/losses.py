"""PPO actor / critic losses over masked ``[B, R]`` token tensors.

Aggregating across micro-batches
--------------------------------
Every loss returns its aggregation *weight* (denominator) next to the loss.  With
``loss_agg='token-mean'`` the weight is the number of valid tokens in the micro-batch;
with ``'seq-mean-*'`` it is the number of non-empty rows.  Two exact ways to get the
mini-batch loss ``sum_i numerator_i / sum_i weight_i``:

1. Per-token-loss style (megatron ``calculate_per_token_loss=True``): return
   ``loss * weight`` (the numerator) and ``weight`` from the micro-batch loss function
   and divide by the summed weight at the end.
2. Precomputed denominator: pass ``denominator=`` the total weight of the whole
   mini-batch (summed over micro-batches and data-parallel ranks, e.g. the global
   ``mask.sum()``); each returned loss is then ``numerator_i / denominator`` and the
   plain *sum* of the micro-batch losses is the exact mini-batch loss (under DP gradient
   averaging, additionally multiply by the DP size).

Without either, each micro-batch loss is its own local mean; averaging those is exact
only when all micro-batches have the same weight.
Statistics (``clip_frac``, ``approx_kl``) are detached token-means over the micro-batch;
weight them by the valid-token count (``mask.sum()``) when combining.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from puzzle.algorithms.masked import check_same_shape, masked_mean, masked_sum

__all__ = ["LOSS_AGG_MODES", "agg_loss", "policy_loss", "value_loss", "entropy_bonus"]

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")

_LOG_RATIO_CLAMP = 20.0


def agg_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    loss_agg: str = "token-mean",
    denominator: Optional[float] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Reduce a per-token loss ``[B, R]`` to a scalar.

    Modes:
        * ``'token-mean'``: sum over valid tokens / number of valid tokens.
        * ``'seq-mean-token-mean'``: mean over non-empty rows of each row's token mean.
        * ``'seq-mean-token-sum'``: mean over non-empty rows of each row's token sum.

    Args:
        denominator: if given (``> 0``), divide the numerator by it instead of by this
            micro-batch's own weight (see module docstring).

    Returns:
        ``(loss scalar, weight scalar)`` with ``loss == numerator / (denominator or weight)``
        (0 when the weight is 0; the graph is kept, giving zero gradients).
    """
    check_same_shape("loss_mat", loss_mat, mask=mask)
    valid = mask != 0
    if loss_agg == "token-mean":
        numerator = masked_sum(loss_mat, mask)
        weight = valid.sum()
    elif loss_agg in ("seq-mean-token-mean", "seq-mean-token-sum"):
        if loss_mat.dim() != 2:
            raise ValueError(f"loss_mat must be 2-D [B, R] for {loss_agg!r}, got {tuple(loss_mat.shape)}")
        per_row = masked_mean(loss_mat, mask, dim=-1) if loss_agg == "seq-mean-token-mean" else masked_sum(
            loss_mat, mask, dim=-1
        )
        numerator = per_row.sum()  # empty rows contribute exactly 0
        weight = valid.any(dim=-1).sum()
    else:
        raise ValueError(f"unknown loss_agg {loss_agg!r}; expected one of {LOSS_AGG_MODES}")
    weight = weight.to(numerator.dtype)
    if denominator is not None:
        if not denominator > 0:
            raise ValueError(f"denominator must be > 0, got {denominator}")
        return numerator / denominator, weight
    return numerator / weight.clamp(min=1), weight


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float = 0.2,
    loss_agg: str = "token-mean",
    denominator: Optional[float] = None,
    clip_eps_high: Optional[float] = None,
    token_weights: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate loss (with DAPO's clip-higher: ``clip(ratio, 1 - eps, 1 + eps_high)``).

    ``ratio = exp(logprobs - old_logprobs)`` (log-ratio clamped to ``[-20, 20]``);
    per token ``max(-A * ratio, -A * clip(ratio, 1 - eps, 1 + eps))``, aggregated with
    :func:`agg_loss`. Gradients flow only through ``logprobs`` (``old_logprobs`` and
    ``advantages`` are detached).

    Args:
        logprobs: ``[B, R]`` current actor log-probs of the sampled tokens (requires grad).
        old_logprobs: ``[B, R]`` rollout-time actor log-probs.
        advantages: ``[B, R]``.
        mask: ``[B, R]`` 0/1 response mask.
        clip_eps: PPO clip range (``> 0``); the lower one when ``clip_eps_high`` is given.
        clip_eps_high: upper clip range (DAPO clip-higher); ``None`` = ``clip_eps``.
        token_weights: ``[B, R]`` detached per-token weights of the clipped loss (the truncated
            importance weights of puzzle/algorithms/rollout_correction.py); ``None`` = 1.

    Returns:
        ``(loss, clip_frac, approx_kl, weight)``: ``loss`` scalar; ``clip_frac`` = fraction of
        valid tokens where the clipped term is active (strictly larger); ``approx_kl`` =
        token-mean of ``ratio - 1 - log(ratio)`` (k3 estimate of KL(old || new), >= 0);
        ``weight`` = aggregation weight (see module docstring).
    """
    check_same_shape("logprobs", logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask)
    if not clip_eps > 0:
        raise ValueError(f"clip_eps must be > 0, got {clip_eps}")
    high = clip_eps if clip_eps_high is None else clip_eps_high
    if not high > 0:
        raise ValueError(f"clip_eps_high must be > 0, got {clip_eps_high}")
    # Select invalid positions away first so NaN/inf padding can reach neither loss nor grads.
    valid = mask != 0
    logprobs = torch.where(valid, logprobs, torch.zeros_like(logprobs))
    old_logprobs = torch.where(valid, old_logprobs.detach(), torch.zeros_like(logprobs))
    advantages = torch.where(valid, advantages.detach(), torch.zeros_like(logprobs))

    log_ratio = (logprobs - old_logprobs).clamp(min=-_LOG_RATIO_CLAMP, max=_LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(min=1.0 - clip_eps, max=1.0 + high)
    loss_mat = torch.maximum(unclipped, clipped)
    if token_weights is not None:
        check_same_shape("logprobs", logprobs, token_weights=token_weights)
        loss_mat = loss_mat * torch.where(valid, token_weights.detach(), torch.zeros_like(loss_mat))
    loss, weight = agg_loss(loss_mat, mask, loss_agg, denominator)

    with torch.no_grad():
        clip_frac = masked_mean((clipped > unclipped).to(logprobs.dtype), mask)
        approx_kl = masked_mean(ratio - 1.0 - log_ratio, mask)
    return loss, clip_frac, approx_kl, weight


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    value_clip_eps: Optional[float] = 0.2,
    loss_agg: str = "token-mean",
    denominator: Optional[float] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Clipped critic loss ``0.5 * max((v - R)^2, (v_clip - R)^2)``.

    ``v_clip = old_v + clip(v - old_v, -eps, eps)``. With ``value_clip_eps=None`` the
    loss is the plain ``0.5 * (v - R)^2``. Gradients flow only through ``values``.

    Args:
        values: ``[B, R]`` current critic values (requires grad).
        old_values: ``[B, R]`` rollout-time critic values.
        returns: ``[B, R]`` value targets (from :func:`compute_gae`).
        mask: ``[B, R]`` 0/1 response mask.

    Returns:
        ``(loss, value_clip_frac, weight)``; ``value_clip_frac`` = fraction of valid tokens
        where the clipped error is strictly larger (0 when clipping is disabled).
    """
    check_same_shape("values", values, old_values=old_values, returns=returns, mask=mask)
    if value_clip_eps is not None and not value_clip_eps > 0:
        raise ValueError(f"value_clip_eps must be > 0 or None, got {value_clip_eps}")
    valid = mask != 0
    values = torch.where(valid, values, torch.zeros_like(values))
    old_values = torch.where(valid, old_values.detach(), torch.zeros_like(values))
    returns = torch.where(valid, returns.detach(), torch.zeros_like(values))

    err_unclipped = (values - returns).square()
    if value_clip_eps is None:
        err = err_unclipped
        clip_frac = values.new_zeros(())
    else:
        v_clipped = old_values + (values - old_values).clamp(min=-value_clip_eps, max=value_clip_eps)
        err_clipped = (v_clipped - returns).square()
        err = torch.maximum(err_unclipped, err_clipped)
        with torch.no_grad():
            clip_frac = masked_mean((err_clipped > err_unclipped).to(values.dtype), mask)
    loss, weight = agg_loss(0.5 * err, mask, loss_agg, denominator)
    return loss, clip_frac, weight


def entropy_bonus(
    entropy: torch.Tensor,
    mask: torch.Tensor,
    loss_agg: str = "token-mean",
    denominator: Optional[float] = None,
) -> torch.Tensor:
    """Aggregated entropy ``[B, R] -> scalar`` (masked token mean by default).

    Uses the same ``loss_agg``/``denominator`` semantics as :func:`policy_loss`, so
    ``policy_loss - ent_coef * entropy_bonus(...)`` aggregates across micro-batches
    with the same weight. Subtract it (times a coefficient) to *encourage* entropy.
    """
    return agg_loss(entropy, mask, loss_agg, denominator)[0]
