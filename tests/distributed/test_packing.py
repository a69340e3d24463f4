"""Packed scoring and training (--use-remove-padding) give the padded path's per-token numbers
within fp32 rounding: log-probs, entropy, values, reward-model scores, advantages, returns and the
gradients of a training mini-batch, for PPO and GRPO at (1,4,1), (2,1,2) time-shared with the
switch, and (1,2,2) (tests/distributed/worlds/packing.py, one 4-rank world); with every row as
long as the padded width, the padded path's numbers exactly (PPO). The batch assembled by gathers
in each field's dtype has the bits of the old float64 all-reduce assembly, and moves no float64."""

import math

import pytest

from tests.harness import run_world

CASES = [f"{name}/{layout}" for name in ("ppo", "grpo") for layout in ("141", "212_ts_switch", "122")]


@pytest.fixture(scope="module")
def world():
    return run_world("distributed/worlds/packing.py", 4)


@pytest.mark.parametrize("case", CASES)
def test_packed_equals_padded_per_token(world, case):
    for rank, res in enumerate(world):
        out = res["packed_equals_padded"][case]
        assert out["packed_tokens"] < out["padded_tokens"], (rank, case)  # the padding was dropped
        assert out["switch"] == ("ts_switch" in case)
        kl = out.pop("kl_at_iteration_1")  # the reference holds the actor's weights and layout
        assert kl["padded"] == 0.0 and kl["packed"] == 0.0 and kl["old_minus_ref_packed"] == 0.0, (rank, case, kl)
        if case == "ppo/122":  # T=2 packed; planted: the reference one ulp off moves it
            assert kl["packed_ref_nudged"] != 0.0, (rank, case, kl)
        fields = [k for k, v in out.items() if isinstance(v, dict)]
        assert {"old_logprobs", "ref_logprobs", "entropy", "advantages", "returns", "actor_grad"} <= set(fields)
        if case.startswith("ppo"):
            assert {"values", "scores", "critic_grad"} <= set(fields)
        if case.startswith("ppo"):  # equal lengths: the padded path's computation, bit for bit
            assert {"equal_old_logprobs", "equal_values", "equal_scores", "equal_actor_grad",
                    "equal_critic_grad"} <= set(fields)
        for k in fields:
            diff, scale = out[k]["diff"], out[k]["scale"]
            assert math.isfinite(diff) and scale > 0, (rank, case, k, out[k])
            if k.startswith("equal_"):
                assert diff == 0.0, (rank, case, k, diff, scale)
            tol = 1e-4 * scale if k.endswith("_grad") else 2e-6 * max(1.0, scale)
            assert diff <= tol, (rank, case, k, diff, scale)


@pytest.mark.parametrize("case", [c for c in CASES if c.startswith("ppo")])
def test_generated_and_scored_batch_has_the_old_assembly_bits(world, case):
    for rank, res in enumerate(world):
        same = dict(res["packed_equals_padded"][case]["legacy_assembly_same_bits"])
        assert {"tokens", "response_lengths", "gen_logprobs", "old_logprobs", "entropy", "ref_logprobs",
                "values", "scores"} <= set(same), (rank, case, same)
        assert all(same.values()), (rank, case, same)


def test_assembly_gathers_give_the_old_bits_and_move_no_float64(world):
    for rank, res in enumerate(world):
        plans = res["assembly_gathers"]
        assert {"141", "212", "121_two_ranks", "141_E2"} <= set(plans)
        for plan, out in plans.items():
            assert out["same_bits"] and all(out["same_bits"].values()), (rank, plan, out["same_bits"])
            old, new = ({k: v for k, v in out[m].items() if k != "calls"} for m in ("bytes_old", "bytes_new"))
            assert old["float64"] > 0, (rank, plan, old)  # control: the old path summed float64 buffers
            assert "float64" not in new and new.get("float32", 0) > 0, (rank, plan, new)
            assert sum(new.values()) < sum(old.values()), (rank, plan, old, new)
