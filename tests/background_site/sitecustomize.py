"""Imported at the start of every Python process of a test run in the background (tests/harness.py
puts this folder first on PYTHONPATH for those runs only): the process yields the cores to the
foreground tests.

Two settings, because the kernel shares the cores between sessions first (autogroups: torchrun
starts each rank in a session of its own) and between the processes of a session second: the
session's autogroup gets the lowest weight (nice 19), and the process runs under SCHED_IDLE within
it (the harness sets the autogroup of the session it starts the run in). Where either is not
available the process runs as it would have."""

import os

if os.environ.get("PUZZLE_TEST_BACKGROUND"):
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        pass
    if os.getsid(0) == os.getpid():  # a session of its own (a rank): never the session that started it
        try:
            with open("/proc/self/autogroup", "w") as f:
                f.write("19")
        except OSError:
            pass
