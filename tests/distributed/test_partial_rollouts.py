"""--rl-partial-rollouts in the real training path (tests/distributed/worlds/tiny_runs.py, 1 rank):
a tiny GRPO run on a planted long tail carries samples over, trains every token with the
log-prob it was sampled with (its policy version recorded) except those older than
--rl-partial-rollouts-max-staleness allows, loses and repeats nothing, and a run resumed at
iteration 2 repeats the uninterrupted one."""

from tests.harness import run_world


def test_partial_rollouts_carry_resume_and_train_on_behaviour_logprobs():
    res = run_world("distributed/worlds/tiny_runs.py", 1)[0]["partial_rollouts"]
    assert res["tokens"] > 0 and res["stale_tokens"] > res["masked_tokens"] > 0  # carried tokens trained at a
    # later version; those sampled more than --rl-partial-rollouts-max-staleness versions ago not in the loss
    assert res["wrong"] == 0
    assert res["trained_twice"] == 0 and res["held_and_trained"] == 0 and res["lost"] == 0
    straight, resumed = res["straight"], res["resumed"]
    assert [r["iteration"] for r in straight] == [1, 2, 3, 4] and [r["iteration"] for r in resumed] == [3, 4]
    assert max(r["partial_carried_fraction"] for r in straight) > 0
    assert max(r["partial_token_lag_max"] for r in straight) >= 2
    assert max(r["partial_stale_masked_frac"] for r in straight) > 0
    assert any(r["actor_grad_norm"] > 0 and r["is_weight_mean"] != 1.0 for r in straight[1:])  # the policy moved
    assert resumed == straight[2:]


def test_multi_turn_samples_carried_mid_episode_train_evaluate_and_resume():
    """The tiny tool run with partial rollouts (tiny_runs.py ``check_env_partial_run``): the planted
    long samples call the calculator at once and are stopped with their observation pending; they
    are carried (its tokens written at the stop, masked from the loss, at the policy version that
    inserted them) and finish iterations later with their episode's instance (the reward after a
    call is >= 0.1 only when the instance remembers the call); the run resumed at iteration 2 rebuilds
    the instances by replay and repeats the straight run; evaluation before and after training
    runs episodes too."""
    res = run_world("distributed/worlds/tiny_runs.py", 1)[0]["env_partial_run"]
    carried_mid_episode = 0
    for it, (ids, versions, mask, scores, lengths) in res["trained"].items():
        assert len(ids) == len(set(ids)) == 16
        for b, sid in enumerate(ids):
            n, v, m = lengths[b], versions[b], mask[b]
            if sid % 9 != 3:
                assert min(m[:n]) == 1.0  # no observation: one answer, then EOS
                continue
            assert m[:n] == [1.0] + [0.0] * 5 + [1.0] * (n - 6) and n == 9  # "]", "=XXXX" inserted, the answer
            assert v[:n] == sorted(v[:n]) and v[n:] == [-1] * (len(v) - n) and max(v[:n]) <= int(it) - 1
            assert scores[b] >= 0.1  # the call was remembered by the episode's instance
            carried_mid_episode += v[0] < v[n - 1] and v[1] == v[0]  # the observation came with the stopped turn
    assert carried_mid_episode >= 2
    straight, resumed = res["straight"], res["resumed"]
    assert [r["iteration"] for r in straight] == [1, 2, 3] and [r["iteration"] for r in resumed] == [3]
    assert resumed == straight[2:] and resumed[0]["env_replay_mismatches"] == 0
    assert max(r["partial_carried_fraction"] for r in straight) > 0 and straight[2]["actor_grad_norm"] > 0
    before, after = res["eval"]
    for ev in (before, after):
        assert ev["eval/prompts"] == 4 and ev["eval/env_turns_per_sample"] >= 1.0
    assert before["eval/env_tool_calls_per_sample"] > 0 and before["eval/env_observation_tokens_per_sample"] > 0
