"""A timed-out reward is killed, not abandoned: the call runs in a worker process that is killed
at its deadline. Per-sample checkers (and the built-ins) are timed per sample: one stuck response
costs one bad reward; a batched user function keeps a per-call timeout."""

import os
import time

from puzzle.reward_functions import Sample, load_reward_fn
from puzzle.reward_functions.runner import RewardScorer

FX = "tests.unit.reward_timeout_fixtures"


def _samples(responses, pid_file):
    return [Sample(index=i, prompt_text="p", response_text=r, prompt_ids=[1], response_ids=[2],
                   record={"answer": "7", "pid_file": str(pid_file)}) for i, r in enumerate(responses)]


def _gone(pid: int) -> bool:
    for _ in range(50):  # a killed child is reaped by join(); allow the OS a moment
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.01)
    return False


def test_one_stuck_response_costs_one_bad_reward_and_its_process(tmp_path):
    assert load_reward_fn("puzzle.reward_functions.builtin:math_answer").one_sample_per_call
    pid_file = tmp_path / "pid"
    scorer = RewardScorer(load_reward_fn(f"{FX}:per_sample_checker"), workers=0, timeout=1.0)
    try:
        out = scorer.score(_samples(["7", "stuck", "8", "7"], pid_file))
        assert [v for v, _ in out] == [1.0, None, 0.0, 1.0]
        assert out[1][1] == "timed out after 1 s (its process was killed)"
        assert _gone(int(pid_file.read_text()))  # killed, not left running
        assert [v for v, _ in scorer.score(_samples(["7", "1"], pid_file))] == [1.0, 0.0]  # a fresh worker
        out = scorer.score(_samples(["exit", "7"], pid_file))  # a worker that dies: that sample only
        assert out == [(None, "failed: its reward process died (exit code 3)"), (1.0, None)]
    finally:
        scorer.close()


def test_a_batched_function_keeps_a_per_call_timeout(tmp_path):
    pid_file = tmp_path / "pid"
    scorer = RewardScorer(load_reward_fn(f"{FX}:batched_checker"), workers=2, timeout=0.25)
    try:
        out = scorer.score(_samples(["7", "7", "stuck", "7"], pid_file))  # two calls of two samples
        assert out[:2] == [(1.0, None), (1.0, None)]
        assert out[2:] == [(None, "timed out after 0.5 s (its process was killed)")] * 2
        assert _gone(int(pid_file.read_text()))
    finally:
        scorer.close()
    assert not scorer._pool
