"""Intra-stage time-sharing executor (puzzle.pipeline.time_sharing_executor) vs megatron's sequential 1F1B.

One 4-rank gloo world (tests/distributed/worlds/time_sharing.py): two trainable models with
different hidden sizes (32, 64) and different microbatch counts, at P=2 (D=2), P=2 (T=2), P=4
and P=1; gradients, updated weights and last-stage outputs must be identical.
"""

import pytest

from tests.harness import run_world

TRAIN_CHECKS = ["train_p2", "train_p2_tp", "train_p4", "train_p1"]


@pytest.fixture(scope="module")
def world():
    return run_world("distributed/worlds/time_sharing.py", 4)


@pytest.mark.parametrize("check", TRAIN_CHECKS)
def test_grads_and_weights_identical(world, check):
    for r, res in enumerate(world):
        t = res[check]
        assert t["member"], (r, check)
        for m in ("A", "B"):
            assert t[f"grad_nonzero_{m}"], (r, check, m)
            assert t[f"grad_diff_{m}"] <= 1e-6, (r, check, m, t[f"grad_diff_{m}"])
            assert t[f"weight_diff_{m}"] <= 1e-6, (r, check, m, t[f"weight_diff_{m}"])
            assert t[f"reports_equal_{m}"] and t[f"outputs_equal_{m}"], (r, check, m)
        assert t["grad_norms_seq"] == pytest.approx(t["grad_norms_ts"], abs=1e-9)


@pytest.mark.parametrize("check", TRAIN_CHECKS)
def test_last_stage_collects_every_microbatch(world, check):
    per_stage = {}
    for res in world:
        t = res[check]
        per_stage.setdefault(t["stage"], []).append((t["n_reports_A"], t["n_reports_B"]))
    last = per_stage[max(per_stage)]
    assert all(a[0] == a[1] > 0 and b[0] == b[1] > 0 for a, b in last), last
    if len(per_stage) > 1:  # other stages return [] like megatron
        assert all(a == [0, 0] and b == [0, 0] for s, v in per_stage.items() if s != max(per_stage)
                   for a, b in v)


@pytest.mark.parametrize("check", ["train_p2", "train_p2_tp", "train_p4"])
def test_stream_is_time_shared_and_memory_bounded(world, check):
    for r, res in enumerate(world):
        t = res[check]
        assert t["mode"] == "time-shared", (r, check)
        assert t["peak_in_flight"] <= t["sequential_peak"], (r, check, t)
        assert t["peak_in_flight"] == t["expected_peak"], (r, check, t)


def test_next_model_warmup_fills_cooldown(world):
    """P=4 stage 0: context 1's first forward follows context 0's first backward (Fig. 5(b))."""
    stage0 = [res["train_p4"] for res in world if res["train_p4"]["stage"] == 0][0]
    order = stage0["order"].split()
    assert order[:7] == ["F0.0", "F0.1", "F0.2", "F0.3", "B0.0", "F1.0", "B0.1"]


def test_forward_only_outputs_identical(world):
    for res in world:
        assert res["forward_only"]["equal"]
        assert res["forward_only"]["mode"] == "time-shared"
    last = [res["forward_only"] for res in world if res["forward_only"]["stage"] == 3]
    assert last and last[0]["n"] == [3, 5, 3, 5]


def test_unequal_p_rejected(world):
    for res in world:
        u = res["unequal_p"]
        assert u["raised"]
        msg = u["message"]
        assert "time-sharing requires equal P for the contexts in a stream" in msg
        assert "actor" in msg and "critic" in msg and "P=2" in msg and "P=4" in msg


def test_memory_guard_falls_back_to_sequential(world):
    for res in world:
        g = res["memory_guard"]
        assert g["mode"] == "sequential"
        assert g["peak"] <= g["sequential_peak"]


def test_mixed_plans_agree_on_the_memory_guard(world):
    """Actor (2,1,2) and critic (2,2,1): the guards of the critic's two DP ranks decide differently;
    every rank runs the sequential program (what every rank's guard allows), with its gradients."""
    results = [res["mixed_plans_guard"] for res in world]
    assert {r["local_guard_ok"] for r in results} == {True, False}
    assert all(r["mode"] == "sequential" and r["bitwise"] for r in results)


@pytest.mark.parametrize("mode", ["fixed", "budget"])
def test_mixed_plans_ppo_time_shared_equals_sequential(world, mode):
    """PPO with the actor at (2,1,2), critic and reference at (2,2,1) on the same 4 ranks, scoring and
    training time-shared: the scored fields, gradients and loss sums of the sequential placement;
    bitwise with fixed-count micro-batches, within fp32 rounding with token budgets (where the
    critic's and reference's DP ranks get as many micro-batches when time-shared)."""
    outs = [res["mixed_plans_ppo"] for res in world]
    assert outs[0]["plans"] == {"actor": "(P=2, D=1, T=2)", "critic": "(P=2, D=2, T=1)",
                                "ref": "(P=2, D=2, T=1)", "reward": "(P=2, D=1, T=2)"}
    for rank, out in enumerate(outs):
        assert out[f"{mode}/stream"] == "time-shared"
        fields = [k for k, v in out.items() if k.startswith(mode + "/") and isinstance(v, dict) and "diff" in v]
        assert {f"{mode}/{k}" for k in ("old_logprobs", "ref_logprobs", "values", "scores",
                                        "actor_grad", "critic_grad")} <= set(fields)
        for k in fields:
            diff, scale = out[k]["diff"], out[k]["scale"]
            assert scale > 0, (rank, k)
            if mode == "fixed":
                assert out[k]["bitwise"], (rank, k, diff)
            else:
                assert diff <= (1e-4 * scale if k.endswith("_grad") else 2e-6 * max(1.0, scale)), (rank, k, diff)
        for role in ("actor", "critic"):
            seq, ts = out[f"{mode}/{role}_sums"]
            assert ts == (seq if mode == "fixed" else pytest.approx(seq, rel=1e-5, abs=1e-6)), (rank, role)
    # time-shared: each model has the same number of micro-batches on every rank; sequential need not
    for stage in ("micro_batches", "scoring_micro_batches"):
        ts = {tuple(out[f"{mode}/{stage}"]["time-sharing"]) for out in outs}
        assert len(ts) == 1, (stage, ts)
        if mode == "budget":
            assert outs[0]["budget"] > 0
            assert len({tuple(out[f"{mode}/{stage}"]["sequential"]) for out in outs}) > 1, stage
