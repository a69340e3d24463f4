"""Multi-turn generation (puzzle/rollout/turns.py) in the shared 1-rank world
(tests/distributed/worlds/tiny_runs.py ``check_env_rollouts``): observation tokens appended to the
rows' kept KV caches by prefills, token in, token out; the turn and token limits counted."""

import pytest

from tests.harness import run_world


@pytest.fixture(scope="module")
def res():
    return run_world("distributed/worlds/tiny_runs.py", 1)[0]["env_rollouts"]


def test_the_sequence_is_the_sampled_tokens_plus_the_observations_as_inserted(res):
    calls_of = {}
    for r, history, turn, final in res["calls"]:
        calls_of.setdefault(r, []).append((history, turn, final))
    for r, calls in calls_of.items():
        n = res["lengths"][r]
        tokens, mask = res["tokens"][r][:n], [bool(m) for m in res["mask"][r][:n]]
        expect, expect_mask = [], []
        for history, turn, final in calls:
            assert history == expect, r  # the handler saw the response as it is in the sequence
            expect += turn
            expect_mask += [False] * len(turn)
            if not final:
                assert turn[-1] % 4 == 0  # a turn ends at a stop
                obs = [40 + len(history) % 20] * (9 if r == 3 else 3)
                expect += obs
                expect_mask += [True] * len(obs)
        assert tokens == expect[:n] and mask == expect_mask[:n], r


def test_sampled_tokens_match_a_full_forward_and_observations_have_no_log_prob(res):
    for r, n in enumerate(res["lengths"]):
        for k in range(n):
            if res["mask"][r][k]:
                assert res["logprobs"][r][k] == 0.0
            else:  # the KV cache holds the observations exactly as a fresh forward computes them
                assert abs(res["logprobs"][r][k] - res["full"][r][k]) < 1e-5, (r, k)


def test_the_limits_are_counted(res):
    c = res["counts"]
    assert c["turns"] == len(res["calls"]) and c["observation_tokens"] == sum(map(sum, res["mask"]))
    assert c["turn_limit_cuts"] >= 1  # an episode that wanted a 4th turn
    assert c["token_limit_cuts"] == 1 and res["lengths"][3] == 20  # row 3's 9-token observations
    # rows 0-2 end with a final step; row 3's budget ran out inside an observation: no turn left to step
    assert sorted(r for r, _, _, final in res["calls"] if final) == [0, 1, 2]


def test_the_tokens_are_those_of_a_full_forward_in_fewer_model_calls(res):
    """The sampled tokens are the sampler's draws from a full forward's logits (fp32: the cached
    logits differ from them by ~1e-6, far from a tie of the Gumbel-max draw here; the forced-decode
    path, one decode step per observation token, gave these tokens too). Observation tokens cost
    no model call: forced decoding needed at least one call per response token and slot (2 slots)."""
    for r, n in enumerate(res["lengths"]):
        sampled = [k for k in range(n) if not res["mask"][r][k]]
        assert [res["tokens"][r][k] for k in sampled] == [res["resampled"][r][k] for k in sampled], r
    assert res["forward_passes"] < sum(res["lengths"]) / 2


def test_the_join_lag_changes_the_calls_not_the_samples_in_batch_invariant_mode(res):
    assert res["invariant_lags_equal"]  # tokens and log-probs bit for bit, at lag 0 and 3
    assert res["invariant_passes"][0] != res["invariant_passes"][1]  # in other model calls


def test_episodes_carried_over_mid_episode_end_as_the_uninterrupted_run():
    """Partial rollouts with multi-turn samples (tiny_runs.py ``check_env_partial``): rows stopped at a
    quota call after call (also paused with their steps in flight: joined at the stop, the
    observation written into the response), through a checkpoint's JSON once (the environment
    instances rebuilt by replay), end with the tokens,
    observation masks, turns and rewards of the uninterrupted run at the same weights (fp32); the
    sampled log-probs agree up to a prefill's rounding, the observation tokens have none."""
    res = run_world("distributed/worlds/tiny_runs.py", 1)[0]["env_partial"]
    full, carried = res["full"], res["carried"]
    assert res["calls"] >= 3 and res["after_observation"] >= 1  # carried, also right after an observation
    assert res["in_flight"] >= 1  # a row paused with its step in flight at a stop: joined there
    assert res["replay_mismatches"][1] == 0 and not any(res["replay_mismatches"])
    for key in ("tokens", "mask", "spans", "scores", "turn_rewards"):
        assert carried[key] == full[key], key
    assert any(len(s) >= 2 for s in full["spans"]) and any(map(any, full["mask"]))  # several turns, observations
    for lp_full, lp, mask, versions in zip(full["logprobs"], carried["logprobs"], carried["mask"], carried["versions"]):
        assert all(v == 0.0 for v, m in zip(lp, mask) if m)
        assert max(abs(a - b) for a, b in zip(lp_full, lp)) < 1e-5
        assert versions == sorted(versions) and versions[0] == 0  # each token's call, in order
    assert max(max(v) for v in carried["versions"]) == res["calls"] - 1
