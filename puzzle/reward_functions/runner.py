"""Scoring samples with a reward function in this process: value checks, per-sample timeouts and
an optional process pool (``--reward-workers``). No torch.distributed here (see ``distributed.py``).

Every sample comes back as ``(value, None)`` or ``(None, reason)``: a value that is not a real
number (a string such as ``"0.5"`` is refused, not parsed), NaN, inf, an exception or a timeout
gives a reason, and the caller applies ``--on-bad-reward``.

Timeouts: with ``workers == 0`` each call runs in a daemon thread that is abandoned when it runs
past the timeout (a function that never returns keeps its thread; use workers for those); with
workers, calls run in ``spawn`` processes and a pool with a timed-out call is terminated and
replaced. A per-sample function is timed per sample; a batched one gets ``timeout x samples``.
"""

from __future__ import annotations

import math
import multiprocessing
import numbers
import threading
from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence, Tuple

from puzzle.reward_functions.loader import RewardFunction, load_reward_fn

Result = Tuple[Optional[float], Optional[str]]


class BadRewardError(RuntimeError):
    """A bad reward under ``--on-bad-reward error`` (raised on every rank with the same message)."""


@dataclass
class Sample:
    index: int                 # the sample's index in the rollout batch
    prompt_text: str
    response_text: str         # EOS removed
    prompt_ids: List[int]
    response_ids: List[int]    # EOS removed
    record: dict = field(default_factory=dict)  # the dataset record's other fields


def check_value(v: Any) -> Result:
    """``(float, None)`` for a finite real number (bools count as 0/1, 0-d arrays/tensors are
    unwrapped), else ``(None, why)``."""
    if not isinstance(v, numbers.Real) and hasattr(v, "item") and getattr(v, "shape", None) == ():
        v = v.item()  # 0-d numpy arrays and torch tensors
    if not isinstance(v, numbers.Real):
        return None, f"returned {type(v).__name__} {v!r:.40}, not a number"
    x = float(v)
    if not math.isfinite(x):
        return None, f"returned {x}"
    return x, None


def _raised(e: BaseException) -> str:
    return f"raised {type(e).__name__}: {e}"[:300]


def call_chunk(reward: RewardFunction, samples: Sequence[Sample]) -> List[Result]:
    """Call ``reward`` on ``samples`` here and now (no timeout); never raises."""
    n = len(samples)
    if not reward.batched:
        out = []
        for s in samples:
            try:
                out.append(check_value(reward.fn(s.prompt_text, s.response_text, s.prompt_ids, s.response_ids)))
            except Exception as e:
                out.append((None, _raised(e)))
        return out
    try:
        values = reward.fn([s.prompt_text for s in samples], [s.response_text for s in samples],
                           [s.record for s in samples])
        values = list(values)
    except Exception as e:
        return [(None, _raised(e))] * n
    if len(values) != n:
        return [(None, f"returned {len(values)} values for {n} samples")] * n
    return [check_value(v) for v in values]


def _call_in_thread(reward: RewardFunction, samples: Sequence[Sample], timeout: float) -> List[Result]:
    box: dict = {}

    def run():
        box["out"] = call_chunk(reward, samples)

    th = threading.Thread(target=run, daemon=True, name="reward-fn")
    th.start()
    th.join(timeout)
    if th.is_alive() or "out" not in box:
        return [(None, f"timed out after {timeout:g} s")] * len(samples)
    return box["out"]


# ---- process pool ---------------------------------------------------------------------------------
_WORKER_FN: Optional[RewardFunction] = None  # set in each pool worker process by its initializer only


def _init_worker(spec: str) -> None:
    global _WORKER_FN
    _WORKER_FN = load_reward_fn(spec)


def _worker_call(samples: Sequence[Sample]) -> List[Result]:
    return call_chunk(_WORKER_FN, samples)


class RewardScorer:
    """Scores samples with one reward function: in process (``workers=0``) or in a pool."""

    def __init__(self, reward: RewardFunction, workers: int = 0, timeout: Optional[float] = None):
        if workers < 0:
            raise ValueError(f"workers must be >= 0, got {workers}")
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout must be > 0 or None, got {timeout}")
        self.reward, self.workers, self.timeout = reward, workers, timeout
        self._pool = None

    def _chunks(self, samples: Sequence[Sample]) -> List[Sequence[Sample]]:
        if not self.reward.batched:
            return [[s] for s in samples]
        k = max(1, min(self.workers or 1, len(samples)))
        size = -(-len(samples) // k)
        return [samples[i:i + size] for i in range(0, len(samples), size)]

    def score(self, samples: Sequence[Sample]) -> List[Result]:
        if not samples:
            return []
        if self.workers == 0:
            if self.timeout is None:
                return call_chunk(self.reward, samples)
            return [r for c in self._chunks(samples) for r in _call_in_thread(self.reward, c, self.timeout * len(c))]
        out: List[Result] = []
        chunks = self._chunks(samples)
        for w in range(0, len(chunks), self.workers):  # waves: every call of a wave starts at once
            wave = chunks[w:w + self.workers]
            if self._pool is None:
                self._pool = multiprocessing.get_context("spawn").Pool(
                    self.workers, initializer=_init_worker, initargs=(self.reward.spec,))
            pending = [self._pool.apply_async(_worker_call, (list(c),)) for c in wave]
            stuck = False
            for c, p in zip(wave, pending):
                limit = None if self.timeout is None else self.timeout * len(c)
                try:
                    out += p.get(timeout=limit)
                except multiprocessing.TimeoutError:
                    stuck = True
                    out += [(None, f"timed out after {limit:g} s")] * len(c)
                except Exception as e:  # e.g. a result that cannot be pickled back
                    out += [(None, _raised(e))] * len(c)
            if stuck:
                self.close()
        return out

    def close(self) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
            self._pool = None


def score_samples(reward: RewardFunction, samples: Sequence[Sample], workers: int = 0,
                  timeout: Optional[float] = None) -> List[Result]:
    """One-shot :class:`RewardScorer` (tests, tools)."""
    scorer = RewardScorer(reward, workers, timeout)
    try:
        return scorer.score(samples)
    finally:
        scorer.close()
