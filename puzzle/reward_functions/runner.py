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
from typing import Any, Callable, List, Optional, Sequence, Tuple

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
def _worker_main(conn, spec: str, load: Callable = load_reward_fn, call: Callable = None) -> None:
    """A worker process: ``load(spec)`` the function, then answer (samples, one_per_call) messages
    until EOF: one ("sample", i, result) message per sample as each call ends (one_per_call), else
    one ("call", None, results) for the whole batched call. ``call(loaded, items) -> results``
    (default :func:`call_chunk`) makes the calls: the environments' steps use the same pool."""
    call = call or call_chunk
    try:
        reward = load(spec)
    except Exception as e:
        conn.send(("failed", None, _raised(e)))
        return
    conn.send(("ready", None, None))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        samples, one_per_call = msg
        if one_per_call:
            for i, sample in enumerate(samples):
                conn.send(("sample", i, call(reward, [sample])[0]))
        else:
            conn.send(("call", None, call(reward, samples)))


class _Worker:
    """One spawn process running the reward function; ``kill()`` ends it whatever it is doing.
    ``task``: the sample indices of the work it holds, ``done``: how many of them have come back,
    ``deadline``: when the call in progress (the sample ``task[done]``, or the batched call) ends."""

    def __init__(self, ctx, spec: str, load: Callable = load_reward_fn, call: Optional[Callable] = None):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, spec, load, call), daemon=True, name="reward-fn")
        self.proc.start()
        child.close()
        self.ready = False
        self.task: Optional[List[int]] = None
        self.done = 0
        self.deadline: Optional[float] = None

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join()
        self.conn.close()


class RewardScorer:
    """Scores samples with one reward function, in process or in worker processes (see the module
    docstring); the workers are started on first use and kept until ``close()``.

    ``load``/``call`` (module-level functions, so that spawn can pickle them): what a worker loads
    from ``reward.spec`` and how it calls it (the environments' steps run through this same pool,
    ``environments.py``); ``reward`` then needs only ``spec`` and ``one_sample_per_call``."""

    def __init__(self, reward: RewardFunction, workers: int = 0, timeout: Optional[float] = None,
                 load: Callable = load_reward_fn, call: Callable = call_chunk):
        if workers < 0:
            raise ValueError(f"workers must be >= 0, got {workers}")
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout must be > 0 or None, got {timeout}")
        self.reward, self.workers, self.timeout = reward, workers, timeout
        self.load, self.call = load, call
        self.processes = max(1, workers) if (workers or timeout is not None) else 0
        self._pool: List[_Worker] = []
        self._ctx = multiprocessing.get_context("spawn")

    def score(self, samples: Sequence[Sample]) -> List[Result]:
        if not samples:
            return []
        if not self.processes:
            return self.call(self.reward, samples)
        k = max(1, min(self.processes, len(samples)))  # one share per worker
        size = -(-len(samples) // k)
        todo = deque(list(range(i, min(i + size, len(samples)))) for i in range(0, len(samples), size))
        results: List[Optional[Result]] = [None] * len(samples)
        _Run(self, samples, results, todo).run()
        return results

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


class _Run:
    """One ``score()`` through the scorer's workers: shares handed to idle workers, results as
    they come, a worker past its deadline killed (its call's samples bad, the rest of its share
    handed out again)."""

    def __init__(self, scorer: RewardScorer, samples, results, todo):
        self.scorer, self.samples, self.results, self.todo = scorer, samples, results, todo
        self.one_per_call = scorer.reward.one_sample_per_call

    def _call_limit(self, w: _Worker) -> Optional[float]:
        t = self.scorer.timeout
        return None if t is None else t * (1 if self.one_per_call else len(w.task))

    def run(self) -> None:
        pool = self.scorer._pool
        while self.todo or any(w.task is not None for w in pool):
            for w in pool:
                if w.task is None and not w.proc.is_alive():  # killed, or died while idle
                    w.kill()
            pool[:] = [w for w in pool if w.proc.is_alive() or w.task is not None]
            while len(pool) < self.scorer.processes:
                pool.append(_Worker(self.scorer._ctx, self.scorer.reward.spec, self.scorer.load, self.scorer.call))
            for w in pool:
                if self.todo and w.ready and w.task is None:
                    self._hand_out(w)
            deadlines = [w.deadline for w in pool if w.task is not None and w.deadline is not None]
            wait_s = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
            live = [w.conn for w in pool if not w.conn.closed]
            if live:
                for conn in wait(live, timeout=wait_s):
                    self._receive(next(w for w in pool if w.conn is conn))
            now = time.monotonic()
            for w in pool:
                if w.task is not None and w.deadline is not None and now >= w.deadline:
                    self._end_call(w, f"timed out after {self._call_limit(w):g} s (its process was killed)")

    def _hand_out(self, w: _Worker) -> None:
        share = self.todo.popleft()
        try:
            w.conn.send(([self.samples[i] for i in share], self.one_per_call))
        except OSError:  # it died since its last call: the share goes to another worker
            self.todo.appendleft(share)
            w.kill()
            return
        w.task, w.done = share, 0
        limit = self._call_limit(w)
        w.deadline = None if limit is None else time.monotonic() + limit

    def _end_call(self, w: _Worker, why: str) -> None:
        """The call in progress failed (timeout, or the process died): its samples are bad, the
        worker is killed, the rest of a per-sample share goes back to the queue."""
        failed = w.task[w.done:w.done + 1] if self.one_per_call else w.task[w.done:]
        for i in failed:
            self.results[i] = (None, why)
        rest = w.task[w.done + len(failed):]
        if rest:
            self.todo.appendleft(rest)
        w.task, w.deadline = None, None
        w.kill()

    def _receive(self, w: _Worker) -> None:
        try:
            kind, i, payload = w.conn.recv()
        except (EOFError, OSError):
            w.kill()
            why = f"failed: its reward process died (exit code {w.proc.exitcode})"
            if w.task is not None:
                self._end_call(w, why)
            elif not w.ready:  # died while starting: every call would fail alike
                self._fail_all(why)
            return
        if kind == "ready":
            w.ready = True
        elif kind == "failed":
            w.kill()
            self._fail_all(f"failed: its reward process could not load it ({payload})")
        elif kind == "call":  # a batched call's results
            for j, r in zip(w.task, payload):
                self.results[j] = r
            w.task, w.deadline = None, None
        else:  # one sample's result: the next sample's call starts now
            self.results[w.task[i]] = payload
            w.done = i + 1
            if w.done == len(w.task):
                w.task, w.deadline = None, None
            else:
                w.deadline = time.monotonic() + self.scorer.timeout if self.scorer.timeout is not None else None

    def _fail_all(self, why: str) -> None:
        while self.todo:
            for i in self.todo.popleft():
                self.results[i] = (None, why)


def score_samples(reward: RewardFunction, samples: Sequence[Sample], workers: int = 0,
                  timeout: Optional[float] = None) -> List[Result]:
    """One-shot :class:`RewardScorer` (tests, tools)."""
    scorer = RewardScorer(reward, workers, timeout)
    try:
        return scorer.score(samples)
    finally:
        scorer.close()
