"""--rl-partial-rollouts in the real training path (tests/distributed/worlds/tiny_runs.py, 1 rank):
a tiny GRPO run on a planted long tail carries samples over, trains every token with the
log-prob it was sampled with (its policy version recorded), loses and repeats nothing, and a run
resumed at iteration 2 repeats the uninterrupted one."""

from tests.harness import run_world


def test_partial_rollouts_carry_resume_and_train_on_behaviour_logprobs():
    res = run_world("distributed/worlds/tiny_runs.py", 1)[0]["partial_rollouts"]
    assert res["tokens"] > 0 and res["stale_tokens"] > 0  # carried tokens trained at a later version
    assert res["wrong"] == 0
    assert res["trained_twice"] == 0 and res["held_and_trained"] == 0 and res["lost"] == 0
    straight, resumed = res["straight"], res["resumed"]
    assert [r["iteration"] for r in straight] == [1, 2, 3, 4] and [r["iteration"] for r in resumed] == [3, 4]
    assert max(r["partial_carried_fraction"] for r in straight) > 0
    assert max(r["partial_token_lag_max"] for r in straight) >= 1
    assert any(r["actor_grad_norm"] > 0 and r["is_weight_mean"] != 1.0 for r in straight[1:])  # the policy moved
    assert resumed == straight[2:]
