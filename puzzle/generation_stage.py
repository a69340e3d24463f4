"""The generation stage's work around the rollout itself: building reward-function samples,
DAPO dynamic sampling (``--filter-groups``) and the rollout metrics.

Used by PPOTrainer (puzzle/trainer.py); everything here is identical on every rank.
"""

from __future__ import annotations

from typing import Callable, List, Optional

import torch

from puzzle.algorithms.advantage_estimators import group_mean_std
from puzzle.algorithms.dapo import informative_groups
from puzzle.reward_functions.runner import Sample
from puzzle.training.batch import RolloutBatch, concat_rollouts


def sample_maker(batch: RolloutBatch, tokenizer, records: List[dict]) -> Callable[[int], Sample]:
    """``make(b)``: row ``b`` of the rollout as a reward-function Sample (texts without EOS)."""

    tokens, plens, rlens = batch.tokens.cpu(), batch.prompt_lengths.tolist(), batch.response_lengths.tolist()

    def make(b: int) -> Sample:
        p, r = plens[b], rlens[b]
        pids, rids = tokens[b, :p].tolist(), tokens[b, p:p + r].tolist()
        rids = [t for t in rids if t != tokenizer.eos_id]
        return Sample(index=b, prompt_text=tokenizer.decode(pids), response_text=tokenizer.decode(rids),
                      prompt_ids=pids, response_ids=rids, record=records[b])

    return make


def dynamic_sampling(trainer, engine, prompt_ids: List[List[int]], records: List[dict],
                     refill: Optional[Callable]):
    """DAPO dynamic sampling: keep only groups whose (shaped) scores are not all equal; generate
    from the next prompts (``refill()``, else the same prompts again) until the batch holds as
    many groups as prompts, at most ``--max-num-gen-batches`` rounds. A batch still short then is
    filled with dropped groups (their advantages are 0 under group baselines), counted as
    ``filter_groups_padded``."""
    ppo = trainer.cfg.ppo
    N, target = ppo.n_samples_per_prompt, len(prompt_ids)
    kept: List[RolloutBatch] = []
    spare: List[RolloutBatch] = []
    n_kept = dropped = rounds = bad = 0
    prompts, recs = prompt_ids, records
    while True:
        b = trainer.rollout(engine, prompts, round_=rounds)
        bad += trainer.score_with_reward_fn(b, prompts, recs)["bad_rewards"]
        rounds += 1
        keep = informative_groups(trainer.shaped_scores(b.fields["scores"], b.response_lengths), b.fields["group_index"])
        keep_idx, drop_idx = torch.nonzero(keep).flatten(), torch.nonzero(~keep).flatten()
        dropped += len(drop_idx) // N
        if len(keep_idx):
            kept.append(b.rows(keep_idx))
            n_kept += len(keep_idx) // N
        if len(drop_idx):
            spare.append(b.rows(drop_idx))
        if n_kept >= target or rounds >= ppo.max_num_gen_batches:
            break
        prompts, recs = refill() if refill is not None else (prompt_ids, records)
    batch = concat_rollouts(kept + spare, trainer.tokenizer.pad_id)
    batch = batch.rows(torch.arange(target * N, device=batch.device))
    batch.fields["group_index"] = torch.arange(target * N, device=batch.device) // N
    return batch, {"bad_rewards": bad, "filter_groups_dropped": dropped, "filter_gen_rounds": rounds,
                   "filter_groups_padded": max(0, target - n_kept)}


def rollout_metrics(batch: RolloutBatch, eos_id: Optional[int], n_samples: int) -> dict:
    """Reward spread (overall and within groups), solved fraction (score >= 1: a verifiable
    reward's "correct"), length percentiles and the fraction of responses cut at the budget."""
    scores = batch.fields["scores"].to(torch.float64)
    lengths = batch.response_lengths
    R = batch.max_new_tokens
    last = (batch.prompt_lengths + lengths - 1).clamp(min=0)
    last_tok = batch.tokens.gather(1, last.unsqueeze(1)).squeeze(1)
    clipped = (lengths >= R) & (last_tok != (eos_id if eos_id is not None else -1))
    q = torch.quantile(lengths.to(torch.float64),
                       torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64, device=lengths.device))
    out = {"reward_std": float(scores.std()) if scores.numel() > 1 else 0.0,
           "solved_fraction": float((scores >= 1.0).to(torch.float64).mean()),
           "response_length_p10": float(q[0]), "response_length_p50": float(q[1]),
           "response_length_p90": float(q[2]), "response_length_max": int(lengths.max()),
           "response_clipped_frac": float(clipped.to(torch.float64).mean())}
    if n_samples > 1 and "group_index" in batch.fields:
        _, std, _ = group_mean_std(scores, batch.fields["group_index"])
        out["reward_group_std_mean"] = float(std.mean())
        out["groups_all_solved"] = int(((scores >= 1.0).view(-1, n_samples).all(dim=1)).sum())
        out["groups_none_solved"] = int(((scores < 1.0).view(-1, n_samples).all(dim=1)).sum())
    return out
