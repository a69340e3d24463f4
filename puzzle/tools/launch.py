"""torchrun for train_ppo.py, as the launch scripts run it: the flags checked first, and one
``error:`` line when the job fails on bad input.

    python -m puzzle.tools.launch [torchrun's flags] train_ppo.py [train_ppo.py's flags]

1. train_ppo.py's own checks run first, in this one plain process, for the job that torchrun's
   flags describe (``--nnodes`` x ``--nproc-per-node`` ranks): the flags, the plan, the
   tokenizer, the reward function, the prompt files and the checkpoint's metadata
   (``puzzle.cli.preflight``). Bad input prints one ``error:`` line and exits 2 before any rank
   starts; ``--dry-run`` and ``--help`` end here too (nothing to launch).
2. torchrun itself (``torch.distributed.run``: its flags, rendezvous and signal handling) starts
   the ranks. Rank 0 hands its ``error:`` line and exit status to this process instead of
   printing them (``$PUZZLE_ERROR_FILE``). When the job ends with such a line, it is printed last,
   in place of torchrun's failure report, and this process exits with rank 0's status (2: bad
   input, e.g. a checkpoint that cannot be loaded; 3: non-finite gradients). A failure without
   one (a crash, a signal) keeps torchrun's report and status.

An elastic node range (``--nnodes MIN:MAX``) has no world size to check for: the ranks check.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from typing import List, Optional

from puzzle.parallel.launcher import ERROR_FILE_ENV

#: the entry script whose flags are checked before the launch
TRAIN_SCRIPT = "train_ppo.py"


def job_world_size(targs) -> Optional[int]:
    """The ranks torchrun starts from its parsed flags; None for an elastic node range."""
    from torch.distributed import run as torchrun

    low, high = torchrun.parse_min_max_nnodes(targs.nnodes)
    if low != high:
        return None
    return low * torchrun.determine_local_world_size(targs.nproc_per_node)


def _preflight(targs) -> Optional[int]:
    """train_ppo.py's checks in this process (None: launch), as train_ppo.py starts them."""
    if targs.module or targs.no_python or os.path.basename(targs.training_script) != TRAIN_SCRIPT:
        return None
    try:
        world_size = job_world_size(targs)
    except (ValueError, RuntimeError) as e:
        print(f"error: --nproc-per-node/--nnodes: {e}", file=sys.stderr, flush=True)
        return 2
    if world_size is None:
        return None
    from puzzle.fail_fast import quiet_startup_warnings

    quiet_startup_warnings()
    from puzzle import cli

    return cli.preflight(list(targs.training_script_args), world_size)


def _recorded(path: str) -> Optional[dict]:
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) and doc.get("message") else None


def main(argv: Optional[List[str]] = None) -> int:
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    argv = list(sys.argv[1:] if argv is None else argv)
    targs = torchrun.parse_args(argv)
    rc = _preflight(targs)
    if rc is not None:
        return rc
    fd, error_file = tempfile.mkstemp(prefix="puzzle-error-", suffix=".json")
    os.close(fd)
    os.environ[ERROR_FILE_ENV] = error_file  # the workers inherit it
    recorded = None
    try:
        torchrun.main(argv)  # torchrun itself, as `torchrun ARGV` runs it
        return 0
    except ChildFailedError:
        recorded = _recorded(error_file)
        if recorded is None:
            raise  # torchrun's own report and exit status
        return int(recorded.get("code") or 1)
    finally:
        recorded = recorded or _recorded(error_file)  # also when torchrun stopped on a signal
        if recorded is not None:
            sys.stdout.flush()
            print(recorded["message"], file=sys.stderr, flush=True)
        with contextlib.suppress(OSError):
            os.remove(error_file)
        os.environ.pop(ERROR_FILE_ENV, None)


if __name__ == "__main__":
    sys.exit(main())
