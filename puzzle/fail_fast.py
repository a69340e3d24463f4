"""Bad input fails the same way in train_ppo.py and in every tool: one line ``error: ...`` on
stderr from rank 0 (the other ranks stay silent), exit status 2, no traceback from any rank.

Bad input is what the checks raise before (or instead of) any work: ``ValueError`` (a flag, a
file's content, a model that a layout cannot split: ArgumentError and PlanError are ValueErrors),
``OSError`` (a missing or unreadable file) and ``CheckpointError`` (a checkpoint that cannot be
used). Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import sys
from typing import Callable, List, Optional

from puzzle.checkpoint_errors import CheckpointError
from puzzle.parallel import launcher

USAGE_EXIT_CODE = 2


def quiet_startup_warnings() -> None:
    """Before megatron-core is imported: its warnings that the optional TE/Apex kernels are absent
    are dropped (the README explains), and ranks other than 0 print no warnings at all."""
    import logging
    import warnings

    warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex|apex).*")
    if launcher.rank() != 0:
        warnings.simplefilter("ignore")
        logging.getLogger("megatron").setLevel(logging.ERROR)


def is_usage_error(e: BaseException) -> bool:
    return isinstance(e, (ValueError, OSError, CheckpointError))


def report_usage_error(e: BaseException) -> int:
    """Print ``error: <e>`` once (rank 0); the exit status for bad input."""
    if launcher.rank() == 0:
        print(f"error: {e}", file=sys.stderr, flush=True)
    return USAGE_EXIT_CODE


def run_failing_fast(main: Callable[[Optional[List[str]]], int], argv: Optional[List[str]] = None) -> int:
    """``main(argv)``; bad input is reported once and gives exit status 2. A process group that
    ``main`` started is destroyed (every rank checks the same input, so every rank gets here)."""
    dist = sys.modules.get("torch.distributed")
    had_world = dist is not None and dist.is_available() and dist.is_initialized()
    try:
        return main(argv)
    except Exception as e:
        if not is_usage_error(e):
            raise
        dist = sys.modules.get("torch.distributed")
        if not had_world and dist is not None and dist.is_initialized():
            dist.destroy_process_group()
        return report_usage_error(e)
