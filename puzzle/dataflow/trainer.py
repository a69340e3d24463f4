"""PPOTrainer: one process group, up to four role models, one iteration through five parts.

    generate   GenerationStage  (puzzle/dataflow/generation_stage.py): the actor in its generation layout,
                                N samples per prompt, DAPO filter, ReMax greedy baseline
    reward     Rewards          (puzzle/dataflow/reward_stage.py): the one owner of the scores
    score      ScoringStage     (puzzle/dataflow/scoring_stage.py): actor old log-probs, ref,
                                critic values, reward model
    advantages AdvantageStage   (puzzle/dataflow/advantage_stage.py): KL-penalised rewards,
                                --advantage-estimator
    train      TrainingStage    (puzzle/dataflow/training_stage.py): actor and critic PPO updates,
                                the NaN/inf policy, the switch to the generation layout

The roles that exist (cfg.roles) follow the estimator and the KL settings: no critic unless
gae, no reference when KL enters neither the reward nor the loss (puzzle.arguments.role_set).
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import replace
from typing import Callable, Dict, List, Optional, Tuple

import torch.distributed as dist

from puzzle import checkpointing, run_control
from puzzle.dataflow.advantage_stage import AdvantageStage
from puzzle.config import RunConfig
from puzzle.data.prompts import PromptLoader
from puzzle.dataflow.generation_stage import GenerationStage, Rollout, length_metrics
from puzzle.dataflow.overlap_stage import GeneratedBatch, InFlight, Pools, PoolSwitch, pools_of
from puzzle.metrics import (GenerationProgress, MetricsLogger, SampleLog, StageClock, learning_rates,
                            rollout_sample_rows, tokens_per_second)
from puzzle.parallel.device import runtime
from puzzle.dataflow.reward_stage import Rewards
from puzzle.dataflow.batch import RolloutBatch
from puzzle.engine.model_engine import ModelEngine, build_role_engines
from puzzle.engine.offload import StageOffload
from puzzle.dataflow.micro_batching import MicroBatching
from puzzle.dataflow.scoring_stage import ScoringStage
from puzzle.dataflow.training_stage import TrainingStage


class PhaseLog:
    """Rank 0's timed lines, so that a long run is never silent: ``[phase] NAME ...`` as a phase
    starts and ``[phase] NAME: 1.23 s`` as it ends (rank 0's wall time). ``phase(NAME)`` is the
    context of one phase; ``phase(NAME, show=False)`` prints nothing (iterations that
    --log-interval does not log)."""

    def __init__(self, rank: int):
        self.enabled = rank == 0

    @contextlib.contextmanager
    def __call__(self, name: str, show: bool = True):
        show = show and self.enabled
        if show:
            print(f"[phase] {name} ...", flush=True)
        t0 = time.perf_counter()
        yield
        if show:
            self.ended(name, time.perf_counter() - t0)

    def ended(self, name: str, seconds: float) -> None:
        if self.enabled:
            print(f"[phase] {name}: {seconds:.2f} s", flush=True)


class TrainState:
    """The run's counters and the stages' small state that a checkpoint keeps (trainer_state.json,
    torchtitan's TrainState): the iteration, the KL controller, the reward normaliser, the trainable
    roles' LR schedulers, the count of skipped non-finite steps, the carried samples of partial
    rollouts and the overlap's batches in flight. A Stateful: the checkpointer is handed this
    object, never the trainer."""

    def __init__(self, engines: Dict[str, ModelEngine], advantages, rewards, training, switch, partial=None,
                 in_flight: Optional[InFlight] = None):
        self.iteration = 0
        self._engines, self._advantages, self._rewards = engines, advantages, rewards
        self._training, self._switch = training, switch
        self._partial = partial  # --rl-partial-rollouts: the carried samples (PartialRollouts)
        self._in_flight = in_flight  # --rl-desired-lag: the batches generated, not trained (InFlight)

    def state_dict(self) -> dict:
        """JSON-serialisable (weights and optimizer states are the role models' sharded state
        dicts, saved by puzzle.checkpointing)."""
        return {"iteration": self.iteration, "kl_ctl": self._advantages.kl_ctl.state_dict(),
                "reward_norm": self._rewards.state_dict(),
                "schedulers": {r: e.scheduler.state_dict() for r, e in self._engines.items() if e.trainable},
                "nonfinite_skipped": int(self._training.nonfinite.skipped),
                **({"partial_rollouts": self._partial.state_dict()} if self._partial is not None else {}),
                **({"overlap": self._in_flight.state_dict()} if self._in_flight is not None
                   and (self._in_flight.lag or len(self._in_flight)) else {})}

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()``'s output (after the role models' weights are loaded). Raises
        ValueError when a scheduler's shape differs from this run's."""
        self.iteration = int(state["iteration"])
        self._training.nonfinite.skipped = int(state.get("nonfinite_skipped", 0))
        self._advantages.kl_ctl.load_state_dict(state["kl_ctl"])
        self._rewards.load_state_dict(state.get("reward_norm", self._rewards.state_dict()))
        carried = state.get("partial_rollouts", {}).get("buffer", {}).get("lengths", [])
        if self._partial is None and carried:
            raise ValueError(f"the checkpoint carries {len(carried)} samples of --rl-partial-rollouts: resume "
                             "with the flag (without it they would be lost)")
        if self._partial is not None:
            if "partial_rollouts" not in state:
                raise ValueError("the checkpoint has no partial rollouts state (saved without --rl-partial-rollouts)")
            self._partial.load_state_dict(state["partial_rollouts"])
        if self._in_flight is not None:
            self._in_flight.load_state_dict(state.get("overlap") or {})
        for role, sched_state in state["schedulers"].items():
            eng = self._engines[role]
            if eng.scheduler is not None:
                try:
                    eng.scheduler.load_state_dict(sched_state)
                except AssertionError as e:  # megatron checks the schedule's shape against the state
                    raise ValueError(f"{role} LR schedule differs from the checkpoint's ({e}); the decay "
                                     "length follows --train-iters, --global-batch-size and --ppo-epochs") from e
        if self._switch is not None:
            self._switch.reset()  # the next generation switches from the loaded weights (a LoRA base too)


class PPOTrainer:
    """The run, as torchtitan's Trainer owns it: the role engines and the five stages (``step``
    runs one iteration through them), and for ``train()`` the prompt loader, the exit checks, the
    checkpointer (handed the engines, the loader and ``TrainState``), the evaluator (built from
    the stage objects), the progress display and the metrics sinks. Nothing outside this module
    reads or replaces its attributes (tests/unit/test_layering.py checks)."""

    def __init__(self, cfg: RunConfig, tokenizer, prompts, eval_prompts=None, *,
                 progress: Optional[Callable[[int, str], None]] = None, phase: Optional[PhaseLog] = None,
                 exit_control: Optional[run_control.ExitControl] = None, resume_step: Optional[int] = None):
        self.cfg, self.tokenizer, self.prompts, self.eval_prompts = cfg, tokenizer, prompts, eval_prompts
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
        self.switch = self.pools = None
        pools = pools_of(cfg)  # the actor generates on ranks of its own (--actor-gen-rank-offset)
        if pools is not None:
            self.switch = PoolSwitch(self.engines["actor"], gen_plan, cfg.switch_segments,
                                     ranks_per_node=cfg.ranks_per_node)
            if cfg.ppo.rl_desired_lag:
                self.pools = Pools(*pools)
        elif gen_plan != cfg.roles["actor"].plan:
            from puzzle.dataflow.actor_switch import ActorSwitch

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
        self.advantages = AdvantageStage(cfg.ppo, self.rewards, with_reference="ref" in self.engines or cfg.reference_is_actor_base)
        self.training = TrainingStage(cfg, self.engines, self.micro, self.switch, self.vocab, self.rank)
        # --rl-desired-lag: the batches generated, not trained yet (a save's, a checkpoint's)
        self.in_flight = InFlight(cfg.ppo.rl_desired_lag, self.runtime.device)
        self.received = 0  # --rl-desired-lag (training pool): the last batch received or held
        self.state = TrainState(self.engines, self.advantages, self.rewards, self.training, self.switch,
                                self.generation.partial, self.in_flight)
        self.progress = progress or (lambda iteration, phase: None)  # run_control.Progress: where this rank is
        self.phase = phase or PhaseLog(self.rank)  # rank 0's timed phase lines
        self.exit_control, self.resume_step = exit_control, resume_step
        self.checkpoint = checkpointing.Checkpointed(cfg, self.engines, self.state, progress=self.progress)
        self.logger = MetricsLogger(cfg.log_dir, cfg.log_interval, cfg.train_iters, self.rank, ops=cfg.ops)
        self.evaluator = self.sample_log = None  # opened by train() once the resumed iteration is known
        self.last_rollout = None  # --rl-desired-lag: the training pool's last rollout (its token versions)

    @classmethod
    def for_run(cls, cfg: RunConfig, tokenizer, prompts, eval_prompts=None, *,
                progress: Callable[[int, str], None], start_time: Optional[float] = None) -> "PPOTrainer":
        """The trainer of a whole run (``train()``): the exit checks armed first (a signal while
        models are built still stops the run after its first iteration), the checkpoint to resume
        verified before any model is built (checksums, the ranks sharing the work), then the models.
        Each phase is a rank-0 ``[phase]`` line."""
        phase = PhaseLog(dist.get_rank())
        exit_control = run_control.ExitControl(cfg.ops, start_time)
        try:
            step = cfg.ckpt_step
            if cfg.load:
                progress(0, "checkpoint verification")
                with phase("checkpoint verification"):
                    step = checkpointing.verify_checkpoint(cfg.load, step)
            progress(0, "model building")
            with phase("model building"):
                return cls(cfg, tokenizer, prompts, eval_prompts, progress=progress, phase=phase,
                           exit_control=exit_control, resume_step=step if cfg.load else None)
        except BaseException:
            exit_control.close()
            raise

    @property
    def iteration(self) -> int:
        return self.state.iteration

    @iteration.setter
    def iteration(self, value: int) -> None:
        self.state.iteration = value

    # ---- the run ----------------------------------------------------------------------------
    def train(self) -> None:
        """The run: resume (--load), evaluation before training, the iterations with saves every
        --save-interval and the exit checks (--exit-interval, --exit-duration-in-mins, signals),
        and the final save, as Megatron-LM's train loop."""
        cfg = self.cfg
        loader = PromptLoader(self.prompts.prompts, cfg.ppo.rollout_batch_size, dp_rank=0, dp_size=1, seed=cfg.seed)
        self.checkpoint.loader = loader
        if self.resume_step is not None:
            self.progress(0, "checkpoint loading")
            with self.phase(f"checkpoint loading (iteration {self.resume_step})"):
                checkpointing.load_checkpoint(self.checkpoint, cfg.load, load_optim=cfg.load_optim,
                                              load_rng=cfg.load_rng, iteration=self.resume_step)
        self._open_run_logs()

        def next_prompts():  # token ids and the records' other fields (ground truth for rewards)
            pb = next(loader)
            return pb.prompts, [self.prompts.records[i] if self.prompts.records else {} for i in pb.indices]

        if self.pools is not None:  # --rl-desired-lag >= 1 (its own evaluation before training)
            return self._train_overlapped(next_prompts)
        if self.evaluator is not None and self.iteration == 0:  # before training (a resumed run has its own)
            self.progress(0, "evaluation")
            with self.phase("evaluation (before training)"):
                before = self.evaluator(0)
            self.logger.log({"iteration": 0, **before})
        saved = self.iteration
        while self.iteration < cfg.train_iters:
            batch, metrics = self._iteration(*next_prompts(), refill=next_prompts)
            self._run_metrics(batch, metrics)  # collective
            self.logger.log(metrics)
            if self._save_due():
                self._save()
                saved = self.iteration
            reason = self._exit_reason()
            if reason:
                if self.rank == 0:
                    print(f"exiting after iteration {self.iteration}: {reason}"
                          + ("" if cfg.save else " (no --save: nothing saved)"), flush=True)
                break
        if cfg.save and saved != self.iteration:  # the final state, as Megatron-LM does
            self._save()

    def _train_overlapped(self, next_prompts: Callable) -> None:
        """--rl-desired-lag L >= 1: the rounds of puzzle/dataflow/overlap_stage.py, the generation
        pool generating batch r while the training pool trains batch r - L. Both pools draw the
        prompts in the same order (batch k: the k-th draw). A run resumed at iteration k with a
        checkpoint's batches in flight trains them first while the generation pool goes on from
        the checkpoint's weights (version k) with the next batch. A save (--save-interval, an exit,
        the end) takes the batches in flight into the checkpoint; an exit without --save drops them.
        The evaluation (--eval-prompts) of iteration k generates on the generation pool with the
        training pool's weights of iteration k (sent after step k) and is scored on the training pool."""
        from puzzle.dataflow.overlap_stage import first_round, num_rounds, pending, round_work
        from puzzle.parallel.scope import collective_scope

        cfg, pools, lag = self.cfg, self.pools, self.cfg.ppo.rl_desired_lag
        start, held = self.iteration, len(self.in_flight)  # (a checkpoint's batches in flight)
        generated = self.received = start + held  # the last batch generated (received)
        self.switch.start(start)  # the current weights (version ``start``) into the generation pool's kept shadow
        if pools.is_generation:
            self.in_flight.batches.clear()  # the training pool's to train
            for _ in range(held):  # generated before the checkpoint: the loader passes them
                next_prompts()
        elif self.evaluator is not None:
            self.evaluator.source = self._received_evaluation  # its batches come from the generation pool
        sends = self._overlapped_evaluation_before_training() if self.evaluator is not None and start == 0 else []
        saved = self.iteration
        for r in range(first_round(start, held), num_rounds(cfg.train_iters, lag) + 1):
            work = round_work(r, cfg.train_iters, lag, start)
            if work.train is not None and self.evaluator is not None and self.evaluator.due(work.train):
                work = replace(work, send_weights=True)  # the evaluation generates with step work.train's weights
            if pools.is_generation:
                sends = pending(sends) + self._generation_round(work, next_prompts)
            elif work.train is not None:
                with collective_scope(pools.train):
                    batch, metrics = self._training_round(work, next_prompts)
                    self._run_metrics(batch, metrics)
                self.logger.log(metrics)
            generated = work.generate or generated
            if work.train is None:
                continue  # no iteration ended (the first rounds fill the pipeline)
            self.iteration = work.train  # the batches trained (the same count on both pools)
            if self._save_due():
                self._save_overlapped(generated)
                saved = self.iteration
            reason = self._exit_reason()
            if reason:
                if self.rank == 0:
                    print(f"exiting after iteration {self.iteration}: {reason}; the {generated - self.iteration} "
                          "generated batch(es) in flight are " + ("saved with the checkpoint" if cfg.save
                                                                  else "dropped (no --save)"), flush=True)
                break
        if cfg.save and saved != self.iteration:  # the final state, as Megatron-LM does
            self._save_overlapped(generated)
        if not pools.is_generation:
            self._receive_in_flight(generated)  # an exit's batches in flight (saved, or dropped)
        for work, _ in sends:
            work.wait()

    def _save_due(self) -> bool:
        """--save-interval: the iteration just ended saves."""
        cfg = self.cfg
        return bool(cfg.save and cfg.save_interval and self.iteration % cfg.save_interval == 0)

    def _exit_reason(self) -> Optional[str]:
        """Why the run stops after the iteration just ended (--exit-interval, --exit-duration-in-mins,
        a signal), or None."""
        self.progress(self.iteration, "exit check")
        return self.exit_control.reason_to_exit(self.iteration) if self.exit_control else None

    def _receive_in_flight(self, generated: int) -> None:
        """The training pool takes in every batch generated up to ``generated`` not received yet."""
        from puzzle.dataflow.overlap_stage import receive_batch

        while self.received < generated:
            batch, version, seconds = receive_batch(self.pools.leader, self.runtime.device)
            self.received += 1
            self.in_flight.put(GeneratedBatch(self.received, batch, version, seconds))

    def _save_overlapped(self, generated: int) -> None:
        """A save in the overlap (both pools): the batches in flight go with the training pool's state."""
        if not self.pools.is_generation:
            self._receive_in_flight(generated)
        self._save()

    def _overlapped_evaluation_before_training(self) -> list:
        """Iteration 0's evaluation: generated by the generation pool (version 0), scored and
        logged by the training pool. Returns the generation pool's sends."""
        from puzzle.parallel.scope import collective_scope

        if self.pools.is_generation:
            return self._generate_evaluation(0)
        with collective_scope(self.pools.train):
            self.progress(0, "evaluation")
            with self.phase("evaluation (before training; generated by the generation pool)"):
                before = self.evaluator(0)
        self.logger.log({"iteration": 0, **before})
        return []

    def _generate_evaluation(self, iteration: int) -> list:
        """The generation pool's part of the evaluation of ``iteration`` (with the weights it holds:
        that iteration's): the eval batches, sent to every training rank (isend: the works)."""
        from puzzle.dataflow.overlap_stage import EVAL_TAG, send_batch
        from puzzle.parallel.scope import collective_scope

        self.progress(iteration, "evaluation")
        with collective_scope(self.pools.gen):
            batches = self.evaluator.generate(iteration)
        if self.rank != self.pools.leader:
            return []
        return [w for b in batches
                for w in send_batch(b, self.switch.version, 0.0, self.pools.train_ranks, tag=EVAL_TAG)]

    def _received_evaluation(self, iteration: int) -> list:
        """The training pool's side of ``_generate_evaluation``: the eval batches (the Evaluator's source)."""
        from puzzle.dataflow.overlap_stage import EVAL_TAG, receive_batch

        return [receive_batch(self.pools.leader, self.runtime.device, tag=EVAL_TAG)[0] for _ in self.evaluator.batches]

    def _generation_round(self, work, next_prompts: Callable) -> list:
        """The generation pool's round: batch ``work.generate`` with the weights it holds, then the
        training step's new weights (when sent), then the batch to the training pool (isend:
        the generation goes on while the training pool has not taken it yet), then the
        evaluation when due."""
        from puzzle.dataflow.overlap_stage import send_batch
        from puzzle.parallel.scope import collective_scope

        rollout, sends = None, []
        if work.generate is not None:
            prompt_ids, records = next_prompts()
            t0, version = time.perf_counter(), self.switch.version
            if version != work.version:
                raise RuntimeError(f"batch {work.generate}: the generation pool holds policy version {version}, "
                                   f"the schedule says {work.version}")
            with collective_scope(self.pools.gen):
                rollout = self.generation.run(prompt_ids, records, None, work.generate)
            seconds = time.perf_counter() - t0
        if work.send_weights:
            self.switch.receive(work.train)
        if rollout is not None and self.rank == self.pools.leader:
            sends = send_batch(rollout.batch, version, seconds, self.pools.train_ranks)
        if work.train is not None and self.evaluator is not None and self.evaluator.due(work.train):
            sends += self._generate_evaluation(work.train)
        return sends

    def _training_round(self, work, next_prompts: Callable) -> Tuple[RolloutBatch, dict]:
        """The training pool's round: batch ``work.train`` (held in flight from a checkpoint, else
        from the generation pool: the wait is the clock's "generate" stage), its rewards, scoring and
        training; the actor's step sends its weights to the generation pool when ``work.send_weights``."""
        from puzzle.dataflow.overlap_stage import receive_batch

        prompt_ids, records = next_prompts()
        self.iteration = it = work.train
        clock = StageClock(self.runtime, it, self.progress)
        shown = it == 1 or it % self.cfg.log_interval == 0 or it == self.cfg.train_iters

        def phase(name):
            return self.phase(f"iteration {it} {name}", show=shown)

        self.switch.send_next = work.send_weights
        with clock.stage("generate", "generation"):  # (in the training pool's scope: _train_overlapped)
            held = self.in_flight.take(it)
            if held is None:
                with phase("generation (waiting for the generation pool)"):
                    held = GeneratedBatch(it, *receive_batch(self.pools.leader, self.runtime.device))
                self.received = it
            rollout = self._generated_rollout(held, records)
            with phase("reward"):
                rewarded, reward_stats = self.rewards.score_rollout(rollout, it)
                stats = {**rollout.stats, **reward_stats}
        self.last_rollout = rollout
        out = self._train_rollout(rollout, rewarded, stats, clock, phase)
        self.switch.send_if_pending()
        return out

    def _generated_rollout(self, held: GeneratedBatch, records: List[dict]) -> Rollout:
        """A batch the generation pool generated (``held``), as the generation stage's Rollout for
        iteration ``held.index``: its tokens' policy version and staleness."""
        import torch.nn.functional as F

        from puzzle.dataflow.overlap_stage import token_versions
        from puzzle.rollout.partial import staleness

        batch, version = held.batch, held.version
        short = -batch.tokens.shape[1] % self.seq_multiple  # (a checkpoint's, resumed with another T)
        if short:
            batch = replace(batch, tokens=F.pad(batch.tokens, (0, short), value=self.tokenizer.pad_id))
        versions = token_versions(batch, version)
        rows = [v[v >= 0] for v in versions]
        return Rollout(batch, records, versions=versions, stats={
            **length_metrics(batch, self.tokenizer.eos_id), **staleness(rows, held.index - 1),
            "generation_pool_seconds": held.seconds, "generation_policy_version": version})

    def _open_run_logs(self) -> None:
        """The evaluator, --log-samples' file and a progress bar of each generation on a terminal
        (once the resumed iteration is known: the files keep the rows up to it)."""
        cfg, it = self.cfg, self.iteration
        if self.eval_prompts is not None:
            from puzzle.dataflow.evaluation import Evaluator

            self.evaluator = Evaluator(cfg, self.tokenizer, self.eval_prompts, self.generation, self.scoring,
                                       self.rewards, self.runtime, self.rank, resumed_from=it)
        if cfg.ops.log_samples:
            self.sample_log = SampleLog(cfg.log_dir, cfg.ops.log_samples, self.rank, it)
        where = self.progress  # run_control.Progress: "generation stage" or "evaluation"
        self.generation.progress = GenerationProgress.for_terminal(
            self.rank, lambda: f"iteration {self.iteration} {getattr(where, 'phase', 'generation')}")

    def _run_metrics(self, batch: RolloutBatch, metrics: dict) -> None:
        """A run's additions to an iteration's metrics (collective): learning rates and tokens/s,
        --log-samples rows, and the evaluation when due."""
        metrics.update(learning_rates(self.engines, self.runtime))
        metrics["tokens_per_sec"] = tokens_per_second(batch, metrics)
        if self.sample_log is not None and self.rank == 0:
            self.sample_log.write(rollout_sample_rows(batch, self.tokenizer, self.iteration,
                                                      self.cfg.ops.log_samples))
        if self.evaluator is not None and self.evaluator.due(self.iteration):
            self.progress(self.iteration, "evaluation")
            with self.phase(f"iteration {self.iteration} evaluation"):
                metrics.update(self.evaluator(self.iteration))

    def _save(self) -> None:
        self.progress(self.iteration, "checkpoint saving")
        with self.phase(f"checkpoint saving (iteration {self.iteration})"):
            checkpointing.save_checkpoint(self.checkpoint, self.cfg.save, keep_last=self.cfg.ops.keep_last_checkpoints)

    # ---- the iteration ---------------------------------------------------------------------
    def step(self, prompt_ids: List[List[int]], records: Optional[List[dict]] = None,
             refill: Optional[Callable] = None) -> dict:
        """One iteration on a global batch of prompts, logged; ``records`` are their dataset
        records (for the reward function), ``refill()`` the next (prompt_ids, records) for
        dynamic sampling."""
        _, metrics = self._iteration(prompt_ids, records, refill)
        self.logger.log(metrics)
        return metrics

    def _iteration(self, prompt_ids: List[List[int]], records: Optional[List[dict]],
                   refill: Optional[Callable]) -> Tuple[RolloutBatch, dict]:
        self.iteration += 1
        it = self.iteration
        clock = StageClock(self.runtime, it, self.progress)
        shown = it == 1 or it % self.cfg.log_interval == 0 or it == self.cfg.train_iters  # the phase lines

        def phase(name):
            return self.phase(f"iteration {it} {name}", show=shown)

        self.offload.before("generation")
        held = self.in_flight.take(it)  # a checkpoint's batch in flight (resumed at lag 0): trained first
        with clock.stage("generate", "generation"):
            with phase("generation" if held is None else "generation (a batch in flight in the checkpoint)"):
                rollout = (self.generation.run(prompt_ids, records, refill, it) if held is None else
                           self._generated_rollout(held, records if records is not None else [{} for _ in prompt_ids]))
            with phase("reward"):
                rewarded, reward_stats = self.rewards.score_rollout(rollout, it)
                stats = {**rollout.stats, **reward_stats}
        return self._train_rollout(rollout, rewarded, stats, clock, phase)

    def _train_rollout(self, rollout: Rollout, rewarded: Dict, stats: dict, clock: StageClock,
                       phase) -> Tuple[RolloutBatch, dict]:
        """The iteration after its generation and rewards: scoring, advantages, training."""
        it = self.iteration
        self.offload.before("scoring")
        with clock.stage("score", "scoring"), phase("scoring"):
            scored, score_stats = self.scoring.run(rollout.batch, it)
            stats.update(score_stats)
        batch = self._scored_batch(rollout.batch, rewarded, scored)
        advantages, adv_stats = self.advantages.run(batch)
        stats.update(adv_stats)
        batch = batch.with_outputs("advantages", **advantages)
        self.offload.before("training")
        with clock.stage("train", "training"), phase("training"):
            stats.update(self.training.run(batch, it))
        switch = self._switch_metrics()
        shown = it == 1 or it % self.cfg.log_interval == 0 or it == self.cfg.train_iters
        if switch and shown:  # overlapped with the actor's optimizer step (or before the generation)
            self.phase.ended(f"iteration {it} switch to the generation layout (slowest rank)",
                             switch["switch_seconds"])
        data = getattr(getattr(self.prompts, "stats", None), "as_dict", dict)()
        metrics = {"iteration": it, **stats, **switch,
                   **{f"prompts_{k}": v for k, v in data.items()}, **clock.metrics(batch.size)}
        return batch, metrics

    def _switch_metrics(self) -> dict:
        """The busiest rank's received bytes and the slowest rank's time of the last switch."""
        if self.switch is None or self.switch.last_stats is None:
            return {}
        st = self.switch.last_stats
        v = self.runtime.all_reduce([float(st.bytes_received), st.time_s], op="max")
        return {"switch_bytes_max_rank": int(v[0]), "switch_seconds": float(v[1])}

    @staticmethod
    def _scored_batch(batch: RolloutBatch, rewarded: Dict, scored: Dict) -> RolloutBatch:
        """The one place the scores enter the batch: the reward function's (``rewarded``, with
        ReMax's baseline) or the reward model's (checked by ``Rewards``, in ``scored``), with the
        scoring stage's fields."""
        scored = dict(scored)
        reward = {**rewarded, **({"scores": scored.pop("scores")} if "scores" in scored else {})}
        return batch.with_outputs("reward", **reward).with_outputs("scoring", **scored)

    # ---- the stages one at a time (tests, evaluation) ----------------------------------------
    def generate(self, prompt_ids: List[List[int]], records=None, refill=None):
        """Stage 1 and the reward function: (the batch with the reward function's scores, the metrics)."""
        rollout = self.generation.run(prompt_ids, records, refill, self.iteration)
        rewarded, stats = self.rewards.score_rollout(rollout, self.iteration)
        return rollout.batch.with_outputs("reward", **rewarded), {**rollout.stats, **stats}

    def score(self, batch: RolloutBatch) -> Tuple[RolloutBatch, dict]:
        """Stage 2 on a batch from ``generate``: (the batch with the scored fields, the metrics)."""
        scored, stats = self.scoring.run(batch, self.iteration)
        return self._scored_batch(batch, {}, scored), stats

    def compute_advantages(self, batch: RolloutBatch) -> Tuple[RolloutBatch, dict]:
        advantages, stats = self.advantages.run(batch)
        return batch.with_outputs("advantages", **advantages), stats

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

    def close(self) -> None:
        for log in (self.evaluator, self.sample_log):
            if log is not None:
                log.close()
        if self.exit_control is not None:
            self.exit_control.close()
        self.rewards.close()
        self.logger.close()
