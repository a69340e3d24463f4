"""Environment steps through the reward worker pool, counted; and the single-turn reward path
through environments (``--env single_turn``: today's ``--reward-fn`` as an episode of one turn).

A step's fault (it raised, timed out, returned garbage: ``environments.check_step``) never stops
the run: the caller gets ``(None, why)`` and it is counted in ``stats`` (``env_step_errors``,
of them ``env_step_timeouts``); ``error_observation(why)`` is the text a multi-turn sample shows.
"""

from __future__ import annotations

from collections import Counter
from typing import List, Optional, Sequence

from puzzle.reward_functions.environments import (EnvCall, EnvFactory, EnvOutcome, EnvSpec, Turn, call_steps,
                                                   load_env_factory)
from puzzle.reward_functions.runner import Result, RewardScorer, Sample


def error_observation(why: str) -> str:
    """What the model sees after a step that failed."""
    return f"[error: the environment step {why}]"


class EnvRunner:
    """Runs steps of many episodes, each under ``timeout`` seconds in ``max(1, workers)`` worker
    processes (none without a timeout and workers: in the rank's process, like the reward
    function); ``stats`` counts steps, faults and timeouts over the run."""

    def __init__(self, spec: EnvSpec, workers: int = 0, timeout: Optional[float] = None):
        self.spec = spec
        self.pool = RewardScorer(EnvFactory(spec), workers, timeout, load=load_env_factory, call=call_steps)
        self.stats: Counter = Counter()

    @property
    def in_workers(self) -> bool:
        """Whether the steps run in worker processes (the caller may then wait on them from a
        background thread while it works; in-process steps run in the caller's thread)."""
        return self.pool.processes > 0

    def step(self, calls: Sequence[EnvCall]) -> List[Result]:
        """``(EnvOutcome, None)`` or ``(None, why)`` for each call, in order."""
        results = self.pool.score(list(calls))
        self.stats["env_steps"] += len(results)
        for outcome, why in results:
            if why is not None:
                self.stats["env_step_errors"] += 1
                self.stats["env_step_timeouts"] += "timed out" in why
        return results

    def close(self) -> None:
        self.pool.close()


class SingleTurnEpisodes:
    """A reward scorer (``RewardScorer.score``'s contract) whose every sample is a one-turn
    episode of an environment: the response is the turn, the episode's reward its score; an
    episode without a reward, or a failed step, is a bad reward with the reason."""

    def __init__(self, runner: EnvRunner):
        self.runner = runner

    def score(self, samples: Sequence[Sample]) -> List[Result]:
        calls = [EnvCall(s.index, s.record, Turn(s.response_text, list(s.response_ids), 0, s.prompt_text,
                                                 list(s.prompt_ids))) for s in samples]
        out: List[Result] = []
        for outcome, why in self.runner.step(calls):
            if why is not None:
                out.append((None, why))
            elif outcome.step.reward is None:
                out.append((None, "ended its turn without a reward"))
            else:
                out.append((outcome.step.reward, None))
        return out

    def close(self) -> None:
        self.runner.close()


__all__ = ["EnvOutcome", "EnvRunner", "SingleTurnEpisodes", "error_observation"]
