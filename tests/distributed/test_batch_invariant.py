"""--batch-invariant-mode on the tiny runs (tests/distributed/worlds/tiny_runs.py, in the shared 4-rank
and 1-rank worlds): generation and scoring log-probs of the sampled tokens are bitwise equal at every
iteration of PPO and GRPO, at (1,1,1) and with every model at (2,1,2) time-shared and the actor
generating at (1,2,2) through the switch; one planted ulp in the generation logits shows in the
metric; at T = 4 too (tests/distributed/worlds/generation.py)."""

import pytest

from tests.harness import run_world


@pytest.fixture(scope="module")
def runs():
    four = run_world("distributed/worlds/tiny_runs.py", 4, timeout=900)
    one = run_world("distributed/worlds/tiny_runs.py", 1)
    return {4: [r["batch_invariant"] for r in four], 1: one[0]["batch_invariant"]}


@pytest.mark.parametrize("algo", ["ppo", "grpo"])
def test_generation_and_scoring_log_probs_are_bitwise_equal(runs, algo):
    one, four = runs[1][algo], runs[4][0][algo]
    assert one["diff"] == [[0.0, 0.0], [0.0, 0.0]], one  # (max, mean) at iterations 1 and 2
    assert not one["switch"]
    assert four["diff"] == [[0.0, 0.0], [0.0, 0.0]], four
    assert four["switch"]  # trained at (2,1,2), generated at (1,2,2)
    assert all(r[algo]["diff"] == four["diff"] for r in runs[4])  # the same metrics on every rank
    assert ("critic" in four["roles"]) == (algo == "ppo") and "ref" in four["roles"]


def test_a_planted_ulp_in_the_generation_logits_shows(runs):
    (dmax, dmean), = runs[1]["planted"]["diff"]
    # one ulp of every logit moves some log-probs by a few ulps of their own (~5: ulp 4.8e-7)
    assert 0 < dmean <= dmax <= 1e-5, (dmax, dmean)


def test_tensor_parallel_sums_over_four_ranks_keep_parity():
    """T = 4 (tests/distributed/worlds/generation.py): megatron's all-reduce and the decode step's are
    added in rank order in the mode; without it the same comparison is fp32 rounding (4.8e-7 here)."""
    res = [r["batch_invariant_t4"] for r in run_world("distributed/worlds/generation.py", 4)]
    assert all(r["invariant"] == 0.0 for r in res), res
    assert all(0 <= r["default"] < 1e-5 for r in res), res
