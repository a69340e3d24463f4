"""Stage 2, scoring: forward passes of the roles that exist over the rollout batch.

The run's ``MicroBatching`` (puzzle/dataflow/micro_batching.py) cuts each model's data-parallel
share of the batch into micro-batches (packed without padding by default, each group of rows
packed once for every role) and gathers the outputs back to every rank, so the stage's outputs
are complete and identical on every rank. The stage returns them; the trainer puts them in the
batch (``RolloutBatch.with_outputs``).
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch

from puzzle.algorithms.rollout_correction import mismatch_metrics
from puzzle.config import ROLES
from puzzle.pipeline.stage import run_stage
from puzzle.engine import nonfinite
from puzzle.dataflow import steps
from puzzle.dataflow.batch import RolloutBatch
from puzzle.dataflow.micro_batching import MicroBatching

#: each scoring role's outputs: (key in its micro-batch outputs, field of the batch)
SCORED_FIELDS = {"actor": (("logprobs", "old_logprobs"), ("entropy", "entropy")),
                 "ref": (("logprobs", "ref_logprobs"),), "critic": (("values", "values"),),
                 "reward": (("scores", "scores"),)}


class ScoringStage:
    """Actor old log-probs and entropy, reference log-probs, critic values and the reward model's
    raw scores (handed to the run's ``Rewards`` to be checked): ``run`` returns them."""

    def __init__(self, cfg, engines: Dict, micro: MicroBatching, rewards, vocab: int):
        self.cfg, self.engines, self.micro, self.rewards, self.vocab = cfg, engines, micro, rewards, vocab

    def jobs(self, R: int) -> List[Tuple[str, object]]:
        ppo = self.cfg.ppo
        temp = 1.0 if ppo.greedy else ppo.temperature
        base = self.cfg.reference_is_actor_base  # a LoRA actor's reference: the actor, adapters off
        jobs = {"actor": steps.logprob_score_step(self.vocab, temp, R, with_entropy=True,
                                                  batch_invariant=ppo.batch_invariant_mode),
                "ref": steps.logprob_score_step(self.vocab, temp, R, adapters_off=base),
                "critic": steps.value_score_step(R), "reward": steps.reward_score_step()}
        # ROLES' order: the base's pass follows the actor's, in the actor's time slot
        return [(role, jobs[role]) for role in ROLES if role in self.engines or (role == "ref" and base)]

    def reward_model_scores(self, batch: RolloutBatch) -> torch.Tensor:
        """Collective: the reward model's raw scores of every row of ``batch`` (unchecked, kept
        nowhere; evaluation scores its rows through here)."""
        outs = run_stage(self.micro.contexts(batch, [("reward", steps.reward_score_step())]), forward_only=True,
                         placement="sequential")
        return self.micro.gather(outs[0], "scores", "reward", batch)

    def run(self, batch: RolloutBatch, iteration: int) -> Tuple[Dict[str, torch.Tensor], dict]:
        """Collective: (the scored fields, the stage's metrics) on every rank: the ``scoring``
        fields of the batch, and the reward model's scores under ``"scores"`` once ``Rewards``
        checked them (--on-bad-reward). Raises NonFiniteError on a NaN/inf output."""
        ppo, f = self.cfg.ppo, {}
        jobs = self.jobs(batch.max_new_tokens)
        contexts = self.micro.contexts(batch, jobs, ppo.log_prob_max_token_len_per_gpu,
                                       self.cfg.score_placement)
        outs = run_stage(contexts, forward_only=True, placement=self.cfg.score_placement)
        stats = {}
        for (role, _), out, ctx in zip(jobs, outs, contexts):
            for key, name in SCORED_FIELDS[role]:
                value = self.micro.gather(out, key, role, batch, ctx.rows)
                if role == "reward":  # a reward model's scores follow --on-bad-reward like a function's
                    value, stats["bad_rewards"] = self.rewards.check_model_scores(value, iteration)
                f[name] = value
        nonfinite.check_scores(f, batch.response_mask, iteration,
                               {name: role for role, _ in jobs for _, name in SCORED_FIELDS[role]})
        if batch.gen_logprobs is not None:  # generation vs scoring log-probs of the sampled tokens
            stats.update(mismatch_metrics(batch.gen_logprobs, f["old_logprobs"], batch.response_mask,
                                          ppo.rl_inference_logprobs_is_correction,
                                          ppo.rl_importance_sampling_truncation_coef))
        return f, stats
