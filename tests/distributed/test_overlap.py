"""--rl-desired-lag 1 on a training pool (ranks 0-1) and a generation pool (ranks 2-3), in the
4-rank world of tests/distributed/worlds/grpo_layouts.py (check_overlap): every trained token
carries the policy version it was sampled under (lag exactly 1 after the first iteration), the
loss reads the log-probs the generation pool sampled with, each batch is generated once and
trained once in order, and the first iteration (both runs at version 0) equals the synchronous
path's (lag 0 on the same pools) bitwise; the evaluation (--eval-prompts) of the lag-1 run equals
the synchronous run's at iteration 0 and is logged at the same iterations; a preempted lag-1 run
(SIGTERM under --exit-signal-handler while it generates batch 3) saves batch 3 in flight with its
checkpoint at iteration 2, and resumed from it repeats the uninterrupted run bitwise: at lag 1 at
the same layouts and with the training pool at (2,1,1), and at lag 0 (batch 3 trained first)."""

import pytest

from tests.harness import run_world

NOT_COMPARED = ("partial_", "generation_pool_seconds", "generation_policy_version", "switch_")
TIMING = ("generation_pool_seconds", "switch_")  # (the switch's bytes follow the layouts too)


@pytest.fixture(scope="module")
def world():
    return run_world("distributed/worlds/grpo_layouts.py", 4)


def _at(d, k):  # (JSON made the integer keys strings)
    return d[k] if k in d else d[str(k)]


def _rows(run):
    return {r["iteration"]: r for r in run["rows"]}


def _same(a, b, skip=TIMING):
    keys = {k for k in a if not k.startswith(skip)} | {k for k in b if not k.startswith(skip)}
    return {k: (a.get(k), b.get(k)) for k in sorted(keys) if a.get(k) != b.get(k)}


def test_versions_behaviour_logprobs_and_batches(world):
    lag1 = world[0]["overlap"]["lag1"]
    sampled = world[2]["overlap"]["lag1"]["sampled"]
    assert sorted(map(int, sampled)) == [1, 2, 3, 4] == sorted(map(int, lag1["trained"]))  # nothing more
    assert world[3]["overlap"]["lag1"]["sampled"] == sampled and world[1]["overlap"]["lag1"]["trained"] == lag1["trained"]
    rows = [r for r in lag1["rows"] if r["iteration"] > 0]
    assert [r["iteration"] for r in rows] == [1, 2, 3, 4]
    assert [r["generation_policy_version"] for r in rows] == [0, 0, 1, 2]
    assert [r["partial_token_lag_max"] for r in rows] == [0.0, 1.0, 1.0, 1.0]
    for k in (1, 2, 3, 4):
        got = _at(lag1["trained"], k)
        tokens, logprobs = _at(sampled, k)
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
    assert _same(_rows(lag1)[1], _rows(lag0)[1], skip=NOT_COMPARED) == {}
    t0, t1 = _at(lag0["trained"], 1), _at(lag1["trained"], 1)
    assert t0["tokens"] == t1["tokens"] and t0["loss_behaviour"] == t1["loss_behaviour"]


def test_evaluation_at_the_synchronous_runs_iterations_and_weights(world):
    """Generated on the generation pool with the weights of the iteration, scored on the training
    pool: at iteration 0 (the same weights) the synchronous run's metrics, bitwise."""
    lag1, lag0 = _rows(world[0]["overlap"]["lag1"]), _rows(world[0]["overlap"]["lag0"])
    assert [k for k, r in lag1.items() if "eval/reward" in r] == [0, 2, 4]  # 0, --eval-interval 2, the end
    assert [k for k, r in lag0.items() if "eval/reward" in r] == [0, 2]  # (stopped by --exit-interval 2)
    assert set(lag1[0]) == set(lag0[0]) and {k for k in lag1[2] if k.startswith("eval/")} == {
        k for k in lag0[2] if k.startswith("eval/")}
    assert lag1[0] == lag0[0] and lag1[0]["eval/prompts"] == 4


def test_preempted_run_saves_its_batch_in_flight_and_resumes_as_uninterrupted(world):
    out = world[0]["overlap"]
    straight = _rows(out["lag1"])
    preempted = _rows(out["preempted"])
    assert list(preempted) == [0, 1, 2]  # the SIGTERM in round 3: saved and stopped after iteration 2
    assert all(_same(preempted[k], straight[k]) == {} for k in preempted)
    # the checkpoint holds batch 3 (sampled under version 1) as the generation pool sampled it
    assert out["in_flight"]["lag"] == 1 and [b[:2] for b in out["in_flight"]["batches"]] == [[3, 1]]
    assert out["in_flight"]["batches"][0][2] == _at(world[2]["overlap"]["lag1"]["sampled"], 3)[0]
    resumed = _rows(out["resumed"])
    assert list(resumed) == [3, 4] and "eval/reward" in resumed[4]
    for k in (3, 4):
        assert _same(resumed[k], straight[k]) == {}, k  # bitwise (rtol 0)
    for k, row in _rows(out["resumed_p2"]).items():  # the training pool at (2,1,1)
        # the gradient norm's sum of squares is reduced in the layout's order (per stage, then
        # across stages): within float32 rounding; every other metric bitwise
        assert _same(row, straight[k], skip=TIMING + ("actor_grad_norm",)) == {}, k
        assert row["actor_grad_norm"] == pytest.approx(straight[k]["actor_grad_norm"], rel=1e-6, abs=0)
    assert list(_rows(out["resumed_p2"])) == [3, 4]
    lag0 = _rows(out["resumed_lag0"])  # lag 0: batch 3 trains first (then the run is synchronous)
    assert list(lag0) == [3] and _same(lag0[3], straight[3]) == {}
