"""Masked reductions over ``(batch, response_len)`` tensors.

Conventions shared by all of ``puzzle.algorithms``:

* ``values`` and ``mask`` have the same shape, usually ``[B, R]``.
* ``mask`` is a 0/1 tensor of any dtype (bool, int or float); an entry is *valid*
  iff it is non-zero.  The mask is binary: float masks are not used as weights.
* Entries at invalid positions never influence a result, even if they hold
  NaN/inf (they are selected away with ``torch.where``, not multiplied by 0).
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = [
    "check_same_shape",
    "masked_sum",
    "masked_mean",
    "masked_var",
    "masked_whiten",
]


def check_same_shape(ref_name: str, ref: torch.Tensor, **others: Optional[torch.Tensor]) -> None:
    """Raise ``ValueError`` naming the first argument in ``others`` whose shape differs from ``ref``.

    ``None`` entries in ``others`` are skipped.
    """
    if not isinstance(ref, torch.Tensor):
        raise ValueError(f"{ref_name} must be a torch.Tensor, got {type(ref).__name__}")
    for name, t in others.items():
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.shape != ref.shape:
            raise ValueError(
                f"{name} has shape {tuple(t.shape)} but {ref_name} has shape {tuple(ref.shape)}"
            )


def _valid(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    check_same_shape("values", values, mask=mask)
    return mask != 0


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """Sum of ``values`` over valid entries.

    Args:
        values: ``[B, R]`` (any shape).
        mask: same shape as ``values``.
        dim: reduce over this dim only; ``None`` reduces everything to a scalar.

    Returns:
        Scalar (``dim=None``) or ``values`` with ``dim`` removed.
    """
    valid = _valid(values, mask)
    picked = torch.where(valid, values, torch.zeros_like(values))
    return picked.sum() if dim is None else picked.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """Mean of ``values`` over valid entries (0 where there are no valid entries).

    Args:
        values: ``[B, R]`` (any shape).
        mask: same shape as ``values``.
        dim: reduce over this dim only (e.g. ``dim=-1`` gives a per-row mean ``[B]``);
            ``None`` reduces everything to a scalar.
    """
    valid = _valid(values, mask)
    total = masked_sum(values, mask, dim)
    count = valid.sum() if dim is None else valid.sum(dim=dim)
    # count is an integer >= 1 wherever total can be non-zero, so clamping is exact.
    return total / count.clamp(min=1).to(total.dtype)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of all valid entries of ``values`` (scalar).

    With ``unbiased=True`` Bessel's correction ``n / (n - 1)`` is applied; when
    ``n <= 1`` the correction is skipped (the result is then 0 rather than NaN).
    Returns 0 when there are no valid entries.
    """
    valid = _valid(values, mask)
    mean = masked_mean(values, mask)
    centered = torch.where(valid, values - mean, torch.zeros_like(values))
    var = masked_mean(centered * centered, mask)
    if unbiased:
        n = int(valid.sum().item())
        if n > 1:
            var = var * (n / (n - 1))
    return var


def masked_whiten(
    values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """Normalise ``values`` with the (unbiased) mean/variance of its valid entries.

    ``out = (values - mean) / sqrt(var + eps)``; with ``shift_mean=False`` the mean is
    added back (``out + mean``), i.e. only the scale is changed.

    Args:
        values: ``[B, R]``.
        mask: same shape as ``values``.

    Returns:
        Same shape as ``values``; invalid entries are exactly 0.
    """
    valid = _valid(values, mask)
    values = torch.where(valid, values, torch.zeros_like(values))  # keep NaN padding out of grads
    mean = masked_mean(values, mask)
    var = masked_var(values, mask, unbiased=True)
    whitened = (values - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(valid, whitened, torch.zeros_like(whitened))
