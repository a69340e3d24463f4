"""Pure tensor math for PPO/RLHF (no torch.distributed, no megatron)."""

from puzzle.algorithms.advantages import compute_gae
from puzzle.algorithms.kl import KL_KINDS, kl_penalty
from puzzle.algorithms.kl_controller import (
    DEFAULT_KL_HORIZON,
    AdaptiveKLController,
    FixedKLController,
    build_kl_controller,
)
from puzzle.algorithms.losses import LOSS_AGG_MODES, agg_loss, entropy_bonus, policy_loss, value_loss
from puzzle.algorithms.masked import masked_mean, masked_sum, masked_var, masked_whiten
from puzzle.algorithms.token_rewards import RunningMoments, compute_token_rewards, last_valid_index, normalize_scores

__all__ = [
    "AdaptiveKLController",
    "DEFAULT_KL_HORIZON",
    "FixedKLController",
    "KL_KINDS",
    "LOSS_AGG_MODES",
    "RunningMoments",
    "agg_loss",
    "build_kl_controller",
    "compute_gae",
    "compute_token_rewards",
    "entropy_bonus",
    "kl_penalty",
    "last_valid_index",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "normalize_scores",
    "policy_loss",
    "value_loss",
]
