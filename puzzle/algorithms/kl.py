"""Per-token KL estimators between the actor and the reference policy.

All estimators take log-probabilities of the *sampled* tokens, shape ``[B, R]``,
and return a ``[B, R]`` tensor (no masking here; mask downstream).
See http://joschu.net/blog/kl-approx.html for k1/k2/k3.
"""

from __future__ import annotations

import torch

from puzzle.algorithms.masked import check_same_shape

__all__ = ["KL_KINDS", "adaptive_kl_coef", "kl_penalty"]

# Canonical names; aliases map onto them.
KL_KINDS = ("k1", "abs", "mse", "low_var_kl")
_ALIASES = {"kl": "k1", "k2": "mse", "k3": "low_var_kl"}

# Bounds used by 'low_var_kl': the log-ratio is clamped before exp() to keep it
# finite, and the estimate itself is clamped to [-10, 10].
_LOG_RATIO_CLAMP = 20.0
_LOW_VAR_KL_CLAMP = 10.0


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k1") -> torch.Tensor:
    """Per-token KL(actor || ref) estimate.

    Args:
        logprobs: ``[B, R]`` actor log-probs of the sampled tokens.
        ref_logprobs: ``[B, R]`` reference-model log-probs of the same tokens.
        kind: one of
            * ``'k1'`` (alias ``'kl'``): ``logp - ref``
            * ``'abs'``: ``|logp - ref|``
            * ``'mse'`` (alias ``'k2'``): ``0.5 * (logp - ref)^2``
            * ``'low_var_kl'`` (alias ``'k3'``): ``exp(ref - logp) - (ref - logp) - 1``,
              clamped to ``[-10, 10]`` (log-ratio clamped to ``[-20, 20]`` first).

    Returns:
        ``[B, R]`` tensor, same dtype as ``logprobs``.
    """
    check_same_shape("logprobs", logprobs, ref_logprobs=ref_logprobs)
    canonical = _ALIASES.get(kind, kind)
    diff = logprobs - ref_logprobs
    if canonical == "k1":
        return diff
    if canonical == "abs":
        return diff.abs()
    if canonical == "mse":
        return 0.5 * diff.square()
    if canonical == "low_var_kl":
        log_ratio = (-diff).clamp(min=-_LOG_RATIO_CLAMP, max=_LOG_RATIO_CLAMP)
        k3 = torch.exp(log_ratio) - log_ratio - 1.0
        return k3.clamp(min=-_LOW_VAR_KL_CLAMP, max=_LOW_VAR_KL_CLAMP)
    valid = ", ".join(repr(k) for k in KL_KINDS + tuple(_ALIASES))
    raise ValueError(f"unknown kl kind {kind!r}; expected one of {valid}")


def adaptive_kl_coef(kl_coef: float, current_kl: float, target: float, horizon: float, n_steps: int) -> float:
    """The adaptive KL controller's next coefficient (Ziegler et al. 2019), steering the observed
    KL towards ``target``::

        e = clip(current_kl / target - 1, -0.2, 0.2)
        kl_coef * (1 + e * n_steps / horizon)

    ``n_steps``: the samples (sequences) ``current_kl`` was measured on.
    """
    proportional_error = min(max(current_kl / target - 1.0, -0.2), 0.2)
    return kl_coef * (1.0 + proportional_error * n_steps / horizon)
