"""Shared by the test files: ``saved_run``, the session's one saved tiny PPO run, and the
``learning`` marker of the learning-curve runs (the README command runs them; a quicker pass
leaves them out: ``bash scripts/test.sh -m "not learning"``)."""

from collections import namedtuple

import pytest

from tests.harness import (SAVED_RUN_ENV, SAVED_RUN_FLAGS, SAVED_RUN_NPROC, SAVED_RUN_SKIP_FLAGS, TINY_PPO,
                           read_metrics, run_script)

def pytest_configure(config):
    config.addinivalue_line("markers", "learning: a learning-curve run (left out by -m 'not learning')")


SavedRun = namedtuple("SavedRun", "root ckpt rows stdout stderr")


@pytest.fixture(scope="session")
def saved_run(tmp_path_factory) -> SavedRun:
    """One uninterrupted 6-iteration run (tests.harness SAVED_RUN_*: 2 ranks, every model at
    (1,2,1), the critic's step at iteration 2 skipped for NaN gradients) saving at 2, 4 and 6
    with the newest two kept: ``ckpt`` holds iter_0000004 and iter_0000006. Shared by the whole
    session: read it, --load it, or copy it before changing anything in it."""
    root = tmp_path_factory.mktemp("saved_run")
    ckpt = root / "ckpt"
    proc, _ = run_script(TINY_PPO, SAVED_RUN_FLAGS + SAVED_RUN_SKIP_FLAGS + [
        "--save", str(ckpt), "--save-interval", "2", "--keep-last-checkpoints", "2"], root / "log",
        nproc=SAVED_RUN_NPROC, env=SAVED_RUN_ENV)
    assert sorted(p.name for p in ckpt.iterdir()) == ["iter_0000004", "iter_0000006",
                                                      "latest_checkpointed_iteration.txt"]
    assert f"deleted {ckpt / 'iter_0000002'} (--keep-last-checkpoints 2)" in proc.stdout
    return SavedRun(root, ckpt, read_metrics(root / "log"), proc.stdout, proc.stderr)
