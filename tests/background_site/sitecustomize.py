"""Imported at the start of every Python process of a test run in the background (tests/harness.py
puts this folder first on PYTHONPATH for those runs only): a process in a session of its own
yields the cores to the foreground tests.

The kernel shares the cores between sessions first (autogroups) and between the processes of a
session second. The harness starts the run in a session of its own at the lowest autogroup weight
(nice 19) and under SCHED_IDLE, which every process under it inherits; torchrun starts each rank in
a new session, whose autogroup this sets to nice 19 too. Where that is not allowed the rank runs
as it would have."""

import os

if os.environ.get("PUZZLE_TEST_BACKGROUND") and os.getsid(0) == os.getpid():
    try:  # only a session of its own (a rank): never the session that started it
        with open("/proc/self/autogroup", "w") as f:
            f.write("19")
    except OSError:
        pass
