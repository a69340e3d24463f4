"""--rl-desired-lag 1 on a training pool (ranks 0-1) and a generation pool (ranks 2-3), in the
4-rank world of tests/distributed/worlds/grpo_layouts.py: every trained token carries the policy
version it was sampled under (lag exactly 1 after the first iteration), the loss reads the
log-probs the generation pool sampled with, each batch is generated once and trained once in
order, and the first iteration (both runs at version 0) equals the synchronous path's (lag 0 on
the same pools) bitwise."""

import pytest

from tests.harness import run_world

NOT_COMPARED = ("partial_", "generation_pool_seconds", "generation_policy_version", "switch_")


@pytest.fixture(scope="module")
def world():
    return run_world("distributed/worlds/grpo_layouts.py", 4)


def test_versions_behaviour_logprobs_and_batches(world):
    lag1 = world[0]["overlap"]["lag1"]
    sampled = world[2]["overlap"]["lag1"]["sampled"]
    assert sorted(map(int, sampled)) == [1, 2, 3] == sorted(map(int, lag1["trained"]))  # nothing more
    assert world[3]["overlap"]["lag1"]["sampled"] == sampled and world[1]["overlap"]["lag1"]["trained"] == lag1["trained"]
    rows = lag1["rows"]
    assert [r["iteration"] for r in rows] == [1, 2, 3]
    assert [r["generation_policy_version"] for r in rows] == [0, 0, 1]
    assert [r["partial_token_lag_max"] for r in rows] == [0.0, 1.0, 1.0]
    for k in (1, 2, 3):
        got = lag1["trained"][k] if k in lag1["trained"] else lag1["trained"][str(k)]
        tokens, logprobs = sampled[k] if k in sampled else sampled[str(k)]
        assert got["tokens"] == tokens  # the batch the generation pool sampled, whole and in order
        assert got["loss_behaviour"] == logprobs  # the loss's behaviour log-probs: as sampled, bitwise
        diff = 0.0
        for row_v, row_m, row_b, row_o in zip(got["versions"], got["mask"], got["loss_behaviour"], got["old"]):
            for v, m, b, o in zip(row_v, row_m, row_b, row_o):
                assert v == (max(0, k - 2) if m else -1), (k, v, m)
                if m:
                    diff = max(diff, abs(b - o))
        if k == 1:
            assert diff < 1e-5  # sampled and trained at version 0
        else:
            assert diff > 1e-4  # sampled one version before the one trained


def test_first_iteration_equals_the_synchronous_path(world):
    lag1, lag0 = world[0]["overlap"]["lag1"], world[0]["overlap"]["lag0"]
    a, b = lag1["rows"][0], lag0["rows"][0]
    keys = {k for k in a if not k.startswith(NOT_COMPARED)} | {k for k in b if not k.startswith(NOT_COMPARED)}
    assert {k: a.get(k) for k in keys} == {k: b.get(k) for k in keys}
    t0 = lag0["trained"][1] if 1 in lag0["trained"] else lag0["trained"]["1"]
    t1 = lag1["trained"][1] if 1 in lag1["trained"] else lag1["trained"]["1"]
    assert t0["tokens"] == t1["tokens"] and t0["loss_behaviour"] == t1["loss_behaviour"]
