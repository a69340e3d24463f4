"""A benchmark's worker ranks: one torchrun of ``python -m <bench> --worker ...`` per layout, the
``ROW {json}`` lines its rank 0 prints collected as the bench's rows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable, List


def torchrun_rows(module: str, nproc: int, worker_args: List[str], rows: list) -> int:
    """Run ``python -m module --worker *worker_args`` on ``nproc`` gloo ranks (one thread each,
    this repository on PYTHONPATH); append and print each row it prints. Returns its exit status
    (the tail of its output on stderr when it failed)."""
    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=f"{repo}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", module, "--worker", *worker_args]
    proc = subprocess.run(cmd, env=env, cwd=repo, capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith("ROW "):
            rows.append(json.loads(line[4:]))
            print(line[4:], flush=True)
    if proc.returncode != 0:
        sys.stderr.write("\n".join((proc.stdout + "\n" + proc.stderr).splitlines()[-60:]) + "\n")
    return proc.returncode


def run_layouts(module: str, layouts: List[str], nproc: Callable[[str], int], worker_args: List[str],
                out: str) -> int:
    """One torchrun per layout (``nproc(layout)`` ranks, ``--layout L`` then ``worker_args``); the
    rows of all of them also written to ``out`` (``--out FILE``; nothing without a file)."""
    rows = []
    for layout in layouts:
        rc = torchrun_rows(module, nproc(layout), ["--layout", layout, *worker_args], rows)
        if rc:
            return rc
    if out:
        Path(out).write_text(json.dumps(rows, indent=1))
    return 0
