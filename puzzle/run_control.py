"""Run control around the iteration loop: when to stop early, and what a stuck rank was doing.

``ExitControl`` implements Megatron-LM's ``--exit-signal-handler``, ``--exit-duration-in-mins``
and ``--exit-interval``: after every iteration all ranks agree (one small all-reduce, only when
a signal handler or a duration is set) whether to save and exit, so every rank stops after the
same iteration. SIGTERM only sets a flag; the iteration in progress finishes.

``Progress`` records, per rank, the iteration and phase it reached in the job's rendezvous store
(the store lives in the launcher, so it answers even when a worker is stopped). When a collective
times out (``--distributed-timeout-minutes``), ``describe_timeout`` names the ranks that are
behind this one and where they were last seen.
"""

from __future__ import annotations

import datetime
import os
import signal
import sys
import time
from typing import Optional

import torch.distributed as dist

from puzzle.parallel.device import runtime


class ExitControl:
    def __init__(self, ops, start_time: Optional[float] = None):
        self.ops = ops
        self.start = time.time() if start_time is None else start_time
        self.signal_received = False
        self._previous = None
        if ops.exit_signal_handler:
            self._previous = signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        if not self.signal_received:
            print(f"rank {dist.get_rank() if dist.is_initialized() else 0}: received signal {signum}: "
                  f"stopping after the current iteration", file=sys.stderr, flush=True)
        self.signal_received = True

    def reason_to_exit(self, iteration: int) -> Optional[str]:
        """Collective when a signal handler or a duration is set: the same answer on every rank."""
        ops = self.ops
        reason = None
        if ops.exit_signal_handler or ops.exit_duration_in_mins:
            minutes = (time.time() - self.start) / 60.0
            signalled, late = runtime().all_reduce(
                [float(self.signal_received),
                 float(bool(ops.exit_duration_in_mins) and minutes > ops.exit_duration_in_mins)], op="max")
            if signalled > 0:
                reason = "a signal was received (--exit-signal-handler)"
            elif late > 0:
                reason = f"{minutes:.1f} minutes passed (--exit-duration-in-mins {ops.exit_duration_in_mins:g})"
        if reason is None and ops.exit_interval and iteration % ops.exit_interval == 0:
            reason = f"iteration {iteration} is a multiple of --exit-interval {ops.exit_interval}"
        return reason

    def close(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None


class Progress:
    """Where this rank is (iteration, phase), mirrored into the rendezvous store."""

    PREFIX = "puzzle/progress/"
    TIMED_OUT = "puzzle/timed-out/"

    def __init__(self):
        self.iteration, self.phase = 0, "start-up"
        self.store = None
        try:
            self.store = dist.distributed_c10d._get_default_store()
        except (RuntimeError, ValueError, AttributeError):
            self.store = None

    def __call__(self, iteration: int, phase: str) -> None:
        self.iteration, self.phase = iteration, phase
        if self.store is not None:
            try:
                self.store.set(f"{self.PREFIX}{dist.get_rank()}", f"{iteration}\t{phase}\t{time.time():.3f}")
            except RuntimeError:  # the store is advisory only
                self.store = None

    def where(self) -> str:
        return f"iteration {self.iteration}, {self.phase}"

    def others(self) -> dict:
        """rank -> (iteration, phase, timed out too) of every rank that reported, as far as known."""
        seen = {}
        if self.store is None:
            return seen
        self.store.set_timeout(datetime.timedelta(seconds=5))
        for r in range(dist.get_world_size()):
            try:
                if not self.store.check([f"{self.PREFIX}{r}"]):
                    continue
                it, phase, _ = self.store.get(f"{self.PREFIX}{r}").decode().split("\t")
                seen[r] = (int(it), phase, self.store.check([f"{self.TIMED_OUT}{r}"]))
            except Exception:  # the store is advisory: a store that is gone tells nothing
                continue
        return seen

    def mark_timed_out(self) -> None:
        if self.store is not None:
            try:
                self.store.set(f"{self.TIMED_OUT}{dist.get_rank()}", "1")
            except RuntimeError:
                self.store = None


def is_timeout(exc: BaseException) -> bool:
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("timed out" in text or "timeout" in text)


def describe_timeout(progress: Progress, exc: BaseException, timeout_minutes: float) -> str:
    """Which rank this one was waiting for: the ranks that did not time out themselves within a
    few seconds are stopped or stuck outside a collective (the others wait, as this one does)."""
    me = dist.get_rank()
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    msg = (f"rank {me}: a collective timed out after --distributed-timeout-minutes "
           f"{timeout_minutes:g} in {progress.where()} ({first})")
    progress.mark_timed_out()
    time.sleep(min(5.0, 1.0 + 0.1 * timeout_minutes * 60))  # let the other waiting ranks report
    seen = progress.others()
    stuck = [f"rank {r} (last seen in iteration {it}, {ph})" for r, (it, ph, timed_out)
             in sorted(seen.items()) if r != me and not timed_out]
    missing = [str(r) for r in range(dist.get_world_size()) if r not in seen]
    if stuck:
        msg += "; waiting for " + ", ".join(stuck) + " (not in a timed-out collective: stopped, or stuck)"
    if missing:
        msg += "; ranks that never reported: " + ", ".join(missing)
    return msg


def abort(message: str, code: int = 1) -> None:
    """Print and leave at once: after a timed-out collective, a clean shutdown would hang."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(code)
