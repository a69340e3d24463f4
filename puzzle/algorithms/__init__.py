"""Pure tensor math for PPO/RLHF (no torch.distributed, no megatron, no state: the stateful KL
controller and running score moments use it from puzzle/dataflow/)."""

from puzzle.algorithms.advantages import compute_gae
from puzzle.algorithms.kl import KL_KINDS, adaptive_kl_coef, kl_penalty
from puzzle.algorithms.losses import LOSS_AGG_MODES, agg_loss, entropy_bonus, policy_loss, value_loss
from puzzle.algorithms.masked import masked_mean, masked_sum, masked_var, masked_whiten
from puzzle.algorithms.token_rewards import (compute_token_rewards, fold_moments, last_valid_index, normalize_scores,
                                             running_std)

__all__ = [
    "KL_KINDS",
    "LOSS_AGG_MODES",
    "adaptive_kl_coef",
    "agg_loss",
    "compute_gae",
    "compute_token_rewards",
    "entropy_bonus",
    "fold_moments",
    "kl_penalty",
    "last_valid_index",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "normalize_scores",
    "policy_loss",
    "running_std",
    "value_loss",
]
