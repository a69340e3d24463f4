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
