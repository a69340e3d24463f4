"""What a failed checkpoint save tells the user, and how the job ends after it.

A save (puzzle.checkpointing.save_checkpoint) runs in named phases ("writing actor", "publishing
it", ...). Each phase is reported to the run's progress (``run_control.Progress``: when a collective
times out, the message names the rank that is behind and the phase it was last seen in), and an
error in a phase becomes one ``SaveError`` naming the rank, the iteration, the phase and the
checkpoint that stays the latest. A failed write that megatron reports arrives on every rank (its
coordinator names the rank that failed); a failure of our own phases arrives on its rank only, while
the others may wait in the save's next collective: so a rank that gets a SaveError prints
``error: ...`` once for the whole job and exits at once with status 1 (``exit_after_failed_save``);
torchrun then ends the other ranks, and without torchrun they time out after
--distributed-timeout-minutes.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
from typing import Callable, Optional

import torch.distributed as dist

from puzzle.parallel import launcher

#: set in the rendezvous store by the rank that reports a failed save (the others stay silent)
SAVE_FAILED_KEY = "puzzle/checkpoint/save-failed"


class SaveError(RuntimeError):
    """A save that failed: the message names the rank, the iteration and the phase, and which
    checkpoint is still the latest. ``informative``: False on a rank that only learnt from megatron
    that another rank's write failed (the coordinator's SaveError names that rank)."""

    def __init__(self, message: str, informative: bool = True):
        super().__init__(message)
        self.informative = informative


class SavePhases:
    """``with phases("writing actor"): ...`` for each phase of the save of ``iteration``:
    ``progress(iteration, "checkpoint saving: writing actor")`` first, an error in it a SaveError
    (a timed-out collective stays what it is: its own report names the rank that stopped)."""

    def __init__(self, progress: Optional[Callable[[int, str], None]], iteration: int, still_latest: str):
        self.progress, self.iteration, self.still_latest = progress, iteration, still_latest
        self.rank = dist.get_rank()

    @contextlib.contextmanager
    def __call__(self, name: str):
        if self.progress is not None:
            self.progress(self.iteration, f"checkpoint saving: {name}")
        try:
            yield
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # torch's CheckpointException derives from BaseException
            if isinstance(e, RuntimeError) and _is_timeout(e):
                raise
            raise self.error(name, e) from None

    def error(self, phase: str, exc: BaseException) -> SaveError:
        failures = getattr(exc, "failures", None)  # torch's CheckpointException: {rank: error}
        if failures == {}:  # megatron tells the ranks but its coordinator that some write failed
            return SaveError(f"rank {self.rank}: saving checkpoint iteration {self.iteration} failed while {phase}: "
                             f"a write failed on another rank (the coordinator names it); {self.still_latest}",
                             informative=False)
        who = "rank " + (", ".join(map(str, sorted(failures))) if failures else str(self.rank))
        return SaveError(f"{who}: saving checkpoint iteration {self.iteration} failed while {phase}: "
                         f"{summarize(exc, with_ranks=False)}; {self.still_latest}")


def _is_timeout(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "timed out" in text or "timeout" in text


def exit_after_failed_save(e: SaveError, wait_seconds: float = 10.0):
    """End this rank after a failed save: ``error: <message>`` once for the whole job (the first
    informative rank prints it: the rendezvous store decides; a rank that only knows that some
    write failed waits up to ``wait_seconds`` for that message), then exit status 1 at once,
    without a shutdown, which could wait for ever on a rank that left the save."""
    store = _default_store()
    speak = store is None
    try:
        if store is not None and e.informative:
            speak = store.add(SAVE_FAILED_KEY, 1) == 1
        elif store is not None:
            store.set_timeout(datetime.timedelta(seconds=wait_seconds))
            store.wait([SAVE_FAILED_KEY])
    except Exception:  # the store is advisory: without it this rank speaks for itself
        speak = True
    if speak:
        launcher.report_error_line(f"error: {e}", 1)
    sys.stdout.flush()
    os._exit(1)


def _default_store():
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None


def summarize(exc: BaseException, with_ranks: bool = True) -> str:
    """One line for an exception of torch's dist checkpoint (its CheckpointException lists every
    rank's traceback; it derives from BaseException)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        inner = first[0] if isinstance(first, tuple) else first  # (exception, stack summary)
        ranks = ", ".join(map(str, sorted(failures)))
        return f"{type(inner).__name__}: {first_line(inner)}" + (f" (ranks {ranks})" if with_ranks else "")
    return f"{type(exc).__name__}: {first_line(exc)}"


def first_line(exc: BaseException, limit: int = 300) -> str:
    text = str(exc).strip().splitlines()
    line = text[0] if text else ""
    return line if len(line) <= limit else line[:limit] + " ..."
