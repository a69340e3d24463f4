"""Scoring samples with a reward function: value checks, timeouts and worker processes
(``--reward-workers``). No torch.distributed here (see ``distributed.py``).

Every sample comes back as ``(value, None)`` or ``(None, reason)``: a value that is not a real
number (a string such as ``"0.5"`` is refused, not parsed), NaN, inf, an exception, a timeout or a
worker process that died gives a reason, and the caller applies ``--on-bad-reward``.

Calls: a per-sample function, and a batched one marked :func:`~puzzle.reward_functions.loader.per_sample`
(the built-in checkers), is called one sample at a time, each call under ``timeout`` seconds: a
stuck response costs ``timeout`` seconds and one bad reward. Any other batched function is called
on chunks of samples (one per worker), each call under ``timeout x its samples``: the timeout is
per call, and a call that runs past it makes all its samples bad.

Timeouts kill: with a timeout (or ``workers > 0``) every call runs in a ``spawn`` worker process
(``max(1, workers)`` of them, started once and kept); a call that runs past its deadline has its
process killed and replaced while the other workers go on. Without a timeout and without workers
the function runs in the caller's process.
"""

from __future__ import annotations

import math
import multiprocessing
import numbers
import time
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import wait
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


# ---- worker processes -----------------------------------------------------------------------------
def _worker_main(conn, spec: str) -> None:
    """A worker process: load the function, then answer (task, samples) messages until EOF."""
    try:
        reward = load_reward_fn(spec)
    except Exception as e:
        conn.send(("failed", _raised(e)))
        return
    conn.send(("ready", None))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        task, samples = msg
        conn.send((task, call_chunk(reward, samples)))


class _Worker:
    """One spawn process running the reward function; ``kill()`` ends it whatever it is doing."""

    def __init__(self, ctx, spec: str):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, spec), daemon=True, name="reward-fn")
        self.proc.start()
        child.close()
        self.ready = False
        self.task: Optional[int] = None
        self.deadline: Optional[float] = None

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join()
        self.conn.close()

    def died(self) -> str:
        self.kill()
        return f"failed: its reward process died (exit code {self.proc.exitcode})"


class RewardScorer:
    """Scores samples with one reward function, in process or in worker processes (see the module
    docstring); the workers are started on first use and kept until ``close()``."""

    def __init__(self, reward: RewardFunction, workers: int = 0, timeout: Optional[float] = None):
        if workers < 0:
            raise ValueError(f"workers must be >= 0, got {workers}")
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout must be > 0 or None, got {timeout}")
        self.reward, self.workers, self.timeout = reward, workers, timeout
        self.processes = max(1, workers) if (workers or timeout is not None) else 0
        self._pool: List[_Worker] = []
        self._ctx = multiprocessing.get_context("spawn")

    def _chunks(self, samples: Sequence[Sample]) -> List[Sequence[Sample]]:
        """One sample per call (per-sample functions), else one chunk per worker."""
        if self.reward.one_sample_per_call:
            return [[s] for s in samples]
        k = max(1, min(self.workers or 1, len(samples)))
        size = -(-len(samples) // k)
        return [samples[i:i + size] for i in range(0, len(samples), size)]

    def score(self, samples: Sequence[Sample]) -> List[Result]:
        if not samples:
            return []
        if not self.processes:
            return call_chunk(self.reward, samples)
        chunks = self._chunks(samples)
        results = self._run(chunks)
        return [r for chunk_results in results for r in chunk_results]

    def _run(self, chunks: List[Sequence[Sample]]) -> List[List[Result]]:
        """Every chunk through the workers; a worker past its call's deadline is killed."""
        results: List[Optional[List[Result]]] = [None] * len(chunks)
        todo = deque(range(len(chunks)))
        while todo or any(w.task is not None for w in self._pool):
            for w in self._pool:
                if w.task is None and not w.proc.is_alive():  # killed, or died while idle
                    w.kill()
            self._pool = [w for w in self._pool if w.proc.is_alive() or w.task is not None]
            while len(self._pool) < self.processes:
                self._pool.append(_Worker(self._ctx, self.reward.spec))
            for w in self._pool:  # hand out work to the idle, started workers
                if todo and w.ready and w.task is None:
                    task = todo.popleft()
                    limit = None if self.timeout is None else self.timeout * len(chunks[task])
                    try:
                        w.conn.send((task, list(chunks[task])))
                    except OSError:  # it died since its last call: the call goes to another worker
                        todo.appendleft(task)
                        w.kill()
                        continue
                    w.task, w.deadline = task, None if limit is None else time.monotonic() + limit
            deadlines = [w.deadline for w in self._pool if w.task is not None and w.deadline is not None]
            wait_s = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
            live = [w.conn for w in self._pool if not w.conn.closed]
            if not live:
                continue  # every worker just died: the loop starts new ones
            for conn in wait(live, timeout=wait_s):
                self._receive(next(w for w in self._pool if w.conn is conn), chunks, results, todo)
            now = time.monotonic()
            for w in self._pool:
                if w.task is not None and w.deadline is not None and now >= w.deadline:
                    limit = self.timeout * len(chunks[w.task])
                    why = f"timed out after {limit:g} s (its process was killed)"
                    results[w.task] = [(None, why)] * len(chunks[w.task])
                    w.task = None
                    w.kill()
        return results

    def _receive(self, w: _Worker, chunks, results, todo) -> None:
        try:
            tag, payload = w.conn.recv()
        except (EOFError, OSError):
            why = w.died()
            if w.task is not None:
                results[w.task] = [(None, why)] * len(chunks[w.task])
                w.task = None
            elif not w.ready:  # died while starting: every call would fail alike
                self._fail_all(why, chunks, results, todo)
            return
        if tag == "ready":
            w.ready = True
        elif tag == "failed":
            w.kill()
            self._fail_all(f"failed: its reward process could not load it ({payload})", chunks, results, todo)
        else:
            results[tag] = payload
            w.task, w.deadline = None, None

    @staticmethod
    def _fail_all(why: str, chunks, results, todo) -> None:
        while todo:
            i = todo.popleft()
            results[i] = [(None, why)] * len(chunks[i])

    def close(self) -> None:
        for w in self._pool:
            try:
                w.conn.send(None)
            except OSError:
                pass
        deadline = time.monotonic() + 1.0
        for w in self._pool:
            w.proc.join(max(0.0, deadline - time.monotonic()))
            w.kill()
        self._pool = []


def score_samples(reward: RewardFunction, samples: Sequence[Sample], workers: int = 0,
                  timeout: Optional[float] = None) -> List[Result]:
    """One-shot :class:`RewardScorer` (tests, tools)."""
    scorer = RewardScorer(reward, workers, timeout)
    try:
        return scorer.score(samples)
    finally:
        scorer.close()
