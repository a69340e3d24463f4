"""Shared by the test files: ``saved_run``, the session's one saved tiny PPO run, the
``learning`` marker of the learning-curve runs (the README command runs them; a quicker pass
leaves them out: ``bash scripts/test.sh -m "not learning"``), and the order of a session: the
shared worlds (tests/harness.py SHARED_WORLDS) start in the background once the tests are
collected, and the test files that read them run last, so that the worlds' ranks, which spend
much of their time waiting on each other's collectives, share the two cores with the rest; the
learning-curve runs (marked ``launch_ahead``) start then too."""

import functools
import re
from collections import namedtuple
from pathlib import Path

import pytest

from tests import harness
from tests.harness import (SAVED_RUN_ENV, SAVED_RUN_FLAGS, SAVED_RUN_NPROC, SAVED_RUN_SKIP_FLAGS, TINY_PPO,
                           read_metrics, run_script)


def pytest_configure(config):
    config.addinivalue_line("markers", "learning: a learning-curve run (left out by -m 'not learning')")
    config.addinivalue_line("markers", "launch_ahead(script, args, nproc): a launch script's run started when the "
                            "tests are collected, read by the test through the fixture ``ahead``")


#: how the test files ask for a world: run_world("distributed/worlds/<script>.py", <ranks>, ...)
_WORLD_CALL = re.compile(r'run_world\(\s*"([^"]+)",\s*(\d+)')


@functools.lru_cache(maxsize=None)
def _worlds_in(path: str) -> frozenset:
    """The (script, ranks) worlds a test file reads (a world asked for otherwise starts on demand)."""
    return frozenset((script, int(n)) for script, n in _WORLD_CALL.findall(Path(path).read_text()))


def _reads_worlds(item) -> int:
    """2: a test file of tests/distributed that reads a world; 1: another such file; 0: the rest."""
    if not _worlds_in(str(item.path)):
        return 0
    return 2 if "distributed" in item.path.parts else 1


def pytest_collection_modifyitems(config, items):
    items.sort(key=_reads_worlds)  # stable: each file's tests keep their order


def pytest_collection_finish(session):
    if session.config.option.collectonly:
        return
    harness.start_shared_worlds(set().union(*(_worlds_in(str(i.path)) for i in session.items)))
    for item in session.items:
        marker = item.get_closest_marker("launch_ahead")
        if marker is not None:
            harness.launched_ahead(*marker.args)


def pytest_sessionfinish(session):
    harness.stop_shared_worlds()
    harness.stop_launched_ahead()


@pytest.fixture
def ahead(request) -> "harness.LaunchedAhead":
    """The run named by the test's ``launch_ahead(script, args, nproc)`` marker, started when the
    session's tests were collected: it ran alongside the tests before this one."""
    return harness.launched_ahead(*request.node.get_closest_marker("launch_ahead").args)


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
