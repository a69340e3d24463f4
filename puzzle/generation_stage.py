"""Stage 1, generation: the actor (in its generation layout) samples N responses of every prompt
and the stage assembles them into the world's ``RolloutBatch`` (puzzle/training/batch.py), the
form every later stage reads. With ``--filter-groups`` (DAPO dynamic sampling) it asks the run's
``Rewards`` for each round's scores to keep the informative groups; with ReMax it also samples
the greedy baseline of every prompt (same engine, same stage).

Everything here is collective and ends identical on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, List, Optional

import torch

from puzzle.algorithms.advantage_estimators import ESTIMATORS
from puzzle.algorithms.dapo import informative_groups
from puzzle.training.batch import RolloutBatch, concat_rollouts, rollout_from_generation


@dataclass
class Rollout:
    """What the generation stage hands on: the batch (prompt-major, row b is of prompt b // N),
    the dataset record of each prompt, ReMax's greedy samples and the stage's metrics."""

    batch: RolloutBatch
    records: List[dict]
    greedy: Optional[RolloutBatch] = None
    stats: dict = field(default_factory=dict)


class GenerationStage:
    def __init__(self, cfg, tokenizer, actor, switch, rewards, device: torch.device, seq_multiple: int = 1):
        self.cfg, self.ppo, self.tokenizer = cfg, cfg.ppo, tokenizer
        self.actor, self.switch, self.rewards = actor, switch, rewards
        self.device, self.seq_multiple = device, seq_multiple
        self.progress = None  # progress(finished, rows) of each generation (a terminal display)

    def engine(self):
        """The actor in its generation layout (the switch's shadow model when layouts differ)."""
        return self.switch.generation_engine() if self.switch else self.actor

    def run(self, prompt_ids: List[List[int]], records: Optional[List[dict]], refill: Optional[Callable],
            iteration: int) -> Rollout:
        """Each prompt N times (--n-samples-per-prompt); ``refill()`` gives DAPO's next prompts."""
        records = records if records is not None else [{} for _ in prompt_ids]
        engine = self.engine()
        if self.ppo.filter_groups:
            out = self._dynamic_sampling(engine, prompt_ids, records, refill, iteration)
        else:
            out = Rollout(self.rollout(engine, prompt_ids, iteration), records)
        if ESTIMATORS[self.ppo.advantage_estimator].needs_greedy_baseline:
            out.greedy = self.rollout(engine, prompt_ids, iteration, greedy=True)
        if self.switch:
            self.switch.release()
        out.stats.update(length_metrics(out.batch, self.tokenizer.eos_id))
        return out

    def rollout(self, engine, prompt_ids: List[List[int]], iteration: int, round_: int = 0,
                greedy: bool = False) -> RolloutBatch:
        """Generate N samples of every prompt (prompt-major); the noise is keyed by the global
        sample index (+ round x batch size for later rounds)."""
        from puzzle.rollout.generation import SamplingParams, generate

        ppo, N = self.ppo, self.ppo.n_samples_per_prompt
        prompt_ids = [p for p in prompt_ids for _ in range(N)]
        B, layout, R = len(prompt_ids), engine.layout, ppo.max_new_tokens
        responses = lengths = logprobs = None
        if engine.member:
            part, parts, _ = layout.generation_share()  # E > 1: an expert-parallel group generates together
            share = B // parts
            params = SamplingParams(max_new_tokens=R, temperature=ppo.temperature, top_k=ppo.top_k,
                                    top_p=ppo.top_p, greedy=ppo.greedy or greedy,
                                    eos_id=self.tokenizer.eos_id, pad_id=self.tokenizer.pad_id,
                                    eos_ids=tuple(self.tokenizer.eos_ids))
            out = generate(engine, prompt_ids[part * share:(part + 1) * share], params,
                           seed=self.cfg.seed * 100003 + iteration,
                           micro_batch_size=ppo.generation_micro_batch_size,
                           cuda_graphs=ppo.cuda_graph_generation, compile_graphs=ppo.compile_generation,
                           batch_invariant=ppo.batch_invariant_mode, sample_offset=round_ * B + part * share,
                           progress=self.progress)
            responses, lengths, logprobs = out.response_tokens, out.response_lengths, out.logprobs
        batch = rollout_from_generation(prompt_ids, responses, lengths, layout, R, self.tokenizer.pad_id,
                                        self.device, seq_multiple=self.seq_multiple, logprobs=logprobs,
                                        with_logprobs=True)
        if N > 1:
            batch.fields["group_index"] = torch.arange(B, device=batch.device) // N
        return batch

    def _dynamic_sampling(self, engine, prompt_ids: List[List[int]], records: List[dict],
                          refill: Optional[Callable], iteration: int) -> Rollout:
        """DAPO dynamic sampling: keep only groups whose (shaped) scores are not all equal; generate
        from the next prompts (``refill()``, else the same prompts again) until the batch holds as
        many groups as prompts, at most ``--max-num-gen-batches`` rounds. A batch still short then is
        filled with dropped groups (their advantages are 0 under group baselines), counted as
        ``filter_groups_padded``. The rows come back scored."""
        N, target = self.ppo.n_samples_per_prompt, len(prompt_ids)
        kept: List[RolloutBatch] = []
        spare: List[RolloutBatch] = []
        n_kept = dropped = rounds = bad = 0
        prompts, recs = prompt_ids, records
        while True:
            b = self.rollout(engine, prompts, iteration, round_=rounds)
            bad += self.rewards.score(b, recs, iteration)
            rounds += 1
            keep = informative_groups(self.rewards.filter_scores(b), b.fields["group_index"])
            keep_idx, drop_idx = torch.nonzero(keep).flatten(), torch.nonzero(~keep).flatten()
            dropped += len(drop_idx) // N
            if len(keep_idx):
                kept.append(b.rows(keep_idx))
                n_kept += len(keep_idx) // N
            if len(drop_idx):
                spare.append(b.rows(drop_idx))
            if n_kept >= target or rounds >= self.ppo.max_num_gen_batches:
                break
            prompts, recs = refill() if refill is not None else (prompt_ids, records)
        batch = concat_rollouts(kept + spare, self.tokenizer.pad_id)
        batch = batch.rows(torch.arange(target * N, device=batch.device))
        batch.fields["group_index"] = torch.arange(target * N, device=batch.device) // N
        return Rollout(batch, records, stats={"bad_rewards": bad, "filter_groups_dropped": dropped,
                                              "filter_gen_rounds": rounds,
                                              "filter_groups_padded": max(0, target - n_kept)})


def length_metrics(batch: RolloutBatch, eos_id: Optional[int]) -> dict:
    """Response length mean and percentiles, and the fraction of responses cut at the budget."""
    lengths = batch.response_lengths
    last = (batch.prompt_lengths + lengths - 1).clamp(min=0)
    last_tok = batch.tokens.gather(1, last.unsqueeze(1)).squeeze(1)
    clipped = (lengths >= batch.max_new_tokens) & (last_tok != (eos_id if eos_id is not None else -1))
    q = torch.quantile(lengths.to(torch.float64),
                       torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64, device=lengths.device))
    return {"response_length_mean": float(lengths.float().mean()),
            "response_length_p10": float(q[0]), "response_length_p50": float(q[1]),
            "response_length_p90": float(q[2]), "response_length_max": int(lengths.max()),
            "response_clipped_frac": float(clipped.to(torch.float64).mean())}
