"""Scoring a rollout's samples with the reward function across all ranks.

Each rank scores a contiguous share of the samples (in process or in its own pool, see
``runner.py``); one all-reduce gives every rank every score and which samples were bad. Bad
rewards then follow ``--on-bad-reward`` on every rank alike: ``default`` substitutes
``--bad-reward-value`` (one warning per run, naming the function, the sample and the iteration;
every bad reward is counted), ``error`` raises :class:`BadRewardError` with the same message on
every rank, so no rank is left waiting for a peer that died.
"""

from __future__ import annotations

import sys
from typing import Callable, Optional, Tuple

import torch
import torch.distributed as dist

from puzzle.parallel.device import runtime
from puzzle.parallel.scope import scope_group, scope_object_group, scope_rank, scope_size
from puzzle.reward_functions.env_runner import EnvRunner, SingleTurnEpisodes
from puzzle.reward_functions.environments import EnvSpec
from puzzle.reward_functions.loader import load_reward_fn
from puzzle.reward_functions.runner import BadRewardError, RewardScorer, Sample

ON_BAD_REWARD = ("default", "error")


class BadRewardPolicy:
    """``--on-bad-reward``: substitute ``--bad-reward-value`` (one warning per run) or raise.
    Called with the same arguments on every rank, so every rank decides alike."""

    def __init__(self, on_bad_reward: str = "default", bad_reward_value: float = 0.0):
        if on_bad_reward not in ON_BAD_REWARD:
            raise ValueError(f"on_bad_reward must be one of {ON_BAD_REWARD}, got {on_bad_reward!r}")
        self.on_bad_reward, self.bad_reward_value = on_bad_reward, float(bad_reward_value)
        self.warned = False

    def apply(self, values: torch.Tensor, bad: torch.Tensor, message: str) -> torch.Tensor:
        """``values`` with the ``bad`` entries replaced; ``message`` names the source, the first bad
        sample and the iteration."""
        if self.on_bad_reward == "error":
            raise BadRewardError(message + "; --on-bad-reward error stops the run")
        rank = dist.get_rank() if dist.is_initialized() else 0
        if not self.warned and rank == 0:
            print(f"warning: {message}; using --bad-reward-value {self.bad_reward_value:g} (further bad "
                  f"rewards are counted in the metrics as bad_rewards, without a warning)",
                  file=sys.stderr, flush=True)
        self.warned = True
        return torch.where(bad, torch.full_like(values, self.bad_reward_value), values)

    def check_scores(self, scores: torch.Tensor, source: str, iteration: int) -> Tuple[torch.Tensor, int]:
        """Non-finite entries of ``scores`` (e.g. a reward model's, identical on every rank)."""
        bad = ~torch.isfinite(scores)
        n_bad = int(bad.sum())
        if not n_bad:
            return scores, 0
        b = int(torch.nonzero(bad)[0])
        return self.apply(scores, bad, f"{source}: sample {b} of iteration {iteration} is {float(scores[b])} "
                                       f"({n_bad} bad of {scores.numel()})"), n_bad


class RolloutRewarder:
    """``env``: score every sample as a one-turn episode of that environment (``--env``; the
    single-turn wrapper over ``spec`` gives the reward function's scores bitwise), in the same
    worker pool with the same timeout."""

    def __init__(self, spec: str, *, workers: int = 0, timeout=None, on_bad_reward: str = "default",
                 bad_reward_value: float = 0.0, env: Optional[str] = None):
        self.policy = BadRewardPolicy(on_bad_reward, bad_reward_value)
        self.env_runner = None
        if env:
            self.source = f"--env {env}"
            self.env_runner = EnvRunner(EnvSpec.of(env, spec), workers, timeout)  # also runs multi-turn episodes
            self.scorer = SingleTurnEpisodes(self.env_runner)
        else:
            self.source = f"--reward-fn {spec}"
            self.scorer = RewardScorer(load_reward_fn(spec), workers, timeout)

    @staticmethod
    def share(size: int) -> Tuple[int, int]:
        """The rows ``lo .. hi - 1`` of ``size`` that this rank scores (contiguous, in rank order)."""
        on = dist.is_initialized()
        rank, world = (scope_rank(), scope_size()) if on else (0, 1)  # the world, or one pool
        per = -(-size // world)
        return min(rank * per, size), min((rank + 1) * per, size)

    def score(self, make_sample: Callable[[int], Sample], size: int, iteration: int,
              what: str = "sample") -> Tuple[torch.Tensor, int]:
        """Scores ``[size]`` float32 (bad ones replaced) and the number of bad ones, on every rank.

        ``make_sample(b)`` builds sample ``b`` (called only for this rank's share, ``share``)."""
        on = dist.is_initialized()
        rank, world = (scope_rank(), scope_size()) if on else (0, 1)  # the world, or one pool
        lo, hi = self.share(size)
        results = self.scorer.score([make_sample(b) for b in range(lo, hi)])
        rt = runtime()
        buf = torch.zeros(2, size, dtype=torch.float64)  # values, bad flags
        first_bad = None
        for b, (value, why) in zip(range(lo, hi), results):
            if why is None:
                buf[0, b] = value
            else:
                buf[1, b] = 1.0
                first_bad = first_bad or (b, why)
        if on and world > 1:
            buf = buf.to(rt.device)
            dist.all_reduce(buf, group=scope_group())
            buf = buf.cpu()
        bad = buf[1] > 0
        n_bad = int(bad.sum())
        if n_bad:
            found = [None] * world
            if on and world > 1:
                dist.all_gather_object(found, first_bad, group=scope_object_group(rt.object_group))
            else:
                found = [first_bad]
            b, why = min(f for f in found if f is not None)
            message = (f"{self.source}: {what} {b} of iteration {iteration} {why} "
                       f"({n_bad} bad of {size})")
            buf[0] = self.policy.apply(buf[0], bad, message)
        return buf[0].float().to(rt.device), n_bad

    def close(self) -> None:
        self.scorer.close()
