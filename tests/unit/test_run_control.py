"""Megatron-LM's exit flags (single process: the agreement all-reduce is the identity)."""

import os
import signal
import time

from puzzle.config import Operations
from puzzle.run_control import ExitControl, is_timeout


def test_exit_interval_duration_and_signal():
    ctl = ExitControl(Operations(exit_interval=3))
    assert [ctl.reason_to_exit(i) for i in (1, 2)] == [None, None]
    assert ctl.reason_to_exit(3) == "iteration 3 is a multiple of --exit-interval 3"
    ctl = ExitControl(Operations(exit_duration_in_mins=0.5), start_time=time.time() - 20)
    assert ctl.reason_to_exit(1) is None
    ctl.start -= 20
    assert ctl.reason_to_exit(2).endswith("minutes passed (--exit-duration-in-mins 0.5)")
    before = signal.getsignal(signal.SIGTERM)
    ctl = ExitControl(Operations(exit_signal_handler=True))
    try:
        assert ctl.reason_to_exit(1) is None
        os.kill(os.getpid(), signal.SIGTERM)  # handled: the process goes on
        time.sleep(0.01)
        assert ctl.reason_to_exit(2) == "a signal was received (--exit-signal-handler)"
    finally:
        ctl.close()
    assert signal.getsignal(signal.SIGTERM) is before


def test_timeouts_are_recognised():
    assert is_timeout(RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms for recv"))
    assert not is_timeout(RuntimeError("Connection closed by peer"))
