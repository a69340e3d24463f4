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


# ---- the measured scenario of docs/operations.md ("What is trusted"): the tiny GRPO run's reward
# with calls that never finish in time (not used by the unit tests: they sleep 120 s)
def _answer_prefix(responses, records):
    return [1.0 if r.startswith(str(rec["answer"]).strip()) else 0.0 for r, rec in zip(responses, records)]


_calls = [0]


def hang_every_third_call(prompts, responses, records):
    """Batched: every third call in each process sleeps 120 s (a per-call timeout applies)."""
    _calls[0] += 1
    if _calls[0] % 3 == 0:
        time.sleep(120)
    return _answer_prefix(responses, records)


@per_sample
def one_stuck_response_per_384(prompts, responses, records):
    """Per sample (as the built-in checkers): one call in 384 in each process sleeps 120 s."""
    _calls[0] += len(responses)
    if _calls[0] % 384 == 0:
        time.sleep(120)
    return _answer_prefix(responses, records)
