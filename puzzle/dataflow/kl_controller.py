"""KL-coefficient controllers (Ziegler et al. 2019, "Fine-Tuning LMs from Human Preferences"): the
advantage stage's state, checkpointed with the trainer; the update rule is the pure
``puzzle.algorithms.kl.adaptive_kl_coef``."""

from __future__ import annotations

import math
from typing import Optional, Union

import torch

from puzzle.algorithms.kl import adaptive_kl_coef

__all__ = ["FixedKLController", "AdaptiveKLController", "build_kl_controller", "DEFAULT_KL_HORIZON"]

DEFAULT_KL_HORIZON = 10000


def _as_float(name: str, x: Union[float, torch.Tensor]) -> float:
    value = float(x.item()) if isinstance(x, torch.Tensor) else float(x)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def _check_coef(kl_coef: float) -> float:
    kl_coef = _as_float("kl_coef", kl_coef)
    if kl_coef < 0:
        raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
    return kl_coef


class FixedKLController:
    """Constant KL coefficient; ``update`` is a no-op."""

    def __init__(self, kl_coef: float):
        self.value = _check_coef(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        pass

    def state_dict(self) -> dict:
        return {"type": "fixed", "value": self.value}

    def load_state_dict(self, state: dict) -> None:
        if state.get("type", "fixed") != "fixed":
            raise ValueError(f"cannot load a {state.get('type')!r} KL controller state into FixedKLController")
        self.value = _check_coef(state["value"])


class AdaptiveKLController:
    """Adaptive KL coefficient steering the observed KL towards ``target``: ``update(current_kl,
    n_steps)`` sets ``value`` to :func:`adaptive_kl_coef`'s (``n_steps``: the samples, i.e.
    sequences, the KL was measured on)."""

    def __init__(self, init_kl_coef: float, target: float, horizon: float):
        self.value = _check_coef(init_kl_coef)
        self.target = _as_float("kl_target", target)
        self.horizon = _as_float("kl_horizon", horizon)
        if self.target <= 0:
            raise ValueError(f"kl_target must be > 0, got {self.target}")
        if self.horizon <= 0:
            raise ValueError(f"kl_horizon must be > 0, got {self.horizon}")

    def update(self, current_kl: Union[float, torch.Tensor], n_steps: int) -> None:
        current_kl = _as_float("current_kl", current_kl)
        if n_steps < 0:
            raise ValueError(f"n_steps must be >= 0, got {n_steps}")
        self.value = adaptive_kl_coef(self.value, current_kl, self.target, self.horizon, n_steps)

    def state_dict(self) -> dict:
        return {"type": "adaptive", "value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict) -> None:
        if state.get("type") != "adaptive":
            raise ValueError(f"cannot load a {state.get('type')!r} KL controller state into AdaptiveKLController")
        # Keep the configured target/horizon (they may be changed on resume); restore the coefficient.
        self.value = _check_coef(state["value"])


def build_kl_controller(
    kl_coef: float, kl_target: Optional[float] = None, kl_horizon: Optional[float] = None
) -> Union[FixedKLController, AdaptiveKLController]:
    """Adaptive controller if ``kl_target`` is given, else a fixed one.

    ``kl_horizon`` defaults to ``DEFAULT_KL_HORIZON`` (10000) for the adaptive controller
    and is ignored by the fixed one. Raises ``ValueError`` on a negative/non-finite
    ``kl_coef``, ``kl_target <= 0`` or ``kl_horizon <= 0``.
    """
    if kl_target is None:
        if kl_horizon is not None and _as_float("kl_horizon", kl_horizon) <= 0:
            raise ValueError(f"kl_horizon must be > 0, got {kl_horizon}")
        return FixedKLController(kl_coef)
    return AdaptiveKLController(kl_coef, kl_target, DEFAULT_KL_HORIZON if kl_horizon is None else kl_horizon)
