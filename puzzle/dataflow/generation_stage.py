"""Stage 1, generation: the actor (in its generation layout) samples N responses of every prompt
and the stage assembles them into the world's ``RolloutBatch`` (puzzle/dataflow/batch.py), the
form every later stage reads. With ``--filter-groups`` (DAPO dynamic sampling) it asks the run's
``Rewards`` for each round's scores to keep the informative groups; with ReMax it also samples
the greedy baseline of every prompt (same engine, same stage).

Everything here is collective and ends identical on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, List, Optional

import torch

from puzzle.algorithms.advantage_estimators import ESTIMATORS
from puzzle.algorithms.dapo import informative_groups
from puzzle.dataflow.batch import RolloutBatch, concat_rollouts, rollout_from_generation
from puzzle.dataflow.env_turns import gather_episodes


@dataclass
class Rollout:
    """What the generation stage hands on: the batch (prompt-major, row b is of prompt b // N),
    the dataset record of each prompt, ReMax's greedy samples and the stage's metrics."""

    batch: RolloutBatch
    records: List[dict]
    greedy: Optional[RolloutBatch] = None
    stats: dict = field(default_factory=dict)
    scores: Optional[torch.Tensor] = None  # DAPO: the reward function's scores of the kept rows
    # --rl-partial-rollouts: the policy version each response token was sampled under ([B, R], -1
    # after the response) and each row's global sample index
    versions: Optional[torch.Tensor] = None
    sample_ids: Optional[List[int]] = None
    turn_rewards: Optional[torch.Tensor] = None  # multi-turn: [B, R] each step's reward at its turn's end


class GenerationStage:
    def __init__(self, cfg, tokenizer, actor, switch, rewards, device: torch.device, seq_multiple: int = 1):
        self.cfg, self.ppo, self.tokenizer = cfg, cfg.ppo, tokenizer
        self.actor, self.switch, self.rewards = actor, switch, rewards
        self.device, self.seq_multiple = device, seq_multiple
        self.progress = None  # progress(finished, rows) of each generation (a terminal display)
        self.episodes = None  # multi-turn (--max-turns > 1): the last sample()'s EpisodeResults
        self.partial = None  # --rl-partial-rollouts: the carried samples (puzzle/dataflow/partial_stage.py)
        if self.ppo.rl_partial_rollouts:
            from puzzle.dataflow.partial_stage import PartialRollouts

            self.partial = PartialRollouts(cfg, tokenizer, device, seq_multiple, multi_turn=rewards.multi_turn)

    def engine(self):
        """The actor in its generation layout (the switch's shadow model when layouts differ)."""
        return self.switch.generation_engine() if self.switch else self.actor

    def run(self, prompt_ids: List[List[int]], records: Optional[List[dict]], refill: Optional[Callable],
            iteration: int) -> Rollout:
        """Each prompt N times (--n-samples-per-prompt); ``refill()`` gives DAPO's next prompts."""
        records = records if records is not None else [{} for _ in prompt_ids]
        engine = self.engine()
        if self.partial is not None:
            batch, recs, versions, ids, stats = self.partial.run(engine, self._sample_partial, prompt_ids, records,
                                                                 refill, iteration)
            out = Rollout(batch, recs, stats=stats, versions=versions, sample_ids=ids)
            if self.partial.episodes is not None:  # multi-turn: the carried episodes scored the rows
                self._score_episodes(out, self.partial.episodes, iteration)
        elif self.ppo.filter_groups:
            out = self._dynamic_sampling(engine, prompt_ids, records, refill, iteration)
        else:
            out = Rollout(self.rollout(engine, prompt_ids, iteration, records=records), records)
            if self.episodes is not None:  # multi-turn: the episodes scored the rows
                out.stats.update(self.episodes.metrics(out.batch.size))
                self._score_episodes(out, self.episodes, iteration)
        if ESTIMATORS[self.ppo.advantage_estimator].needs_greedy_baseline:
            out.greedy = self.rollout(engine, prompt_ids, iteration, greedy=True)
        if self.switch:
            self.switch.release()
        out.stats.update(length_metrics(out.batch, self.tokenizer.eos_id))
        return out

    def _score_episodes(self, out: Rollout, episodes, iteration: int) -> None:
        """Multi-turn: the rows' scores and per-turn rewards are their episodes'."""
        out.scores, n_bad = self.rewards.episode_scores(episodes, iteration)
        out.turn_rewards = episodes.turn_rewards
        out.stats.update(bad_rewards=n_bad)

    def rollout(self, engine, prompt_ids: List[List[int]], iteration: int, round_: int = 0,
                greedy: bool = False, records: Optional[List[dict]] = None) -> RolloutBatch:
        """Generate N samples of every prompt (prompt-major); the noise is keyed by the global
        sample index (+ round x batch size for later rounds)."""
        N = self.ppo.n_samples_per_prompt
        rows = [p for p in prompt_ids for _ in range(N)]
        batch = self.sample(engine, rows, seed=self.cfg.seed * 100003 + iteration, greedy=self.ppo.greedy or greedy,
                            first_sample=round_ * len(rows), with_logprobs=True,
                            records=None if records is None else [r for r in records for _ in range(N)])
        if N > 1:
            batch = batch.with_outputs("generation", group_index=torch.arange(len(rows), device=batch.device) // N)
        return batch

    def sample(self, engine, rows: List[List[int]], seed: int, greedy: bool, first_sample: int = 0,
               with_logprobs: bool = False, records: Optional[List[dict]] = None) -> RolloutBatch:
        """One response to each of ``rows`` (prompt token ids, one per row) from ``engine`` at the
        run's sampling settings (``greedy``: argmax), assembled into the world's batch; the noise of
        row b is keyed by (``seed``, ``first_sample`` + b). Evaluation samples through here too."""
        from puzzle.rollout.generation import generate

        ppo = self.ppo
        B, layout, R = len(rows), engine.layout, ppo.max_new_tokens
        responses = lengths = logprobs = loss_mask = turns = out = None
        multi_turn = self.rewards.multi_turn and records is not None  # episodes of --env (env_turns.py)
        if engine.member:
            part, parts, _ = layout.generation_share()  # E > 1: an expert-parallel group generates together
            share = B // parts
            if multi_turn:
                turns = self.rewards.episodes(rows[part * share:(part + 1) * share],
                                              records[part * share:(part + 1) * share])
            params = self._sampling_params(greedy, multi_turn)
            out = generate(engine, rows[part * share:(part + 1) * share], params, seed=seed,
                           micro_batch_size=ppo.generation_micro_batch_size,
                           cuda_graphs=ppo.cuda_graph_generation, compile_graphs=ppo.compile_generation,
                           batch_invariant=ppo.batch_invariant_mode, sample_offset=first_sample + part * share,
                           progress=self.progress, turns=turns)
            responses, lengths, logprobs = out.response_tokens, out.response_lengths, out.logprobs
            if multi_turn:
                loss_mask = (~out.observation_mask).float().to(lengths.device)
        self.episodes = gather_episodes(turns, out, layout, B, self.device, R) if multi_turn else None
        return rollout_from_generation(rows, responses, lengths, layout, R, self.tokenizer.pad_id,
                                       self.device, seq_multiple=self.seq_multiple, logprobs=logprobs,
                                       with_logprobs=with_logprobs, loss_mask=loss_mask, with_loss_mask=multi_turn)

    def _sample_partial(self, engine, rows: List[List[int]], partial_tokens, partial_logprobs,
                        sample_ids: List[int], stop, records: Optional[List[dict]] = None, episodes=None):
        """--rl-partial-rollouts: one response to each row, continuing ``partial_tokens``, stopped by
        the quota ``stop`` (one generating share, P=1: the flags' check); every rank's copy of
        (responses, lengths, log-probs, finished). Multi-turn (``records`` and ``episodes``, each
        row's ``partial.EpisodeState``): each row's episode goes on (rebuilt first where it was
        loaded from a checkpoint), and a fifth item, the rows' ``partial_stage.TurnOutcome``."""
        from puzzle.dataflow.partial_stage import gather_generation, gather_turns, replay_episodes, seed_of_run
        from puzzle.rollout.generation import generate
        from puzzle.rollout.turns import TurnResume

        ppo, out, turns, resume, replayed = self.ppo, None, None, None, 0
        if engine.member:
            params = self._sampling_params(ppo.greedy, records is not None)
            if records is not None:
                if engine.layout.t == 0:  # the TP group's first rank steps the episodes (and holds their instances)
                    episodes, replayed = replay_episodes(self.rewards.episodes, rows, records, partial_tokens, episodes)
                turns = self.rewards.episodes(rows, records)
                for r, e in enumerate(episodes):
                    turns.resume(r, e)
                resume = [TurnResume(tuple(e.observation.tolist()), len(e.spans), e.turn_start) for e in episodes]
            out = generate(engine, rows, params, seed=seed_of_run(self.cfg),
                           micro_batch_size=ppo.generation_micro_batch_size,
                           batch_invariant=ppo.batch_invariant_mode, progress=self.progress, stop=stop,
                           partial_tokens=partial_tokens, partial_logprobs=partial_logprobs, sample_ids=sample_ids,
                           turns=turns, partial_turns=resume)
        gathered = gather_generation(out, engine.layout, len(rows), ppo.max_new_tokens, self.device)
        if records is None:
            return gathered
        return (*gathered, gather_turns(turns, out, engine.layout, len(rows), self.device, replayed))

    def _sampling_params(self, greedy: bool, multi_turn: bool = False):
        """The run's sampling parameters; multi-turn, a turn stop that is a stop id does not end
        the row (the row goes on after its observation)."""
        from puzzle.rollout.generation import SamplingParams

        ppo = self.ppo
        eos_ids = tuple(self.tokenizer.eos_ids)
        if multi_turn and self.rewards.continuing_ids:
            eos_ids = tuple(i for i in eos_ids if i not in self.rewards.continuing_ids)
        return SamplingParams(max_new_tokens=ppo.max_new_tokens, temperature=ppo.temperature, top_k=ppo.top_k,
                              top_p=ppo.top_p, greedy=greedy, eos_id=self.tokenizer.eos_id,
                              pad_id=self.tokenizer.pad_id, eos_ids=eos_ids)

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
        kept_scores: List[torch.Tensor] = []
        spare_scores: List[torch.Tensor] = []
        n_kept = dropped = rounds = bad = 0
        prompts, recs = prompt_ids, records
        while True:
            b = self.rollout(engine, prompts, iteration, round_=rounds)
            scores, n_bad = self.rewards.score(b, recs, iteration)
            bad += n_bad
            rounds += 1
            keep = informative_groups(self.rewards.filter_scores(b, scores), b.group_index)
            keep_idx, drop_idx = torch.nonzero(keep).flatten(), torch.nonzero(~keep).flatten()
            dropped += len(drop_idx) // N
            if len(keep_idx):
                kept.append(b.rows(keep_idx))
                kept_scores.append(scores[keep_idx])
                n_kept += len(keep_idx) // N
            if len(drop_idx):
                spare.append(b.rows(drop_idx))
                spare_scores.append(scores[drop_idx])
            if n_kept >= target or rounds >= self.ppo.max_num_gen_batches:
                break
            prompts, recs = refill() if refill is not None else (prompt_ids, records)
        batch = concat_rollouts(kept + spare, self.tokenizer.pad_id)
        first = torch.arange(target * N, device=batch.device)
        scores = torch.cat(kept_scores + spare_scores)[first]
        batch = replace(batch.rows(first), group_index=first // N)  # the groups renumbered
        return Rollout(batch, records, scores=scores, stats={"bad_rewards": bad, "filter_groups_dropped": dropped,
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
