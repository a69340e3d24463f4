"""The GRPO family on the real dataflow (tests/distributed/worlds/grpo_layouts.py, 4 ranks): each
estimator gives the same metrics at (1,4,1) sequential and at (2,1,2) time-shared with the switch;
only the roles it needs are built; a reward function failing on one rank fails every rank alike."""

import math

import pytest

from tests.harness import run_world

ESTIMATORS = ["grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax"]
KEYS = ("reward_mean", "kl", "entropy", "return_mean", "policy_loss", "clip_frac", "approx_kl",
        "actor_grad_norm", "response_length_mean", "reward_std", "solved_fraction", "response_length_p50")


@pytest.fixture(scope="module")
def world():
    return run_world("distributed/worlds/grpo_layouts.py", 4)


@pytest.mark.parametrize("name", ESTIMATORS)
def test_same_metrics_at_two_layouts_with_and_without_time_sharing(world, name):
    res = world[0]["estimators"]
    a, b = res[f"{name}/seq"], res[f"{name}/ts"]
    assert not a["switch"] and b["switch"]
    for key in KEYS + tuple(k for k in a if k.startswith(("filter_", "kl_loss", "reward_group"))):
        assert math.isfinite(a[key]), (name, key)
        assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-5), (name, key, a[key], b[key])
    assert a["actor_grad_norm"] > 0 and a["reward_std"] > 0
    assert all(r["estimators"][f"{name}/seq"]["policy_loss"] == a["policy_loss"] for r in world)


def test_roles_follow_the_estimator(world):
    res = world[0]["estimators"]
    # KL as a loss: the reference starts as the actor, so the loss turns > 0 once the actor has moved
    assert res["grpo/seq"]["roles"] == ["actor", "ref"] and res["grpo/seq"]["kl_loss"] > 0
    assert res["rloo/seq"]["roles"] == ["actor", "ref"] and res["rloo/seq"]["kl_coef"] == 0.05  # KL in the reward
    for name in ("reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax"):
        assert res[f"{name}/seq"]["roles"] == ["actor"], name
        assert "value_loss" not in res[f"{name}/seq"] and "critic_grad_norm" not in res[f"{name}/seq"]
    f = res["reinforce_plus_plus_baseline/seq"]
    # groups of even-length prompts score all 0: dropped, and more prompts generated to fill the batch
    assert f["filter_gen_rounds"] >= 2 and f["filter_groups_dropped"] >= 1 and f["filter_groups_padded"] == 0


def test_bad_reward_on_one_rank_fails_every_rank_alike(world):
    msgs = {r["bad_reward"]["error"] for r in world}
    assert len(msgs) == 1 and None not in msgs
    msg = msgs.pop()
    assert "batched_by_record: sample 6 of iteration 5 raised RuntimeError: boom" in msg
    assert "--on-bad-reward error" in msg
    for r in world:
        assert r["bad_reward"]["scores"] == [0.5] * 6 + [-2.0] * 2 and r["bad_reward"]["bad"] == 2
        assert r["bad_reward"]["after"]
