"""Reward functions for the timeout tests (imported by name in the reward worker processes)."""

import os
import time

from puzzle.reward_functions import per_sample


def _check(response, record):
    if response == "stuck":  # write the process id, then never return
        with open(record["pid_file"], "w") as f:
            f.write(str(os.getpid()))
        time.sleep(600)
    if response == "exit":  # the process dies under the call
        os._exit(3)
    return 1.0 if response == record.get("answer") else 0.0


@per_sample
def per_sample_checker(prompts, responses, records):
    """Independent samples (like the built-in checkers): called one sample per call."""
    return [_check(r, rec) for r, rec in zip(responses, records)]


def batched_checker(prompts, responses, records):
    """The same checker, batched: a stuck sample costs its whole call."""
    return [_check(r, rec) for r, rec in zip(responses, records)]
