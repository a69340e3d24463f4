"""The generation-vs-scoring log-prob mismatch and its importance-sampling correction.

Generation records each sampled token's log-prob under the distribution scoring computes
(softmax of the logits at the sampling temperature, without the top-k/top-p filter; see
puzzle/rollout/sampling.py ``sampled_logprobs``); scoring computes the actor's old log-prob of the
same token. Both come from the same engine, weights and arithmetic, so they differ only where the
kernels differ: a KV-cached decode step against a full forward (GEMM shapes, bf16 rounding),
another (P, T) layout, a compiled whole-step graph, the MoE router's choices.

Truncated importance sampling (Megatron-LM RL's ``--rl-inference-logprobs-is-correction`` with
``--rl-importance-sampling-truncation-coef``; verl's TIS ``tis_imp_ratio_cap``; slime's
``--use-tis --tis-clip``): the PPO loss of each token is weighted by
``w = min(pi_old / pi_gen, C) = min(exp(old - gen), C)``, the tokens having been drawn from the
generation's distribution, not from the one the loss's ratio is taken against. All tensors are
``[B, R]`` in response coordinates with a 0/1 mask.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from puzzle.algorithms.masked import check_same_shape

#: log-ratios are clamped to +-this before exp (as the PPO ratio is: puzzle/algorithms/losses.py)
_LOG_RATIO_CLAMP = 20.0


def logprob_diff_stats(gen_logprobs: torch.Tensor, score_logprobs: torch.Tensor,
                       mask: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(max, mean) over the valid tokens of ``|gen - score|`` (float64 scalars; 0 with no token)."""
    check_same_shape("gen_logprobs", gen_logprobs, score_logprobs=score_logprobs, mask=mask)
    valid = mask != 0
    diff = (gen_logprobs.double() - score_logprobs.double()).abs()
    diff = torch.where(valid, diff, torch.zeros_like(diff))
    n = valid.sum()
    return diff.max() if diff.numel() else diff.sum(), diff.sum() / n.clamp(min=1)


def truncated_is_weights(old_logprobs: torch.Tensor, gen_logprobs: torch.Tensor, mask: torch.Tensor,
                         truncation_coef: Optional[float] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-token importance weights ``min(exp(old - gen), C)`` (detached; 1 on invalid tokens)
    and the 0/1 tensor of the valid tokens the truncation at ``C`` changed. ``truncation_coef``
    None: the untruncated ratio (Megatron-LM RL without --rl-importance-sampling-truncation-coef)."""
    check_same_shape("old_logprobs", old_logprobs, gen_logprobs=gen_logprobs, mask=mask)
    if truncation_coef is not None and not truncation_coef > 0:
        raise ValueError(f"truncation_coef must be > 0 or None, got {truncation_coef}")
    valid = mask != 0
    log_w = (old_logprobs.detach() - gen_logprobs.detach()).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    w = torch.where(valid, torch.exp(log_w), torch.ones_like(log_w))
    truncated = torch.zeros_like(w)
    if truncation_coef is not None:
        truncated = (valid & (w > truncation_coef)).to(w.dtype)
        w = w.clamp(max=truncation_coef)
    return w, truncated


def mismatch_metrics(gen_logprobs: torch.Tensor, score_logprobs: torch.Tensor, mask: torch.Tensor,
                     is_correction: bool = False, truncation_coef: Optional[float] = None) -> dict:
    """The run's metrics: ``gen_score_logprob_diff_max`` / ``_mean`` (|generation - scoring| log-prob of
    the sampled tokens over the response tokens) and, with the correction on, the importance
    weights' mean and the fraction of tokens truncated (``is_weight_mean``, ``is_truncated_frac``)."""
    dmax, dmean = logprob_diff_stats(gen_logprobs, score_logprobs, mask)
    out = {"gen_score_logprob_diff_max": float(dmax), "gen_score_logprob_diff_mean": float(dmean)}
    if is_correction:
        w, truncated = truncated_is_weights(score_logprobs, gen_logprobs, mask, truncation_coef)
        valid = (mask != 0).to(w.dtype)
        n = valid.sum().clamp(min=1)
        out.update(is_weight_mean=float((w * valid).sum() / n), is_truncated_frac=float(truncated.sum() / n))
    return out
