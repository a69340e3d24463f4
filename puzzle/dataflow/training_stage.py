"""Stage 3, training: PPO epochs of actor and critic updates over shuffled mini-batches.

Each mini-batch runs one stage schedule over both trained models (time-shared when the layouts
allow), then the NaN/inf policy (``nonfinite.SkipPolicy``) decides, on every rank alike, which
optimizer steps happen; the actor's last step of the iteration overlaps with the switch to its
generation layout. The losses are summed per micro-batch under their names (``NamedSums``) and
reduced over the world once per iteration.
"""

from __future__ import annotations

from typing import Dict, Iterable, List

import torch

from puzzle.parallel.device import runtime
from puzzle.pipeline.stage import run_stage
from puzzle.dataflow import steps
from puzzle.dataflow.batch import RolloutBatch
from puzzle.engine.moe_metrics import moe_aux_loss_metrics
from puzzle.engine.nonfinite import SkipPolicy

#: per trained model: the sums its micro-batch outputs add (output key -> sum name)
ACTOR_SUMS = {"policy_loss_sum": "policy_loss", "clip_sum": "clip", "approx_kl_sum": "approx_kl",
              "tokens": "tokens", "loss_weight": "loss_weight", "kl_loss_sum": "kl_loss"}
CRITIC_SUMS = {"value_loss_sum": "value_loss", "value_clip_sum": "value_clip", "tokens": "value_tokens"}
SUM_NAMES = ("policy_loss", "clip", "approx_kl", "tokens", "value_loss", "value_clip", "value_tokens",
             "loss_weight", "kl_loss")


class NamedSums:
    """Float64 sums under names, reduced over the world in one all-reduce. Every rank declares
    the same names (in the same order); a rank that computed nothing adds nothing."""

    def __init__(self, names: Iterable[str]):
        self.values: Dict[str, float] = dict.fromkeys(names, 0.0)

    def add(self, outputs: List[dict], names: Dict[str, str]) -> None:
        """Each output's ``key`` into the sum ``names[key]`` (a missing key adds 0)."""
        for o in outputs:
            for key, name in names.items():
                if key in o:
                    self.values[name] += float(o[key])

    def all_reduce(self) -> Dict[str, float]:
        return dict(zip(self.values, runtime().all_reduce(self.values.values())))


class TrainingStage:
    def __init__(self, cfg, engines: Dict, micro, switch, vocab: int, rank: int):
        self.cfg, self.ppo, self.engines, self.micro, self.switch = cfg, cfg.ppo, engines, micro, switch
        self.vocab = vocab
        self.nonfinite = SkipPolicy(cfg.ops.skip_nonfinite_iterations, rank, cfg.faults)

    def jobs(self, R: int) -> list:
        ppo = self.ppo
        temp = 1.0 if ppo.greedy else ppo.temperature
        jobs = [("actor", steps.actor_train_step(self.vocab, temp, R, ppo.clip_eps, ppo.entropy_coef,
                                                 clip_eps_high=ppo.clip_eps_high, loss_agg=ppo.loss_agg_mode,
                                                 kl_loss_coef=ppo.kl_loss_coef, kl_loss_type=ppo.kl_loss_type,
                                                 use_kl_loss=ppo.use_kl_loss,
                                                 is_correction=ppo.rl_inference_logprobs_is_correction,
                                                 is_truncation_coef=ppo.rl_importance_sampling_truncation_coef))]
        if "critic" in self.engines:
            jobs.append(("critic", steps.critic_train_step(R, ppo.value_clip_eps)))
        return jobs

    def run(self, batch: RolloutBatch, iteration: int) -> dict:
        """Collective: every PPO epoch's mini-batch updates; the iteration's loss metrics."""
        ppo = self.ppo
        jobs = self.jobs(batch.max_new_tokens)
        trained = [self.engines[role] for role, _ in jobs]
        sums = NamedSums(SUM_NAMES)
        grad_norms: Dict[str, List[float]] = {role: [] for role, _ in jobs}
        gen = torch.Generator().manual_seed(self.cfg.seed * 7919 + iteration)
        per_epoch = batch.size // ppo.mini_batch_size
        micro_batches_run = [0] * len(trained)
        for epoch in range(ppo.ppo_epochs):
            perm = torch.randperm(batch.size, generator=gen)
            for k, s in enumerate(range(0, batch.size, ppo.mini_batch_size)):
                for eng in trained:
                    if eng.member:
                        eng.zero_grad()
                rows = perm[s:s + ppo.mini_batch_size]
                contexts = self.micro.contexts(batch, jobs, ppo.ppo_max_token_len_per_gpu, self.cfg.train_placement,
                                               rows=rows)
                outs = run_stage(contexts, forward_only=False, placement=self.cfg.train_placement)
                micro_batches_run = [n + ctx.num_microbatches for n, ctx in zip(micro_batches_run, contexts)]
                outs = [out if self._owner(eng) else [] for eng, out in zip(trained, outs)]
                where = f"training stage, PPO epoch {epoch + 1}, mini-batch {k + 1} of {per_epoch}"
                skip = self.nonfinite.roles_to_skip(
                    [(role, eng, out, (key,)) for (role, _), eng, out, key in
                     zip(jobs, trained, outs, ("policy_loss_sum", "value_loss_sum"))], iteration, where)
                skip |= nothing_to_train(batch, rows)
                last = epoch == ppo.ppo_epochs - 1 and k == per_epoch - 1
                self._optimizer_steps(skip, last, grad_norms)
                for (role, _), out in zip(jobs, outs):
                    sums.add(out, ACTOR_SUMS if role == "actor" else CRITIC_SUMS)
        moe = moe_aux_loss_metrics(trained, micro_batches_run, runtime().device)
        return {**moe, **self._metrics(sums.all_reduce(), grad_norms)}

    @staticmethod
    def _owner(eng) -> bool:
        """The rank whose micro-batch outputs count: last pipeline stage, TP rank 0."""
        return eng.member and eng.layout.is_last_stage and eng.layout.t == 0

    def _optimizer_steps(self, skip: set, last: bool, grad_norms: Dict[str, List[float]]) -> None:
        """The optimizer steps not skipped; the actor's last one of the iteration overlaps with
        the switch to the generation layout (an actor step skipped: the next generation switches
        the unchanged weights)."""
        actor, critic = self.engines["actor"], self.engines.get("critic")
        if "actor" in skip:
            pass
        elif self.switch and last:
            res = self.switch.optimizer_step_and_switch()
            if actor.member:
                grad_norms["actor"].append(res["grad_norm"])
        elif actor.member:
            grad_norms["actor"].append(actor.optimizer_step()["grad_norm"])
        if critic is not None and critic.member and "critic" not in skip:
            grad_norms["critic"].append(critic.optimizer_step()["grad_norm"])

    def _metrics(self, sums: Dict[str, float], grad_norms: Dict[str, List[float]]) -> dict:
        norms = runtime().all_reduce([max(grad_norms["actor"] or [0.0]),
                                      max(grad_norms.get("critic") or [0.0])], op="max")
        tok, weight = max(sums["tokens"], 1.0), max(sums["loss_weight"], 1.0)
        stats = {"nonfinite_skipped_steps": self.nonfinite.skipped} if self.nonfinite.allowed else {}
        stats.update({"policy_loss": sums["policy_loss"] / weight, "clip_frac": sums["clip"] / tok,
                      "approx_kl": sums["approx_kl"] / tok})
        if "critic" in self.engines:  # no critic built (critic-free estimators): no critic metrics
            vtok = max(sums["value_tokens"], 1.0)
            stats.update({"value_loss": sums["value_loss"] / vtok, "value_clip_frac": sums["value_clip"] / vtok})
        stats.update({"actor_grad_norm": float(norms[0])})
        if "critic" in self.engines:
            stats["critic_grad_norm"] = float(norms[1])
        if self.ppo.use_kl_loss:
            stats["kl_loss"] = sums["kl_loss"] / tok
        return stats


def nothing_to_train(batch: RolloutBatch, rows: torch.Tensor) -> set:
    """{"actor"} when the mini-batch ``rows`` of ``batch`` (every rank's, the same) has no token
    for the actor's loss: --rl-partial-rollouts-max-staleness masked them all. Its optimizer step
    is skipped: on zero gradients Adam would still move the weights by its moments."""
    if batch.policy_loss_mask is None:
        return set()
    return set() if bool((batch.response_mask[rows] * batch.policy_loss_mask[rows]).any()) else {"actor"}
