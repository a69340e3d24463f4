"""Megatron-LM checkpoints in and out (tests/distributed/worlds/megatron_checkpoint.py, in the
4-rank world shared with the HF import)."""

import pytest

from tests.harness import run_world


@pytest.fixture(scope="module")
def world():
    return run_world("distributed/worlds/megatron_checkpoint.py", 4)


def test_a_checkpoint_megatron_wrote_loads_at_other_layouts(world):
    res = world[0]["load"]
    assert res["ref_std"] > 0.3  # a non-degenerate reference
    for plan in ("(P=2, D=1, T=2)", "(P=1, D=1, T=1)"):  # written at (P=1, D=2, T=2)
        assert res[plan] < 1e-4, (plan, res)
    assert res["arch"] == [2, 64, 2, 256, True]  # the shape from the checkpoint's args


def test_a_reward_model_needs_a_scalar_head(world):
    err = world[0]["load"]["reward_from_lm"]
    assert err and "an LM checkpoint" in err and "make_value_model" in err


def test_export_loads_into_megatron_and_back(world):
    r = world[0]["export"]
    assert r["release"] and r["tracker"] == "release" and r["checkpoint_version"] == 3.0
    assert r["megatron_before_err"] > 0.1  # the plain model's own init is far off (negative control)
    assert r["megatron_err"] < 1e-5 and r["puzzle_err"] < 1e-4, r
    assert r["args_round_trip"]


def test_value_model_keeps_its_head(world):
    r = world[0]["value_model"]
    assert r["values_std"] > 0.01  # a normal-initialised head: values are not all zero
    assert r["values_err"] < 1e-5, r
