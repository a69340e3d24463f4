"""A rollout's sequence scores, owned by one object: ``Rewards``.

It is the only source of the batch's ``scores`` (the raw score of every row, bad values already
replaced or refused by ``--on-bad-reward``; the trainer puts them in the batch, in one place) and the only place where scores are shaped for the
advantages (DAPO's overlong penalty, ``--reward-normalization running``). A score comes from

- the reward function (``--reward-fn``): ``score`` decodes this rank's share of the rows to text,
  once, and scores it across ranks (``RolloutRewarder``), or
- the reward model (``--reward-model``): its forward pass runs in the scoring stage, which hands
  the scores to ``check_model_scores`` to be checked like a function's.

DAPO's group filter (``filter_scores``) and ReMax's greedy baseline read the same shaping. The
state (the running moments of the normalisation) is checkpointed with the trainer.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from puzzle.algorithms.advantage_estimators import group_mean_std
from puzzle.algorithms.dapo import overlong_penalty
from puzzle.algorithms.token_rewards import fold_moments, normalize_scores, running_std
from puzzle.dataflow.env_turns import EpisodeTurns
from puzzle.reward_functions.distributed import BadRewardPolicy, RolloutRewarder
from puzzle.reward_functions.environments import EnvSpec, turn_stop_strings
from puzzle.reward_functions.tool_formats import tool_format_of
from puzzle.reward_functions.runner import Sample


def decode_rows(tokens: torch.Tensor, prompt_lengths: List[int], response_lengths: List[int],
                tokenizer, records: List[dict], first: int = 0) -> List[Sample]:
    """Rows ``first .. first + len(tokens) - 1`` of a rollout as reward-function Samples: their
    [n, S] right-padded ``tokens`` (on the host) split at the prompt, the EOS left out of the
    response text; ``records[i]`` is row ``first + i``'s dataset record."""
    out = []
    for i, (p, r) in enumerate(zip(prompt_lengths, response_lengths)):
        row = tokens[i].tolist()
        pids, rids = row[:p], [t for t in row[p:p + r] if t != tokenizer.eos_id]
        out.append(Sample(index=first + i, prompt_text=tokenizer.decode(pids), response_text=tokenizer.decode(rids),
                          prompt_ids=pids, response_ids=rids, record=records[i]))
    return out


def batch_samples(batch, tokenizer, records: List[dict], lo: int, hi: int) -> List[Sample]:
    """Rows ``lo .. hi - 1`` of ``batch`` decoded (only those rows leave the device);
    ``records[b]`` is row b's record."""
    return decode_rows(batch.tokens[lo:hi].cpu(), batch.prompt_lengths[lo:hi].tolist(),
                       batch.response_lengths[lo:hi].tolist(), tokenizer, records[lo:hi], first=lo)


class RunningMoments:
    """Running mean/std of reward-model scores (--reward-normalization running; the math is
    ``puzzle.algorithms.token_rewards.fold_moments``), checkpointed with the trainer.

    Usage per PPO step (gather scores across data-parallel ranks first, so every rank
    sees the same statistics)::

        scores = moments.normalize(scores)   # updates with this batch, then normalises

    Before any update ``mean=0, std=1``; ``std`` is the unbiased std of everything seen
    (1.0 while fewer than 2 scores were seen).  Statistics are kept in float64.
    """

    def __init__(self, eps: float = 1e-8):
        self.eps = eps
        self.mean = 0.0
        self.m2 = 0.0  # sum of squared deviations from the running mean
        self.count = 0

    @property
    def std(self) -> float:
        return running_std(self.m2, self.count)

    def update(self, scores: torch.Tensor) -> Tuple[float, float]:
        """Fold a batch ``[N]`` of scores in. Returns ``(batch_mean, batch_std)`` (unbiased std)."""
        self.mean, self.m2, self.count, b_mean, b_std = fold_moments(self.mean, self.m2, self.count, scores)
        return b_mean, b_std

    def normalize(self, scores: torch.Tensor, update: bool = True) -> torch.Tensor:
        """Optionally :meth:`update` with ``scores``, then return them normalised. While every score
        seen was equal (std 0) only the mean is subtracted: dividing by eps would blow up the
        first different score."""
        if update:
            self.update(scores)
        std = self.std
        return normalize_scores(scores, self.mean, std if std > 1e-6 else 1.0, self.eps)

    def state_dict(self) -> dict:
        return {"mean": self.mean, "m2": self.m2, "count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.mean = float(state["mean"])
        self.m2 = float(state["m2"])
        self.count = int(state["count"])


class Rewards:
    """Scores, checks and shapes the sequence scores of every rollout of a run (identical on
    every rank: every call is collective)."""

    def __init__(self, cfg, tokenizer):
        ppo = cfg.ppo
        self.tokenizer, self.n_samples = tokenizer, ppo.n_samples_per_prompt
        self.function: Optional[RolloutRewarder] = None
        if cfg.reward_fn or cfg.env:
            self.function = RolloutRewarder(cfg.reward_fn, workers=cfg.reward_workers, timeout=cfg.reward_timeout,
                                            on_bad_reward=cfg.on_bad_reward, bad_reward_value=cfg.bad_reward_value,
                                            env=cfg.env)
        self.policy = self.function.policy if self.function else BadRewardPolicy(cfg.on_bad_reward,
                                                                                cfg.bad_reward_value)
        self.env, self.max_turns, self.max_observation_tokens = cfg.env, cfg.max_turns, cfg.max_observation_tokens
        self.overlap_calls = cfg.env_step_overlap_calls
        self.multi_turn = bool(cfg.env) and cfg.max_turns > 1  # episodes run in the decode loop
        self.tool_format = tool_format_of(tokenizer) if self.multi_turn and cfg.apply_chat_template else None
        self.turn_stops = [tokenizer.encode(s) for s in turn_stop_strings(EnvSpec.of(cfg.env, cfg.reward_fn),
                                                                          self.tool_format)] if self.multi_turn else []
        # a turn stop that is one of the tokenizer's stop ids (Llama-3.1's <|eom_id|>) continues the row
        self.continuing_ids = {s[0] for s in self.turn_stops if len(s) == 1 and s[0] in tokenizer.eos_ids}
        self.model_name = cfg.reward_model
        self.max_new_tokens = ppo.max_new_tokens
        self.overlong = (ppo.overlong_buffer_len, ppo.overlong_penalty_factor)
        self.normalization = ppo.reward_normalization
        self.norm = RunningMoments()  # --reward-normalization running (checkpointed)

    # ---- the raw scores ----------------------------------------------------------------------
    def score_rollout(self, rollout, iteration: int) -> Tuple[Dict[str, torch.Tensor], dict]:
        """The reward function's scores of a generation stage's ``Rollout`` (rows that DAPO's
        filter scored keep those, ``rollout.scores``) and ReMax's shaped greedy baseline: (the
        batch's ``reward`` fields, the bad rewards of the iteration so far). Without a reward
        function (a reward model scores in the scoring stage): nothing."""
        if self.function is None:
            return {}, {}
        batch, bad = rollout.batch, rollout.stats.get("bad_rewards", 0)
        scores = rollout.scores
        if scores is None:
            scores, n = self.score(batch, rollout.records, iteration)
            bad += n
        out = {"scores": scores}
        if getattr(rollout, "turn_rewards", None) is not None:  # multi-turn: each step's reward at its turn
            out["turn_rewards"] = rollout.turn_rewards
        if rollout.greedy is not None:  # its bad rewards are warned about, not counted
            out["baseline_scores"] = self.score_baseline(rollout.greedy, rollout.records, iteration)[0]
        return out, {"bad_rewards": bad}

    def score(self, batch, records: Optional[List[dict]], iteration: int,
              what: str = "sample") -> Tuple[torch.Tensor, int]:
        """The reward function's scores of every row of ``batch`` (``records``: one per prompt, row
        b is of prompt b // N, or None) on the batch's device, and how many were bad."""
        size = batch.size
        rows = [records[b // self.n_samples] if records is not None else {} for b in range(size)]
        scores, bad = self.function_scores(batch, rows, size, iteration, what)
        return scores.to(batch.device), bad

    def function_scores(self, batch, row_records: List[dict], size: int, iteration: int,
                        what: str = "sample") -> Tuple[torch.Tensor, int]:
        """The reward function's scores of the first ``size`` rows (``row_records[b]``: row b's
        record; the ranks share the rows) and how many were bad, on every rank. Nothing is kept:
        evaluation scores its rows through here."""
        lo, hi = self.function.share(size)
        samples = batch_samples(batch, self.tokenizer, row_records, lo, hi)
        return self.function.score(lambda b: samples[b - lo], size, iteration, what)

    def score_baseline(self, greedy, records: List[dict], iteration: int) -> Tuple[torch.Tensor, int]:
        """ReMax: the greedy sample of every prompt scored and shaped (normalised with the batch's
        scores in ``shaped``), and how many were bad."""
        scores, bad = self.score(greedy, records, iteration, what="greedy baseline sample")
        return self._overlong(scores, greedy.response_lengths), bad

    def check_model_scores(self, scores: torch.Tensor, iteration: int, what: str = "") -> Tuple[torch.Tensor, int]:
        """The reward model's scores with non-finite ones replaced or refused (``--on-bad-reward``),
        and how many were bad; ``what`` is added to the model's name in the message."""
        return self.policy.check_scores(scores, f"reward model {self.model_name}{what}", iteration)

    # ---- multi-turn episodes (--max-turns > 1) ---------------------------------------------
    def episodes(self, prompts: List[List[int]], records: List[dict]) -> EpisodeTurns:
        """The episodes of one generation's rows: the decode loop's turn handler."""
        return EpisodeTurns(self.function.env_runner, self.tokenizer, prompts, records, self.max_turns,
                            self.max_observation_tokens, self.turn_stops, self.tool_format, self.overlap_calls)

    def episode_scores(self, results, iteration: int) -> Tuple[torch.Tensor, int]:
        """The episodes' scores (``env_turns.EpisodeResults``, on every rank) with the bad ones
        replaced or refused (``--on-bad-reward``), and how many were bad."""
        n_bad = int(results.bad.sum())
        if not n_bad:
            return results.scores, 0
        b = int(torch.nonzero(results.bad)[0])
        message = (f"--env {self.env}: the episode of sample {b} of iteration {iteration} ended in a failed step "
                   f"without a reward ({n_bad} bad of {results.bad.numel()})")
        return self.policy.apply(results.scores, results.bad.to(results.scores.device), message), n_bad

    # ---- shaping -----------------------------------------------------------------------------
    def _overlong(self, scores: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """DAPO's overlong penalty added to the scores (--overlong-buffer-len)."""
        buffer_len, factor = self.overlong
        if not buffer_len:
            return scores
        return scores + overlong_penalty(lengths, self.max_new_tokens, buffer_len, factor)

    def filter_scores(self, batch, scores: Optional[torch.Tensor] = None) -> torch.Tensor:
        """What DAPO's group filter compares: the scores (``batch.scores`` unless given) with the
        overlong penalty."""
        return self._overlong(batch.scores if scores is None else scores, batch.response_lengths)

    def shaped(self, batch) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The scores the advantages read, and ReMax's baseline: overlong penalty, then the
        running normalisation (updated once per call, with these scores)."""
        scores = self._overlong(batch.scores, batch.response_lengths)
        baseline = batch.baseline_scores
        if self.normalization == "running":
            scores = self.norm.normalize(scores).float()
            baseline = None if baseline is None else self.norm.normalize(baseline, update=False).float()
        return scores, baseline

    # ---- metrics -----------------------------------------------------------------------------
    def metrics(self, batch) -> Dict[str, float]:
        """The raw scores' mean and spread (overall and within groups), the solved fraction
        (score >= 1: a verifiable reward's "correct") and the normaliser's moments."""
        scores = batch.scores.to(torch.float64)
        out = {"reward_mean": float(batch.scores.mean())}
        if self.normalization == "running":
            out.update(reward_norm_mean=self.norm.mean, reward_norm_std=self.norm.std)
        out.update({"reward_std": float(scores.std()) if scores.numel() > 1 else 0.0,
                    "solved_fraction": float((scores >= 1.0).to(torch.float64).mean())})
        N = self.n_samples
        if N > 1 and batch.group_index is not None:
            _, std, _ = group_mean_std(scores, batch.group_index)
            out["reward_group_std_mean"] = float(std.mean())
            out["groups_all_solved"] = int(((scores >= 1.0).view(-1, N).all(dim=1)).sum())
            out["groups_none_solved"] = int(((scores < 1.0).view(-1, N).all(dim=1)).sum())
        return out

    # ---- checkpointed state ------------------------------------------------------------------
    def state_dict(self) -> dict:
        return self.norm.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.norm.load_state_dict(state)

    def close(self) -> None:
        if self.function is not None:
            self.function.close()
