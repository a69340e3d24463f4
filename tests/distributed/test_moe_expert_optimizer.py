"""The tiny MoE run saved with its experts split over E = 2 ranks resumes with the actor and critic
at E = 1, their optimizer state included (experts keep an optimizer of their own at every E):
iteration 2 repeats the straight run's. Checked in the 4-rank world of
tests/distributed/worlds/moe_switch.py."""

import pytest

from tests.harness import assert_same_metrics, run_world


@pytest.fixture(scope="module")
def world():
    return run_world("distributed/worlds/moe_switch.py", 4)


def test_tiny_moe_run_saved_at_e2_resumes_its_optimizer_at_e1(world):
    run = world[0]["tiny_run"]
    assert run["at_e1_plans"]["actor"] == "(P=1, D=4, T=1) ETP=1"
    assert run["at_e1_plans"]["critic"] == "(P=1, D=4, T=1) ETP=1"
    assert [r["iteration"] for r in run["at_e1"]] == [2]
    straight, at_e1 = {2: run["straight"][1]}, {2: run["at_e1"][0]}
    norms = ("actor_grad_norm", "critic_grad_norm")
    logprob_diff = ("gen_score_logprob_diff_mean", "gen_score_logprob_diff_max")
    # the rollout, losses, KL and values exactly; the gradient norms up to fp32 reduction order
    # (the experts' gradients reduced over another group), generation's log-probs against the packed
    # scoring's within fp32 rounding
    assert_same_metrics(at_e1, straight, skip=norms + logprob_diff)
    assert_same_metrics(at_e1, straight, keys=norms, rel=1e-6)
    assert at_e1[2]["actor_grad_norm"] > 0 and 0.5 < at_e1[2]["moe_aux_loss"] < 4.0
    for row in (straight[2], at_e1[2]):
        assert 0 <= row["gen_score_logprob_diff_mean"] <= row["gen_score_logprob_diff_max"] <= 2e-6, row
