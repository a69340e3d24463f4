"""Stage 2, scoring: forward passes of the roles that exist over the rollout batch.

``MicroBatching`` is where a stage's data moves: it cuts each model's data-parallel share of the
batch into micro-batches (puzzle/training/batch.py ``RolloutBatch.micro_batches``, packed without
padding by default) and wraps them in the ``StageContext`` a stage schedule runs. The outputs come
back to every rank through ``gather_outputs`` (one world all-reduce per field), so the batch
leaves the stage complete and identical on every rank.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from puzzle.algorithms.rollout_correction import mismatch_metrics
from puzzle.config import ROLES
from puzzle.pipeline.stage import StageContext, one_program_roles, run_stage
from puzzle.training import nonfinite, steps
from puzzle.training.batch import RolloutBatch, gather_outputs

#: each scoring role's outputs: (key in its micro-batch outputs, field of the batch)
SCORED_FIELDS = {"actor": (("logprobs", "old_logprobs"), ("entropy", "entropy")),
                 "ref": (("logprobs", "ref_logprobs"),), "critic": (("values", "values"),),
                 "reward": (("scores", "scores"),)}


def schedule_shape(mbatches: List[dict], packed: bool, padded_seq: int, mbs: int,
                   seq_multiple: int = 1) -> Tuple[int, int, bool]:
    """(sequence length, rows, whether the shapes vary) of a stage's micro-batches, as the
    schedule and the pipeline stages' exchanges see them: right-padded [mbs, S]; packed [1, T] of
    their own lengths (the stages exchange the shapes when the lengths differ). When every packed
    micro-batch holds k sequences of the same n tokens (n a multiple of ``seq_multiple``, e.g.
    every response at the cap) there is no padding to remove: each micro-batch is marked
    ``dense_shape`` (k, n) and runs as a [k, n] batch, the padded path's work and layout without
    the packed path's per-sequence RoPE and attention gathers (steps._run)."""
    if not packed:
        return padded_seq, mbs, False
    dense = {_uniform_shape(mb, seq_multiple) for mb in mbatches}
    if len(dense) == 1 and None not in dense:
        (k, n), = dense
        for mb in mbatches:
            mb["dense_shape"] = (k, n)
        return n, k, False
    lengths = {mb["tokens"].shape[1] for mb in mbatches}
    return max(lengths), 1, len(lengths) > 1


def _uniform_shape(mb: dict, seq_multiple: int) -> Optional[Tuple[int, int]]:
    """(k, n) when the packed micro-batch is k sequences of n tokens each, else None."""
    lengths = mb["packed_seq_params"].lengths
    n = lengths[0]
    if n % seq_multiple or any(x != n for x in lengths):
        return None
    return len(lengths), n


class MicroBatching:
    """Each model's micro-batches of a batch: ``micro_batch_size`` rows of its DP share, packed
    without padding (``packed``, --use-remove-padding) or right-padded; with ``dynamic_bsz``
    (--use-dynamic-bsz) and a token budget, DP shares balanced by tokens and micro-batches of at
    most that many tokens."""

    def __init__(self, engines: Dict, micro_batch_size: int, packed: bool, seq_multiple: int, pad_id: int,
                 dynamic_bsz: bool = False):
        self.engines, self.micro_batch_size, self.packed = engines, micro_batch_size, packed
        self.seq_multiple, self.pad_id, self.dynamic_bsz = seq_multiple, pad_id, dynamic_bsz

    def contexts(self, batch: RolloutBatch, jobs: List[Tuple[str, object]],
                 token_budget: Optional[int] = None, placement: str = "sequential") -> List[StageContext]:
        """A StageContext per (role, forward_step) job over its model's DP share of ``batch``
        (``token_budget``: --ppo-max-token-len-per-gpu or --log-prob-max-token-len-per-gpu;
        ``placement``: the stage's, see ``_equal_counts``)."""
        mbs, packed = self.micro_batch_size, self.packed
        token_budget = token_budget if self.dynamic_bsz else None
        equal = self._equal_counts(jobs, placement) if token_budget is not None else set()
        contexts = []
        for role, fn in jobs:
            eng = self.engines[role]
            order = batch.share_rows(eng.layout, balance=token_budget is not None)
            count = None  # every DP rank runs as many micro-batches (token_budget.split_to_count)
            if role in equal and eng.layout.plan.D > 1:
                count = batch.most_budget_micro_batches(eng.layout.plan.D, token_budget)
            mbatches = batch.rows(order).micro_batches(mbs, packed=packed, seq_multiple=self.seq_multiple,
                                                       pad_id=self.pad_id, token_budget=token_budget, count=count)
            if token_budget is not None:
                order = order[torch.cat([mb["rows"] for mb in mbatches])]
            seq, rows, variable = schedule_shape(mbatches, packed, batch.tokens.shape[1], mbs, self.seq_multiple)
            if eng.member:
                eng.config.variable_seq_lengths = variable and eng.layout.plan.P > 1
            contexts.append(StageContext(eng, fn, iter(mbatches), len(mbatches), seq, rows,
                                         rows=order if token_budget is not None else None))
        return contexts

    def _equal_counts(self, jobs: List[Tuple[str, object]], placement: str) -> set:
        """The roles whose token-budget micro-batches must number the same on every DP rank: MoE
        models with experts split over E > 1 ranks (their dispatchers' collectives run once per
        micro-batch in every rank of an expert group), and the models of a time-shared stream whose
        pipelines must all run one program (puzzle.parallel.streams.needs_one_program: equal P at
        different (D, T) on the same ranks). Fixed-count micro-batches number the same on every
        DP rank anyway (``share_rows`` gives each the same number of rows)."""
        plans = {role: self.engines[role].layout.plan for role, _ in jobs}
        equal = set(one_program_roles(plans, placement))
        return equal | {role for role, _ in jobs if self.engines[role].arch.is_moe and plans[role].E > 1}


class ScoringStage:
    """Actor old log-probs and entropy, reference log-probs, critic values and reward-model scores
    (handed to the run's ``Rewards`` to be checked), each written once into ``batch.fields``."""

    def __init__(self, cfg, engines: Dict, micro: MicroBatching, rewards, vocab: int):
        self.cfg, self.engines, self.micro, self.rewards, self.vocab = cfg, engines, micro, rewards, vocab

    def jobs(self, R: int) -> List[Tuple[str, object]]:
        ppo = self.cfg.ppo
        temp = 1.0 if ppo.greedy else ppo.temperature
        jobs = {"actor": steps.logprob_score_step(self.vocab, temp, R, with_entropy=True,
                                                  batch_invariant=ppo.batch_invariant_mode),
                "ref": steps.logprob_score_step(self.vocab, temp, R),
                "critic": steps.value_score_step(R), "reward": steps.reward_score_step()}
        return [(role, jobs[role]) for role in ROLES if role in self.engines]

    def run(self, batch: RolloutBatch, iteration: int) -> dict:
        """Collective: the scored fields on every rank; raises NonFiniteError on a NaN/inf output."""
        ppo, f = self.cfg.ppo, batch.fields
        jobs = self.jobs(batch.max_new_tokens)
        contexts = self.micro.contexts(batch, jobs, ppo.log_prob_max_token_len_per_gpu,
                                       self.cfg.score_placement)
        outs = run_stage(contexts, forward_only=True, placement=self.cfg.score_placement)
        stats = {}
        for (role, _), out, ctx in zip(jobs, outs, contexts):
            for key, name in SCORED_FIELDS[role]:
                value = gather_outputs(out, key, self.engines[role], batch, ctx.rows)
                if role == "reward":  # a reward model's scores follow --on-bad-reward like a function's
                    stats["bad_rewards"] = self.rewards.take_model_scores(batch, value, iteration)
                else:
                    f[name] = value
        nonfinite.check_scores(f, batch.response_mask, iteration,
                               {name: role for role, _ in jobs for _, name in SCORED_FIELDS[role]})
        if "gen_logprobs" in f:  # generation vs scoring log-probs of the sampled tokens
            stats.update(mismatch_metrics(f["gen_logprobs"], f["old_logprobs"], batch.response_mask,
                                          ppo.rl_inference_logprobs_is_correction,
                                          ppo.rl_importance_sampling_truncation_coef))
        return stats
