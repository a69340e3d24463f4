"""PPOTrainer: one process group, up to four role models, one iteration through five parts.

    generate   GenerationStage  (puzzle/generation_stage.py): the actor in its generation layout,
                                N samples per prompt, DAPO filter, ReMax greedy baseline
    reward     Rewards          (puzzle/reward_functions/rewards.py): the one owner of the scores
    score      ScoringStage     (puzzle/training/scoring_stage.py): actor old log-probs, ref,
                                critic values, reward model
    advantages AdvantageStage   (puzzle/algorithms/advantage_stage.py): KL-penalised rewards,
                                --advantage-estimator
    train      TrainingStage    (puzzle/training/training_stage.py): actor and critic PPO updates,
                                the NaN/inf policy, the switch to the generation layout

The roles that exist (cfg.roles) follow the estimator and the KL settings: no critic unless
gae, no reference when KL enters neither the reward nor the loss (puzzle.arguments.role_set).
"""

from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional

import torch.distributed as dist

from puzzle.algorithms.advantage_stage import AdvantageStage
from puzzle.config import RunConfig
from puzzle.generation_stage import GenerationStage
from puzzle.metrics import MetricsLogger, StageClock
from puzzle.parallel.device import runtime
from puzzle.reward_functions.rewards import Rewards
from puzzle.training.batch import RolloutBatch
from puzzle.training.engine import ModelEngine, build_role_engines
from puzzle.training.offload import StageOffload
from puzzle.training.scoring_stage import MicroBatching, ScoringStage
from puzzle.training.training_stage import TrainingStage


class PPOTrainer:
    """The run's stages, each an object that owns its part (and its data movement); ``step`` runs
    one iteration through them. ``state_dict`` gathers their checkpointed state."""

    def __init__(self, cfg: RunConfig, tokenizer, prompts):
        self.cfg, self.tokenizer, self.prompts = cfg, tokenizer, prompts
        self.rank = dist.get_rank()
        self.runtime = runtime()
        # the ids a response may contain: the same mask in generation, scoring, training and KL
        self.vocab = cfg.roles["actor"].arch.valid_vocab_size
        if min(tokenizer.vocab_size, cfg.roles["actor"].arch.vocab_size) != self.vocab:  # (ids beyond the rows)
            raise ValueError(f"the tokenizer has {tokenizer.vocab_size} ids but the run was configured for "
                             f"{self.vocab} (validate_args with this tokenizer's vocab_size)")
        self.engines: Dict[str, ModelEngine] = build_role_engines(cfg)
        # --rl-offload-optimizer-during-inference: idle state on the host between stages
        self.offload = StageOffload(self.engines, cfg.levers.rl_offload_optimizer_during_inference)
        gen_plan = cfg.roles["actor"].gen_plan
        self.switch = None
        if gen_plan != cfg.roles["actor"].plan:
            from puzzle.training.actor_switch import ActorSwitch

            self.switch = ActorSwitch(self.engines["actor"], gen_plan, cfg.switch_segments,
                                      ranks_per_node=cfg.ranks_per_node)
        # sequence parallelism splits the sequence over each model's T
        self.seq_multiple = (math.lcm(*(s.plan.T for s in cfg.roles.values()))
                             if cfg.sequence_parallel else 1)
        self.rewards = Rewards(cfg, tokenizer)
        self.generation = GenerationStage(cfg, tokenizer, self.engines["actor"], self.switch, self.rewards,
                                          self.runtime.device, self.seq_multiple)
        self.micro = MicroBatching(self.engines, cfg.ppo.micro_batch_size, cfg.ppo.use_remove_padding,
                                   self.seq_multiple, tokenizer.pad_id, dynamic_bsz=cfg.ppo.use_dynamic_bsz)
        self.scoring = ScoringStage(cfg, self.engines, self.micro, self.rewards, self.vocab)
        self.advantages = AdvantageStage(cfg.ppo, self.rewards, with_reference="ref" in self.engines)
        self.training = TrainingStage(cfg, self.engines, self.micro, self.switch, self.vocab, self.rank)
        self.iteration = 0
        self.progress = lambda iteration, phase: None  # run_control.Progress: where this rank is
        self.logger = MetricsLogger(cfg.log_dir, cfg.log_interval, cfg.train_iters, self.rank, ops=cfg.ops)
        self.on_iteration_end = lambda batch, metrics: None  # the run loop's additions to the metrics

    # ---- the iteration ---------------------------------------------------------------------
    def step(self, prompt_ids: List[List[int]], records: Optional[List[dict]] = None,
             refill: Optional[Callable] = None) -> dict:
        """One iteration on a global batch of prompts; ``records`` are their dataset records (for
        the reward function), ``refill()`` the next (prompt_ids, records) for dynamic sampling."""
        self.iteration += 1
        it = self.iteration
        clock = StageClock(self.runtime, it, self.progress, self.offload)
        with clock.stage("generate", "generation"):
            rollout = self.generation.run(prompt_ids, records, refill, it)
            stats = {**rollout.stats, **self.rewards.score_rollout(rollout, it)}
        batch = rollout.batch
        with clock.stage("score", "scoring"):
            stats.update(self.scoring.run(batch, it))
        stats.update(self.advantages.run(batch))
        with clock.stage("train", "training"):
            stats.update(self.training.run(batch, it))
        data = getattr(getattr(self.prompts, "stats", None), "as_dict", dict)()
        metrics = {"iteration": it, **stats, **self._switch_metrics(),
                   **{f"prompts_{k}": v for k, v in data.items()}, **clock.metrics(batch.size)}
        self.on_iteration_end(batch, metrics)  # collective (puzzle.cli: learning rates, evaluation)
        self.logger.log(metrics)
        return metrics

    def _switch_metrics(self) -> dict:
        """The busiest rank's received bytes and the slowest rank's time of the last switch."""
        if self.switch is None or self.switch.last_stats is None:
            return {}
        st = self.switch.last_stats
        v = self.runtime.all_reduce([float(st.bytes_received), st.time_s], op="max")
        return {"switch_bytes_max_rank": int(v[0]), "switch_seconds": float(v[1])}

    # ---- the stages one at a time (tests, evaluation) ----------------------------------------
    def generate(self, prompt_ids: List[List[int]], records=None, refill=None):
        """Stage 1 and the reward function: (the scored batch, the metrics)."""
        rollout = self.generation.run(prompt_ids, records, refill, self.iteration)
        return rollout.batch, {**rollout.stats, **self.rewards.score_rollout(rollout, self.iteration)}

    def score(self, batch: RolloutBatch) -> dict:
        return self.scoring.run(batch, self.iteration)

    def compute_advantages(self, batch: RolloutBatch) -> dict:
        return self.advantages.run(batch)

    def _contexts(self, batch: RolloutBatch, jobs, token_budget: Optional[int] = None):
        return self.micro.contexts(batch, jobs, token_budget)

    @property
    def remove_padding(self) -> bool:
        """Packed scoring/training micro-batches (--use-remove-padding)."""
        return self.micro.packed

    @remove_padding.setter
    def remove_padding(self, packed: bool) -> None:
        self.micro.packed = packed

    @property
    def generation_progress(self):
        """progress(finished, rows) of each generation (a terminal display)."""
        return self.generation.progress

    @generation_progress.setter
    def generation_progress(self, report) -> None:
        self.generation.progress = report

    # ---- checkpointed state (torchtitan's Stateful) -------------------------------------------
    def state_dict(self) -> dict:
        """The trainer's own state, JSON-serialisable: counters, the KL controller, the reward
        normaliser and the trainable roles' LR schedulers (weights and optimizer states are the
        role models' sharded state dicts, saved by puzzle.checkpointing)."""
        return {"iteration": self.iteration, "kl_ctl": self.advantages.kl_ctl.state_dict(),
                "reward_norm": self.rewards.state_dict(),
                "schedulers": {r: e.scheduler.state_dict() for r, e in self.engines.items() if e.trainable},
                "nonfinite_skipped": int(self.training.nonfinite.skipped)}

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()``'s output (after the role models' weights are loaded). Raises
        ValueError when a scheduler's shape differs from this run's."""
        self.iteration = int(state["iteration"])
        self.training.nonfinite.skipped = int(state.get("nonfinite_skipped", 0))
        self.advantages.kl_ctl.load_state_dict(state["kl_ctl"])
        self.rewards.load_state_dict(state.get("reward_norm", self.rewards.state_dict()))
        for role, sched_state in state["schedulers"].items():
            eng = self.engines[role]
            if eng.scheduler is not None:
                try:
                    eng.scheduler.load_state_dict(sched_state)
                except AssertionError as e:  # megatron checks the schedule's shape against the state
                    raise ValueError(f"{role} LR schedule differs from the checkpoint's ({e}); the decay "
                                     "length follows --train-iters, --global-batch-size and --ppo-epochs") from e
        if self.switch is not None:
            self.switch.release()  # the next generation switches from the loaded weights

    def close(self) -> None:
        self.rewards.close()
        self.logger.close()
