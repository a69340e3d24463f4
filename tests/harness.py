"""Spawn a gloo world with torchrun, run one world script (several checks), collect per-rank JSON.

World scripts call ``world_main(checks)``: each check runs on every rank and returns a
JSON-serialisable dict; results land in $PUZZLE_TEST_OUT/rank{R}.json.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run_world(script: str, nproc: int, *args: str, timeout: int = 600) -> list:
    """Run tests/<script> on ``nproc`` ranks; return the per-rank result dicts (rank order)."""
    with tempfile.TemporaryDirectory(prefix="puzzle-world-") as out:
        env = dict(os.environ, PUZZLE_TEST_OUT=out, OMP_NUM_THREADS="1",
                   PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={nproc}", str(REPO / "tests" / script), *args]
        proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)
        results = []
        for r in range(nproc):
            f = Path(out) / f"rank{r}.json"
            results.append(json.loads(f.read_text()) if f.exists() else None)
        if proc.returncode != 0 or any(r is None for r in results):
            tail = "\n".join((proc.stdout + "\n" + proc.stderr).splitlines()[-80:])
            raise AssertionError(f"world {script} x{nproc} failed (rc={proc.returncode}):\n{tail}")
        return results


def world_main(checks) -> None:
    """Entry of a world script: apply patches, init dist, run every check, write results."""
    import megatron_patches

    megatron_patches.apply()
    import torch.distributed as dist

    from puzzle.parallel.groups import init_distributed

    rank, _ = init_distributed()
    results = {}
    for name, fn in checks:
        try:
            results[name] = fn()
        except Exception:  # recorded and re-raised so the test shows the traceback
            results[name] = {"error": traceback.format_exc()}
            Path(os.environ["PUZZLE_TEST_OUT"], f"rank{rank}.json").write_text(json.dumps(results))
            raise
    dist.barrier()
    Path(os.environ["PUZZLE_TEST_OUT"], f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()
