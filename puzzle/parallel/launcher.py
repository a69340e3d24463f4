"""The launcher's contract: the only module below the command line that reads the environment.

torchrun (alone, or under Slurm's ``srun torchrun``) starts one process per rank and tells each,
through the environment, who it is: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` (the device index
on its node), ``MASTER_ADDR`` / ``MASTER_PORT`` (the rendezvous that torch.distributed's env://
initialisation reads). A plain ``python train_ppo.py`` has none of them: it is rank 0 of a world
of one. Everything else a run needs comes from flags, through the frozen RunConfig; nothing below
the command-line layer reads ``os.environ`` but this module (tests/unit/test_layering.py checks it).

Every entry point ends through ``exit_process`` (``if __name__ == "__main__":
launcher.exit_process(main())``): a finished run leaves in a fixed order and is never reported
failed by an abort at interpreter exit.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Optional


#: the file in which a rank hands its one ``error:`` line and exit status to puzzle.tools.launch
#: (set by it for the workers), which prints the line last, below torchrun's own report
ERROR_FILE_ENV = "PUZZLE_ERROR_FILE"


def report_error_line(line: str, code: int) -> None:
    """The job's one ``error: ...`` line: handed to puzzle.tools.launch when it started this job,
    else printed on stderr."""
    path = os.environ.get(ERROR_FILE_ENV)
    if not path:
        print(line, file=sys.stderr, flush=True)
        return
    import json

    with open(path, "w") as f:
        json.dump({"message": line, "code": code}, f)


def launched() -> bool:
    """Whether a launcher (torchrun) set this process's rank."""
    return "RANK" in os.environ


def rank() -> int:
    """This process's global rank (0 without a launcher)."""
    return int(os.environ.get("RANK", "0"))


def world_size() -> int:
    """The number of ranks the launcher started (1 without a launcher)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def local_rank() -> int:
    """This process's rank on its node: the index of its CUDA device (0 without a launcher)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def local_world_size() -> int:
    """The number of ranks the launcher started on this node (1 without a launcher)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def default_to_world_of_one(port: int) -> None:
    """Without a launcher: the environment of rank 0 of a world of one (rendezvous on ``port`` of
    this host), so torch.distributed's env:// initialisation works the same way."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("LOCAL_WORLD_SIZE", "1")


def exit_process(code: Optional[int]):
    """End this process with status ``code`` after an orderly teardown; the last call of every
    entry point (train_ppo.py, search_plan.py, the tools).

    1. the process groups still alive are destroyed (each rank gets here after the same work; a
       run that destroyed its world already skips this);
    2. workers are joined as the interpreter's own exit does it: thread pools are shut down and
       non-daemon threads joined, then the exit handlers run (multiprocessing joins its child
       processes, logging flushes);
    3. stdout and stderr are flushed, and the process exits with ``code`` without the interpreter's
       finalisation, whose destructors freed gloo's process groups and their worker threads in no
       set order: a finished 4-rank run once died there with "terminate called without an active
       exception" (SIGABRT), and torchrun reported the whole job failed.
    """
    import atexit

    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    threading._shutdown()  # as the interpreter's exit: thread pools shut down, non-daemon threads joined
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing left to flush
            pass
    os._exit(0 if code is None else code if isinstance(code, int) else 1)
