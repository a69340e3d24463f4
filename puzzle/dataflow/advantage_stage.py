"""Between scoring and training: per-token rewards (the shaped sequence scores, KL-penalised) and
the advantages and returns of ``--advantage-estimator``. Pure math on the batch every rank holds
(no communication); the KL controller's state lives here and is checkpointed with the trainer.
"""

from __future__ import annotations

from typing import Dict, Tuple

import torch

from puzzle.algorithms.advantage_estimators import compute_advantages
from puzzle.algorithms.masked import masked_mean
from puzzle.algorithms.token_rewards import compute_token_rewards
from puzzle.dataflow.kl_controller import build_kl_controller


class AdvantageStage:
    """``run(batch)`` returns the batch's ``advantages`` and ``returns`` ([B, R]) and the metrics;
    the scores come from ``rewards.shaped(batch)`` (puzzle/dataflow/reward_stage.py)."""

    def __init__(self, ppo, rewards, with_reference: bool):
        self.ppo, self.rewards, self.with_reference = ppo, rewards, with_reference
        self.kl_ctl = build_kl_controller(ppo.kl_coef, ppo.kl_target, ppo.kl_horizon)

    def run(self, batch) -> Tuple[Dict[str, torch.Tensor], dict]:
        ppo, f, mask = self.ppo, batch.fields, batch.response_mask
        kl_coef = self.kl_ctl.value
        scores, baseline = self.rewards.shaped(batch)
        ref = f.get("ref_logprobs", f["old_logprobs"])  # no reference: no KL
        rewards, kl = compute_token_rewards(scores, f["old_logprobs"], ref, mask,
                                            kl_coef=kl_coef if self.with_reference else 0.0,
                                            kl_kind=ppo.kl_estimator, clip_reward=ppo.reward_clip,
                                            turn_rewards=f.get("turn_rewards"))
        adv, ret = compute_advantages(ppo.advantage_estimator, rewards, mask, values=f.get("values"),
                                      group_index=f.get("group_index"), baseline_scores=baseline,
                                      gamma=ppo.gamma, lam=ppo.lam, whiten_advantages=ppo.whiten_advantages,
                                      std_normalization=ppo.grpo_std_normalization)
        seq_kl = (kl * mask).sum(dim=1).mean()
        self.kl_ctl.update(float(seq_kl), batch.size)
        stats = {**self.rewards.metrics(batch), "kl": float(masked_mean(kl, mask)), "kl_seq": float(seq_kl),
                 "kl_coef": kl_coef, "entropy": float(masked_mean(f["entropy"], mask))}
        if "values" in f:
            stats["value_mean"] = float(masked_mean(f["values"], mask))
        stats["return_mean"] = float(masked_mean(ret, mask))
        return {"advantages": adv, "returns": ret}, stats
