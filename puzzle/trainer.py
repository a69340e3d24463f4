"""PPOTrainer: one process group, four role models, three stages per iteration.

    generate (actor, generation layout) -> score (actor old log-probs, ref, reward, critic)
    -> advantages (pure math) -> train (actor, critic) -> [switch to the generation layout]
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Dict, List

import torch
import torch.distributed as dist

from puzzle.algorithms import build_kl_controller, compute_gae, compute_token_rewards, masked_mean
from puzzle.config import RunConfig
from puzzle.metrics import MetricsLogger
from puzzle.parallel.groups import layout_for
from puzzle.pipeline.stage import StageContext, run_stage
from puzzle.training import steps
from puzzle.training.batch import RolloutBatch, right_pad_rollout, world_assemble
from puzzle.training.engine import ModelEngine


class PPOTrainer:
    def __init__(self, cfg: RunConfig, tokenizer, prompts):
        self.cfg, self.tokenizer, self.prompts = cfg, tokenizer, prompts
        self.rank = dist.get_rank()
        self.vocab = tokenizer.vocab_size
        ppo = cfg.ppo
        self.engines: Dict[str, ModelEngine] = {}
        for role, spec in cfg.roles.items():
            optim = replace(cfg.optim, lr=spec.lr) if spec.trainable else None
            # the reference starts as the actor: same shape and seed -> the same weights
            seed = cfg.seed + (0 if role in ("actor", "ref") else {"critic": 1, "reward": 2}[role])
            self.engines[role] = ModelEngine(role, spec.arch, layout_for(spec.plan),
                                             trainable=spec.trainable, optim=optim, seed=seed,
                                             recompute=cfg.recompute, bf16=cfg.bf16, fp16=cfg.fp16)
            if spec.hf_path and self.engines[role].member:
                from puzzle.models.hf_llama import load_hf_into_model

                # each rank reads only its own shards; a critic from an LM keeps its fresh head
                load_hf_into_model(self.engines[role].module, spec.arch, role, spec.hf_path,
                                   allow_missing_head=role == "critic")
        gen_plan = cfg.roles["actor"].gen_plan
        self.switch = None
        if gen_plan != cfg.roles["actor"].plan:
            from puzzle.training.actor_switch import ActorSwitch

            self.switch = ActorSwitch(self.engines["actor"], gen_plan, cfg.switch_segments,
                                      ranks_per_node=cfg.ranks_per_node)
        self.kl_ctl = build_kl_controller(ppo.kl_coef, ppo.kl_target, ppo.kl_horizon)
        self.reward_fn = None
        if cfg.reward_fn:
            from puzzle.rewards import load_reward_fn

            self.reward_fn = load_reward_fn(cfg.reward_fn)
        self.iteration = 0
        self.logger = MetricsLogger(cfg.log_dir, cfg.log_interval, cfg.train_iters, self.rank)

    # ---- the iteration ---------------------------------------------------------------------
    def step(self, prompt_ids: List[List[int]]) -> dict:
        self.iteration += 1
        t0 = time.perf_counter()
        batch = self.generate(prompt_ids)
        t1 = time.perf_counter()
        self.score(batch)
        t2 = time.perf_counter()
        adv_stats = self.compute_advantages(batch)
        train_stats = self.train(batch)
        t3 = time.perf_counter()
        data = getattr(getattr(self.prompts, "stats", None), "as_dict", dict)()
        metrics = {"iteration": self.iteration, **adv_stats, **train_stats, **self._switch_metrics(),
                   **{f"prompts_{k}": v for k, v in data.items()},
                   "response_length_mean": float(batch.response_lengths.float().mean()),
                   "samples_per_sec": batch.size / (t3 - t0),
                   "time_generate": t1 - t0, "time_score": t2 - t1, "time_train": t3 - t2}
        self.logger.log(metrics)
        return metrics

    def _switch_metrics(self) -> dict:
        """The busiest rank's received bytes and the slowest rank's time of the last switch."""
        if self.switch is None or self.switch.last_stats is None:
            return {}
        st = self.switch.last_stats
        v = torch.tensor([float(st.bytes_received), st.time_s], dtype=torch.float64)
        dist.all_reduce(v, op=dist.ReduceOp.MAX)
        return {"switch_bytes_max_rank": int(v[0]), "switch_seconds": float(v[1])}

    # ---- stage 1: generation -----------------------------------------------------------------
    def generate(self, prompt_ids: List[List[int]]) -> RolloutBatch:
        from puzzle.rollout.generation import SamplingParams, generate

        ppo, B = self.cfg.ppo, len(prompt_ids)
        engine = self.switch.generation_engine() if self.switch else self.engines["actor"]
        layout, R = engine.layout, ppo.max_new_tokens
        responses = lengths = None
        owner = False
        share = B // layout.plan.D
        if engine.member:
            mine = prompt_ids[layout.d * share:(layout.d + 1) * share]
            params = SamplingParams(max_new_tokens=R, temperature=ppo.temperature, top_k=ppo.top_k,
                                    top_p=ppo.top_p, greedy=ppo.greedy,
                                    eos_id=self.tokenizer.eos_id, pad_id=self.tokenizer.pad_id,
                                    eos_ids=tuple(self.tokenizer.eos_ids))
            out = generate(engine, mine, params, seed=self.cfg.seed * 100003 + self.iteration,
                           micro_batch_size=ppo.generation_micro_batch_size,
                           sample_offset=layout.d * share)
            Lp = out.tokens.shape[1] - R
            responses, lengths = out.tokens[:, Lp:], out.response_lengths
            owner = layout.p == 0 and layout.t == 0
        if self.switch:
            self.switch.release()
        d0 = max(layout.d, 0) * share
        responses = world_assemble(responses, d0, B, (R,), torch.long, owner)
        lengths = world_assemble(lengths, d0, B, (), torch.long, owner)
        prompt_lengths = torch.tensor([len(p) for p in prompt_ids], dtype=torch.long)
        Lmax = max(len(p) for p in prompt_ids)
        left = torch.full((B, Lmax), self.tokenizer.pad_id, dtype=torch.long)
        for b, p in enumerate(prompt_ids):
            left[b, Lmax - len(p):] = torch.tensor(p, dtype=torch.long)
        seq = int((prompt_lengths + R).max())
        tokens = right_pad_rollout(left, prompt_lengths, responses, lengths, seq, self.tokenizer.pad_id)
        return RolloutBatch(tokens, prompt_lengths, lengths, R)

    # ---- stage 2: scoring ----------------------------------------------------------------------
    def _contexts(self, batch: RolloutBatch, jobs):
        mbs, contexts, shares = self.cfg.ppo.micro_batch_size, [], []
        for role, fn in jobs:
            eng = self.engines[role]
            D = eng.layout.plan.D
            share = batch.dp_share(eng.layout.d, D) if eng.member else batch.dp_share(0, D)
            contexts.append(StageContext(eng, fn, iter(share.micro_batches(mbs)),
                                         share.size // mbs, batch.tokens.shape[1], mbs))
            shares.append(share.size)
        return contexts, shares

    def _assemble(self, role: str, outputs, key: str, batch: RolloutBatch, share: int):
        eng = self.engines[role]
        owner = eng.member and eng.layout.is_last_stage and eng.layout.t == 0
        local = torch.cat([o[key] for o in outputs]) if owner else None
        tail = () if key == "scores" else (batch.max_new_tokens,)
        return world_assemble(local, max(eng.layout.d, 0) * share, batch.size, tail,
                              torch.float32, owner)

    def score(self, batch: RolloutBatch) -> None:
        ppo, R = self.cfg.ppo, batch.max_new_tokens
        temp = 1.0 if ppo.greedy else ppo.temperature
        jobs = [("actor", steps.logprob_score_step(self.vocab, temp, R, with_entropy=True)),
                ("ref", steps.logprob_score_step(self.vocab, temp, R)),
                ("critic", steps.value_score_step(R))]
        if "reward" in self.engines:
            jobs.append(("reward", steps.reward_score_step()))
        contexts, shares = self._contexts(batch, jobs)
        outs = run_stage(contexts, forward_only=True, placement=self.cfg.score_placement)
        f = batch.fields
        f["old_logprobs"] = self._assemble("actor", outs[0], "logprobs", batch, shares[0])
        f["entropy"] = self._assemble("actor", outs[0], "entropy", batch, shares[0])
        f["ref_logprobs"] = self._assemble("ref", outs[1], "logprobs", batch, shares[1])
        f["values"] = self._assemble("critic", outs[2], "values", batch, shares[2])
        if "reward" in self.engines:
            f["scores"] = self._assemble("reward", outs[3], "scores", batch, shares[3])
        else:
            f["scores"] = self._reward_fn_scores(batch)

    def _reward_fn_scores(self, batch: RolloutBatch) -> torch.Tensor:
        scores = torch.zeros(batch.size, dtype=torch.float64)
        if self.rank == 0:  # once, then broadcast: reward functions need not be deterministic
            for b in range(batch.size):
                p, r = int(batch.prompt_lengths[b]), int(batch.response_lengths[b])
                pids, rids = batch.tokens[b, :p].tolist(), batch.tokens[b, p:p + r].tolist()
                rids_text = [t for t in rids if t not in self.tokenizer.eos_ids]
                scores[b] = float(self.reward_fn(self.tokenizer.decode(pids), self.tokenizer.decode(rids_text),
                                                 pids, rids_text))
        dist.broadcast(scores, src=0)
        return scores.float()

    # ---- advantages (pure math, identical on every rank) -------------------------------------
    def compute_advantages(self, batch: RolloutBatch) -> dict:
        ppo, f, mask = self.cfg.ppo, batch.fields, batch.response_mask
        kl_coef = self.kl_ctl.value
        rewards, kl = compute_token_rewards(f["scores"], f["old_logprobs"], f["ref_logprobs"], mask,
                                            kl_coef=kl_coef, kl_kind=ppo.kl_estimator,
                                            clip_reward=ppo.reward_clip)
        adv, ret = compute_gae(rewards, f["values"], mask, ppo.gamma, ppo.lam,
                               whiten_advantages=ppo.whiten_advantages)
        f["advantages"], f["returns"] = adv, ret
        seq_kl = (kl * mask).sum(dim=1).mean()
        self.kl_ctl.update(float(seq_kl), batch.size)
        return {"reward_mean": float(f["scores"].mean()), "kl": float(masked_mean(kl, mask)),
                "kl_seq": float(seq_kl), "kl_coef": kl_coef,
                "entropy": float(masked_mean(f["entropy"], mask)),
                "value_mean": float(masked_mean(f["values"], mask)),
                "return_mean": float(masked_mean(ret, mask))}

    # ---- stage 3: training ---------------------------------------------------------------------
    def train(self, batch: RolloutBatch) -> dict:
        ppo, R = self.cfg.ppo, batch.max_new_tokens
        temp = 1.0 if ppo.greedy else ppo.temperature
        actor, critic = self.engines["actor"], self.engines["critic"]
        sums = torch.zeros(7, dtype=torch.float64)  # pg, clip, approx_kl, tokens, vloss, vclip, vtok
        grad_norms = {"actor": [], "critic": []}
        gen = torch.Generator().manual_seed(self.cfg.seed * 7919 + self.iteration)
        n_steps = ppo.ppo_epochs * (batch.size // ppo.mini_batch_size)
        step = 0
        for epoch in range(ppo.ppo_epochs):
            perm = torch.randperm(batch.size, generator=gen)
            for s in range(0, batch.size, ppo.mini_batch_size):
                step += 1
                mini = batch.rows(perm[s:s + ppo.mini_batch_size])
                jobs = [("actor", steps.actor_train_step(self.vocab, temp, R, ppo.clip_eps, ppo.entropy_coef)),
                        ("critic", steps.critic_train_step(R, ppo.value_clip_eps))]
                contexts, _ = self._contexts(mini, jobs)
                for eng in (actor, critic):
                    if eng.member:
                        eng.zero_grad()
                outs = run_stage(contexts, forward_only=False, placement=self.cfg.train_placement)
                if self.switch and step == n_steps:  # last actor step overlapped with the switch
                    res = self.switch.optimizer_step_and_switch()
                    if actor.member:
                        grad_norms["actor"].append(res["grad_norm"])
                elif actor.member:
                    grad_norms["actor"].append(actor.optimizer_step()["grad_norm"])
                if critic.member:
                    grad_norms["critic"].append(critic.optimizer_step()["grad_norm"])
                if actor.member and actor.layout.is_last_stage and actor.layout.t == 0:
                    for o in outs[0]:
                        sums[0:4] += torch.tensor([float(o["policy_loss_sum"]), float(o["clip_sum"]),
                                                   float(o["approx_kl_sum"]), float(o["tokens"])],
                                                  dtype=torch.float64)
                if critic.member and critic.layout.is_last_stage and critic.layout.t == 0:
                    for o in outs[1]:
                        sums[4:7] += torch.tensor([float(o["value_loss_sum"]), float(o["value_clip_sum"]),
                                                   float(o["tokens"])], dtype=torch.float64)
        dist.all_reduce(sums)
        norms = torch.tensor([max(grad_norms["actor"] or [0.0]), max(grad_norms["critic"] or [0.0])],
                             dtype=torch.float64)
        dist.all_reduce(norms, op=dist.ReduceOp.MAX)
        tok, vtok = max(float(sums[3]), 1.0), max(float(sums[6]), 1.0)
        return {"policy_loss": float(sums[0]) / tok, "clip_frac": float(sums[1]) / tok,
                "approx_kl": float(sums[2]) / tok, "value_loss": float(sums[4]) / vtok,
                "value_clip_frac": float(sums[5]) / vtok,
                "actor_grad_norm": float(norms[0]), "critic_grad_norm": float(norms[1])}

    def close(self) -> None:
        self.logger.close()
