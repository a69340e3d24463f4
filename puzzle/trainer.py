"""PPOTrainer: one process group, up to four role models, three stages per iteration.

    generate (actor, generation layout; N samples per prompt, reward function, DAPO filter,
    ReMax greedy baseline) -> score (actor old log-probs, ref, reward model, critic)
    -> advantages (pure math, --advantage-estimator) -> train (actor, critic)
    -> [switch to the generation layout]

The roles that exist (cfg.roles) follow the estimator and the KL settings: no critic unless
gae, no reference when KL enters neither the reward nor the loss (puzzle.arguments.role_set).
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from puzzle import generation_stage
from puzzle.algorithms import RunningMoments, build_kl_controller, compute_token_rewards, masked_mean
from puzzle.algorithms.advantage_estimators import ESTIMATORS, compute_advantages
from puzzle.algorithms.rollout_correction import mismatch_metrics
from puzzle.config import ROLES, RunConfig
from puzzle.metrics import MetricsLogger
from puzzle.parallel.groups import layout_for
from puzzle.pipeline.stage import StageContext, run_stage
from puzzle.training import steps
from puzzle.parallel.device import runtime
from puzzle.training import nonfinite
from puzzle.training.batch import RolloutBatch, gather_outputs, rollout_from_generation
from puzzle.training.moe_metrics import moe_aux_loss_metrics
from puzzle.training.engine import ModelEngine
from puzzle.training.offload import StageOffload


class PPOTrainer:
    def __init__(self, cfg: RunConfig, tokenizer, prompts):
        self.cfg, self.tokenizer, self.prompts = cfg, tokenizer, prompts
        self.rank = dist.get_rank()
        self.runtime = runtime()
        # the ids a response may contain: the same mask in generation, scoring, training and KL
        self.vocab = cfg.roles["actor"].arch.valid_vocab_size
        if tokenizer.vocab_size != self.vocab:
            raise ValueError(f"the tokenizer has {tokenizer.vocab_size} ids but the run was configured for "
                             f"{self.vocab} (validate_args with this tokenizer's vocab_size)")
        ppo = cfg.ppo
        self.engines: Dict[str, ModelEngine] = {}
        for role, spec in cfg.roles.items():
            optim = replace(cfg.optim, lr=spec.lr) if spec.trainable else None
            # the reference starts as the actor: same shape and seed -> the same weights
            seed = spec.init_seed(cfg.seed)
            self.engines[role] = ModelEngine(role, spec.arch, layout_for(spec.plan),
                                             trainable=spec.trainable, optim=optim, seed=seed,
                                             recompute=cfg.recompute, bf16=cfg.bf16, fp16=cfg.fp16,
                                             transformer_impl=cfg.transformer_impl,
                                             sequence_parallel=cfg.sequence_parallel)
            if spec.hf_path and self.engines[role].member:
                from puzzle.models.hf_checkpoint import load_hf_into_model

                # each rank reads only its own shards; a critic from an LM keeps its fresh head
                load_hf_into_model(self.engines[role].module, spec.arch, role, spec.hf_path,
                                   allow_missing_head=spec.description.allow_missing_head)
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
        self.remove_padding = cfg.ppo.use_remove_padding  # packed scoring/training micro-batches
        self.kl_ctl = build_kl_controller(ppo.kl_coef, ppo.kl_target, ppo.kl_horizon)
        from puzzle.reward_functions.distributed import BadRewardPolicy, RolloutRewarder

        self.rewarder = None
        if cfg.reward_fn:
            self.rewarder = RolloutRewarder(cfg.reward_fn, workers=cfg.reward_workers, timeout=cfg.reward_timeout,
                                            on_bad_reward=cfg.on_bad_reward, bad_reward_value=cfg.bad_reward_value)
        self.bad_rewards = (self.rewarder.policy if self.rewarder else
                            BadRewardPolicy(cfg.on_bad_reward, cfg.bad_reward_value))
        self.reward_norm = RunningMoments()  # --reward-normalization running (checkpointed)
        self.iteration = 0
        self.nonfinite_skipped = 0  # optimizer steps skipped for NaN/inf (checkpointed)
        self.progress = lambda iteration, phase: None  # run_control.Progress: where this rank is
        self.logger = MetricsLogger(cfg.log_dir, cfg.log_interval, cfg.train_iters, self.rank, ops=cfg.ops)
        self.generation_progress = None  # progress(finished, rows) of each generation (a terminal display)
        self.on_iteration_end = lambda batch, metrics: None  # the run loop's additions to the metrics

    # ---- the iteration ---------------------------------------------------------------------
    def step(self, prompt_ids: List[List[int]], records: Optional[List[dict]] = None,
             refill: Optional[Callable] = None) -> dict:
        """One iteration on a global batch of prompts; ``records`` are their dataset records (for
        the reward function), ``refill()`` the next (prompt_ids, records) for dynamic sampling."""
        self.iteration += 1
        rt = self.runtime
        peaks = []  # accelerator only: peak bytes allocated per stage on this rank
        rt.reset_peak_memory()
        t0 = time.perf_counter()
        self.progress(self.iteration, "generation stage")
        self.offload.before("generation")
        batch, gen_stats = self.generate(prompt_ids, records, refill)
        rt.synchronize()
        t1 = time.perf_counter()
        peaks.append(rt.peak_memory_bytes())
        rt.reset_peak_memory()
        self.progress(self.iteration, "scoring stage")
        self.offload.before("scoring")
        gen_stats.update(self.score(batch))
        rt.synchronize()
        t2 = time.perf_counter()
        peaks.append(rt.peak_memory_bytes())
        rt.reset_peak_memory()
        adv_stats = self.compute_advantages(batch)
        self.progress(self.iteration, "training stage")
        self.offload.before("training")
        train_stats = self.train(batch)
        rt.synchronize()
        t3 = time.perf_counter()
        peaks.append(rt.peak_memory_bytes())
        data = getattr(getattr(self.prompts, "stats", None), "as_dict", dict)()
        metrics = {"iteration": self.iteration, **adv_stats, **train_stats, **self._switch_metrics(),
                   **gen_stats,
                   **{f"prompts_{k}": v for k, v in data.items()},
                   "response_length_mean": float(batch.response_lengths.float().mean()),
                   "samples_per_sec": batch.size / (t3 - t0),
                   "time_generate": t1 - t0, "time_score": t2 - t1, "time_train": t3 - t2}
        if rt.on_accelerator:  # the busiest rank's peak per stage
            peaks = rt.all_reduce(peaks, op="max")
            metrics.update({f"mem_peak_gib_{k}": v / 2 ** 30
                            for k, v in zip(("generate", "score", "train"), peaks)})
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

    # ---- stage 1: generation (+ verifiable rewards, DAPO dynamic sampling, ReMax baseline) -----
    def generate(self, prompt_ids: List[List[int]], records=None, refill=None):
        """Each prompt N times (--n-samples-per-prompt), scored by the reward function when there is
        one; returns the batch and the stage's metrics."""
        ppo = self.cfg.ppo
        engine = self.switch.generation_engine() if self.switch else self.engines["actor"]
        if ppo.filter_groups:
            batch, stats = generation_stage.dynamic_sampling(self, engine, prompt_ids, records, refill)
        else:
            batch = self.rollout(engine, prompt_ids)
            stats = self.score_with_reward_fn(batch, prompt_ids, records) if self.rewarder else {}
        if ESTIMATORS[ppo.advantage_estimator].needs_greedy_baseline:  # ReMax: same stage, same engine
            greedy = self.rollout(engine, prompt_ids, greedy=True)
            self.score_with_reward_fn(greedy, prompt_ids, records, what="greedy baseline sample")
            batch.fields["baseline_scores"] = self.shaped_scores(greedy.fields["scores"], greedy.response_lengths)
        if self.switch:
            self.switch.release()
        return batch, stats

    def rollout(self, engine, prompt_ids: List[List[int]], round_: int = 0, greedy: bool = False) -> RolloutBatch:
        """Generate N samples of every prompt (prompt-major: sample b is of prompt b // N); the noise
        is keyed by the global sample index (+ round x batch size for later rounds)."""
        from puzzle.rollout.generation import SamplingParams, generate

        ppo, N = self.cfg.ppo, self.cfg.ppo.n_samples_per_prompt
        prompt_ids = [p for p in prompt_ids for _ in range(N)]
        B = len(prompt_ids)
        layout, R = engine.layout, ppo.max_new_tokens
        responses = lengths = logprobs = None
        share = B // layout.plan.D
        part = layout.d
        if engine.member:
            part, parts, _ = layout.generation_share()  # E > 1: an expert-parallel group generates together
            share = B // parts
            mine = prompt_ids[part * share:(part + 1) * share]
            params = SamplingParams(max_new_tokens=R, temperature=ppo.temperature, top_k=ppo.top_k,
                                    top_p=ppo.top_p, greedy=ppo.greedy or greedy,
                                    eos_id=self.tokenizer.eos_id, pad_id=self.tokenizer.pad_id,
                                    eos_ids=tuple(self.tokenizer.eos_ids))
            out = generate(engine, mine, params, seed=self.cfg.seed * 100003 + self.iteration,
                           micro_batch_size=ppo.generation_micro_batch_size,
                           cuda_graphs=ppo.cuda_graph_generation, compile_graphs=ppo.compile_generation,
                           sample_offset=round_ * B + part * share, progress=self.generation_progress)
            Lp = out.tokens.shape[1] - R
            responses, lengths, logprobs = out.tokens[:, Lp:], out.response_lengths, out.logprobs
        batch = rollout_from_generation(prompt_ids, responses, lengths, layout, R, self.tokenizer.pad_id,
                                        self.runtime.device, seq_multiple=self.seq_multiple,
                                        logprobs=logprobs, with_logprobs=True)
        if N > 1:
            batch.fields["group_index"] = torch.arange(B, device=batch.device) // N
        return batch

    def score_with_reward_fn(self, batch: RolloutBatch, prompt_ids, records, what: str = "sample") -> dict:
        """``fields['scores']`` from the reward function, computed across ranks; its metrics."""
        N = self.cfg.ppo.n_samples_per_prompt
        records = records if records is not None else [{} for _ in prompt_ids]
        make = generation_stage.sample_maker(batch, self.tokenizer, [records[b // N] for b in range(batch.size)])
        scores, bad = self.rewarder.score(make, batch.size, self.iteration, what)
        batch.fields["scores"] = scores.to(batch.device)
        return {"bad_rewards": bad}

    def shaped_scores(self, scores: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """DAPO's overlong penalty added to the scores (--overlong-buffer-len)."""
        ppo = self.cfg.ppo
        if not ppo.overlong_buffer_len:
            return scores
        from puzzle.algorithms.dapo import overlong_penalty

        return scores + overlong_penalty(lengths, ppo.max_new_tokens, ppo.overlong_buffer_len,
                                         ppo.overlong_penalty_factor)

    # ---- stage 2: scoring ----------------------------------------------------------------------
    def _contexts(self, batch: RolloutBatch, jobs, token_budget: Optional[int] = None):
        """Each job's StageContext over its model's DP share: micro-batches of --micro-batch-size
        rows, packed without padding (--use-remove-padding) or right-padded; with ``token_budget``
        (--use-dynamic-bsz) DP shares balanced by tokens and micro-batches of that many tokens."""
        mbs, packed = self.cfg.ppo.micro_batch_size, self.remove_padding
        token_budget = token_budget if self.cfg.ppo.use_dynamic_bsz else None
        contexts = []
        for role, fn in jobs:
            eng = self.engines[role]
            order = batch.share_rows(eng.layout, balance=token_budget is not None)
            share = batch.rows(order)
            mbatches = share.micro_batches(mbs, packed=packed, seq_multiple=self.seq_multiple,
                                           pad_id=self.tokenizer.pad_id, token_budget=token_budget)
            if token_budget is not None:
                order = order[torch.cat([mb["rows"] for mb in mbatches])]
            seq, rows = batch.tokens.shape[1], mbs
            if packed:  # [1, T] micro-batches of their own lengths: stages exchange the shapes
                seq, rows = max(mb["tokens"].shape[1] for mb in mbatches), 1
            if eng.member:  # equal packed lengths (e.g. every response at the cap): no shape exchange
                eng.config.variable_seq_lengths = (packed and eng.layout.plan.P > 1
                                                   and len({mb["tokens"].shape[1] for mb in mbatches}) > 1)
            contexts.append(StageContext(eng, fn, iter(mbatches), len(mbatches), seq, rows,
                                         rows=order if token_budget is not None else None))
        return contexts

    def score(self, batch: RolloutBatch) -> dict:
        """Forward passes of the roles that exist (cfg.roles): actor old log-probs and entropy,
        reference log-probs, critic values, reward-model scores (checked like a reward function's)."""
        ppo, R = self.cfg.ppo, batch.max_new_tokens
        temp = 1.0 if ppo.greedy else ppo.temperature
        jobs = {"actor": steps.logprob_score_step(self.vocab, temp, R, with_entropy=True),
                "ref": steps.logprob_score_step(self.vocab, temp, R),
                "critic": steps.value_score_step(R), "reward": steps.reward_score_step()}
        jobs = [(role, jobs[role]) for role in ROLES if role in self.engines]
        contexts = self._contexts(batch, jobs, ppo.log_prob_max_token_len_per_gpu)
        outs = run_stage(contexts, forward_only=True, placement=self.cfg.score_placement)
        f = batch.fields
        for (role, _), out, ctx in zip(jobs, outs, contexts):
            for key, name in {"actor": (("logprobs", "old_logprobs"), ("entropy", "entropy")),
                              "ref": (("logprobs", "ref_logprobs"),), "critic": (("values", "values"),),
                              "reward": (("scores", "scores"),)}[role]:
                f[name] = gather_outputs(out, key, self.engines[role], batch, ctx.rows)
        stats = {}
        if "reward" in self.engines:  # a reward model's scores follow --on-bad-reward like a function's
            f["scores"], stats["bad_rewards"] = self.bad_rewards.check_scores(
                f["scores"], f"reward model {self.cfg.reward_model}", self.iteration)
        sources = {"old_logprobs": "actor", "entropy": "actor", "ref_logprobs": "ref", "values": "critic",
                   "scores": "reward"}
        nonfinite.check_scores(f, batch.response_mask, self.iteration,
                               {k: r for k, r in sources.items() if r in self.engines})
        if "gen_logprobs" in f:  # generation vs scoring log-probs of the sampled tokens
            stats.update(mismatch_metrics(f["gen_logprobs"], f["old_logprobs"], batch.response_mask,
                                          ppo.rl_inference_logprobs_is_correction,
                                          ppo.rl_importance_sampling_truncation_coef))
        return stats

    # ---- advantages (pure math, identical on every rank) -------------------------------------
    def compute_advantages(self, batch: RolloutBatch) -> dict:
        ppo, f, mask = self.cfg.ppo, batch.fields, batch.response_mask
        kl_coef = self.kl_ctl.value
        scores = self.shaped_scores(f["scores"], batch.response_lengths)
        baseline = f.get("baseline_scores")
        if ppo.reward_normalization == "running":
            scores = self.reward_norm.normalize(scores).float()
            baseline = None if baseline is None else self.reward_norm.normalize(baseline, update=False).float()
        ref = f.get("ref_logprobs", f["old_logprobs"])  # no reference: no KL
        rewards, kl = compute_token_rewards(scores, f["old_logprobs"], ref, mask,
                                            kl_coef=kl_coef if "ref" in self.engines else 0.0,
                                            kl_kind=ppo.kl_estimator, clip_reward=ppo.reward_clip)
        adv, ret = compute_advantages(ppo.advantage_estimator, rewards, mask, values=f.get("values"),
                                      group_index=f.get("group_index"), baseline_scores=baseline,
                                      gamma=ppo.gamma, lam=ppo.lam, whiten_advantages=ppo.whiten_advantages,
                                      std_normalization=ppo.grpo_std_normalization)
        f["advantages"], f["returns"] = adv, ret
        seq_kl = (kl * mask).sum(dim=1).mean()
        self.kl_ctl.update(float(seq_kl), batch.size)
        stats = {"reward_mean": float(f["scores"].mean()), "kl": float(masked_mean(kl, mask)),
                 "kl_seq": float(seq_kl), "kl_coef": kl_coef,
                 "entropy": float(masked_mean(f["entropy"], mask))}
        if ppo.reward_normalization == "running":
            stats.update(reward_norm_mean=self.reward_norm.mean, reward_norm_std=self.reward_norm.std)
        if "values" in f:
            stats["value_mean"] = float(masked_mean(f["values"], mask))
        stats["return_mean"] = float(masked_mean(ret, mask))
        return {**stats, **generation_stage.rollout_metrics(batch, self.tokenizer.eos_id,
                                                           ppo.n_samples_per_prompt)}

    # ---- stage 3: training ---------------------------------------------------------------------
    def train(self, batch: RolloutBatch) -> dict:
        ppo, R = self.cfg.ppo, batch.max_new_tokens
        temp = 1.0 if ppo.greedy else ppo.temperature
        actor, critic = self.engines["actor"], self.engines.get("critic")
        trained = [e for e in (actor, critic) if e is not None]
        # pg, clip, approx_kl, tokens, vloss, vclip, vtok, actor loss weight, kl loss
        sums = torch.zeros(9, dtype=torch.float64, device=self.runtime.device)
        grad_norms = {"actor": [], "critic": []}
        gen = torch.Generator().manual_seed(self.cfg.seed * 7919 + self.iteration)
        n_steps = ppo.ppo_epochs * (batch.size // ppo.mini_batch_size)
        step = 0
        actor_step = steps.actor_train_step(self.vocab, temp, R, ppo.clip_eps, ppo.entropy_coef,
                                            clip_eps_high=ppo.clip_eps_high, loss_agg=ppo.loss_agg_mode,
                                            kl_loss_coef=ppo.kl_loss_coef, kl_loss_type=ppo.kl_loss_type,
                                            use_kl_loss=ppo.use_kl_loss,
                                            is_correction=ppo.rl_inference_logprobs_is_correction,
                                            is_truncation_coef=ppo.rl_importance_sampling_truncation_coef)
        for epoch in range(ppo.ppo_epochs):
            perm = torch.randperm(batch.size, generator=gen)
            for s in range(0, batch.size, ppo.mini_batch_size):
                step += 1
                mini = batch.rows(perm[s:s + ppo.mini_batch_size])
                jobs = [("actor", actor_step)]
                if critic is not None:
                    jobs.append(("critic", steps.critic_train_step(R, ppo.value_clip_eps)))
                contexts = self._contexts(mini, jobs, ppo.ppo_max_token_len_per_gpu)
                for eng in trained:
                    if eng.member:
                        eng.zero_grad()
                outs = run_stage(contexts, forward_only=False, placement=self.cfg.train_placement)
                skip = self._nonfinite_steps(outs, epoch, s // ppo.mini_batch_size, n_steps)
                if "actor" in skip:
                    pass  # no update; the next generation switches the unchanged weights
                elif self.switch and step == n_steps:  # last actor step overlapped with the switch
                    res = self.switch.optimizer_step_and_switch()
                    if actor.member:
                        grad_norms["actor"].append(res["grad_norm"])
                elif actor.member:
                    grad_norms["actor"].append(actor.optimizer_step()["grad_norm"])
                if critic is not None and critic.member and "critic" not in skip:
                    grad_norms["critic"].append(critic.optimizer_step()["grad_norm"])
                if actor.member and actor.layout.is_last_stage and actor.layout.t == 0:
                    for o in outs[0]:
                        sums[0:4] += torch.stack([o["policy_loss_sum"], o["clip_sum"],
                                                  o["approx_kl_sum"], o["tokens"]]).double()
                        sums[7:9] += torch.stack([o["loss_weight"], o.get("kl_loss_sum", o["loss_weight"] * 0)]
                                                 ).double()
                if critic is not None and critic.member and critic.layout.is_last_stage and critic.layout.t == 0:
                    for o in outs[1]:
                        sums[4:7] += torch.stack([o["value_loss_sum"], o["value_clip_sum"],
                                                  o["tokens"]]).double()
        dist.all_reduce(sums)
        moe = moe_aux_loss_metrics(trained, batch.size, ppo.ppo_epochs, ppo.micro_batch_size, self.runtime.device)
        norms = self.runtime.all_reduce([max(grad_norms["actor"] or [0.0]),
                                         max(grad_norms["critic"] or [0.0])], op="max")
        tok, vtok, weight = max(float(sums[3]), 1.0), max(float(sums[6]), 1.0), max(float(sums[7]), 1.0)
        skipped = {"nonfinite_skipped_steps": self.nonfinite_skipped} if self.cfg.ops.skip_nonfinite_iterations else {}
        stats = {**skipped, **moe, "policy_loss": float(sums[0]) / weight, "clip_frac": float(sums[1]) / tok,
                 "approx_kl": float(sums[2]) / tok, "value_loss": float(sums[4]) / vtok,
                 "value_clip_frac": float(sums[5]) / vtok,
                 "actor_grad_norm": float(norms[0]), "critic_grad_norm": float(norms[1])}
        if critic is None:  # no critic built (critic-free estimators): no critic metrics
            for key in ("value_loss", "value_clip_frac", "critic_grad_norm"):
                del stats[key]
        if ppo.use_kl_loss:
            stats["kl_loss"] = float(sums[8]) / tok
        return stats

    def _nonfinite_steps(self, outs, epoch: int, mini: int, n_steps: int) -> set:
        """Collective: the roles whose optimizer step is skipped for a NaN/inf loss or gradient
        (--skip-nonfinite-iterations); past the allowance, NonFiniteError on every rank."""
        checks = []
        for i, (role, keys) in enumerate((("actor", ("policy_loss_sum",)), ("critic", ("value_loss_sum",)))):
            if role not in self.engines:  # no critic for critic-free estimators
                continue
            eng = self.engines[role]
            nonfinite.inject_for_test(role, eng, self.iteration, self.cfg.faults)
            last = eng.member and eng.layout.is_last_stage and eng.layout.t == 0
            checks.append((role, eng, outs[i] if last else [], keys))
        found = nonfinite.find(checks)
        where = f"training stage, PPO epoch {epoch + 1}, mini-batch {mini + 1} of {n_steps // self.cfg.ppo.ppo_epochs}"
        allowed = self.cfg.ops.skip_nonfinite_iterations
        for role, kinds in found.items():
            msg = nonfinite.describe(role, kinds, self.iteration, where)
            if self.nonfinite_skipped >= allowed:
                raise nonfinite.NonFiniteError(msg + (f"; {self.nonfinite_skipped} step(s) skipped already, "
                                            f"--skip-nonfinite-iterations {allowed}" if allowed else
                                            "; --skip-nonfinite-iterations N skips up to N such steps"))
            self.nonfinite_skipped += 1
            if self.rank == 0:
                print(f"warning: {msg}: optimizer step skipped ({self.nonfinite_skipped}/{allowed}, "
                      f"--skip-nonfinite-iterations)", flush=True)
            eng = self.engines[role]
            if eng.member:
                eng.zero_grad()
        return set(found)

    # ---- checkpointed state (torchtitan's Stateful) -------------------------------------------
    def state_dict(self) -> dict:
        """The trainer's own state, JSON-serialisable: counters, the KL controller, the reward
        normaliser and the trainable roles' LR schedulers (weights and optimizer states are the
        role models' sharded state dicts, saved by puzzle.checkpointing)."""
        return {"iteration": self.iteration, "kl_ctl": self.kl_ctl.state_dict(),
                "reward_norm": self.reward_norm.state_dict(),
                "schedulers": {r: e.scheduler.state_dict() for r, e in self.engines.items() if e.trainable},
                "nonfinite_skipped": int(self.nonfinite_skipped)}

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()``'s output (after the role models' weights are loaded). Raises
        ValueError when a scheduler's shape differs from this run's."""
        self.iteration = int(state["iteration"])
        self.nonfinite_skipped = int(state.get("nonfinite_skipped", 0))
        self.kl_ctl.load_state_dict(state["kl_ctl"])
        self.reward_norm.load_state_dict(state.get("reward_norm", self.reward_norm.state_dict()))
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
        if self.rewarder is not None:
            self.rewarder.close()
        self.logger.close()
