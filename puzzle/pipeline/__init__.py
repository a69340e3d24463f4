"""Pipeline-parallel scheduling for puzzle (intra-stage time-sharing, PUZZLE §4.2).

``time_sharing_schedule`` holds the pure (torch-free) schedule tables, the P2P protocol an executor
follows, a blocking-P2P simulator and the Eq. (1) speed-up model.
"""

from puzzle.pipeline.time_sharing_schedule import (
    Action,
    CommStep,
    ContextSpec,
    DeadlockError,
    P2POp,
    Timeline,
    eq1_makespans,
    executor_program,
    one_f_one_b,
    p2p_ops,
    peak_in_flight,
    sequential_schedule,
    simulate,
    stream_makespan,
    theoretical_speedup,
    time_shared_schedule,
    unequal_makespans,
)

__all__ = [
    "Action",
    "CommStep",
    "ContextSpec",
    "DeadlockError",
    "P2POp",
    "Timeline",
    "eq1_makespans",
    "executor_program",
    "one_f_one_b",
    "p2p_ops",
    "peak_in_flight",
    "sequential_schedule",
    "simulate",
    "stream_makespan",
    "theoretical_speedup",
    "time_shared_schedule",
    "unequal_makespans",
]
