"""Mixture-of-experts models on packed and token-budget micro-batches with their experts split over
E > 1 ranks, whose expert groups then hold different token counts per rank (the all-gather
dispatcher through megatron_patches.moe_allgather_token_counts; the all-to-all one at ETP > 1
through megatron_patches.moe_gloo_split_gather). Checked in the 4-rank world of
tests/distributed/worlds/moe_switch.py."""

import pytest

from tests.harness import run_world

#: tests/distributed/worlds/moe_switch.py PACKED_LAYOUTS
LAYOUTS = {"E1", "E2/allgather", "E2/alltoall", "T2E2/allgather", "T2E2/alltoall"}


@pytest.fixture(scope="module")
def world():
    return run_world("distributed/worlds/moe_switch.py", 4)


def test_packed_experts_at_e2_match_e1_with_both_dispatchers(world):
    """Every row's log-probs, the gradient norm and the load-balancing loss at E = 2 (T = 1 and 2,
    each dispatcher) equal E = 1's within fp32 rounding; the ranks' micro-batches really were
    packed ([1, tokens]) with different token counts within each expert group."""
    runs = world[0]["packed_experts"]
    assert set(runs) == LAYOUTS
    ref = runs["E1"]
    assert len(ref["logprobs"]) == 8 and ref["grad_norm"] > 0 and ref["aux_loss_sum"] > 0
    for name, run in runs.items():
        assert len(set(run["first_micro_batch_tokens"])) > 1, (name, run["first_micro_batch_tokens"])
        assert run["packed_shape"][0] == 1, name
        assert [len(r) for r in run["logprobs"]] == [len(r) for r in ref["logprobs"]]
        diff = max(abs(a - b) for x, y in zip(run["logprobs"], ref["logprobs"]) for a, b in zip(x, y))
        assert diff <= 2e-6, (name, diff)
        assert run["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-6), name
        assert run["aux_loss_sum"] == pytest.approx(ref["aux_loss_sum"], rel=1e-6), name


def test_token_budget_experts_match_fixed_count_and_run_equal_counts(world):
    """--use-dynamic-bsz at E = 2: the gradients of a PPO mini-batch equal the fixed-count path's
    within fp32 rounding; every DP rank runs as many budget micro-batches as the share that needs
    the most (their balanced shares alone would need different numbers)."""
    outs = [r["token_budget_experts"] for r in world]
    assert len({o["share_alone_needs"] for o in outs}) > 1
    for rank, o in enumerate(outs):
        assert o["micro_batches"] == [3, max(x["share_alone_needs"] for x in outs)], (rank, o)
        assert o["grad_scale"] > 0 and o["grad_diff"] <= 1e-5 * o["grad_scale"], (rank, o)


def test_aux_loss_metric_counts_the_micro_batches_each_rank_ran(world):
    for r in world:
        got = r["aux_loss_metric"]
        assert got["metric"] == pytest.approx(got["mean"], rel=1e-6)


def test_grouped_gemm_experts_match_sequential_experts(world):
    """--moe-grouped-gemm against megatron's SequentialMLP, the same packed training step at E = 1,
    at E = 2 (all-to-all) and at T = E = 2 (all-gather, ETP = 2): the grouped experts really ran,
    and the row log-probs, gradient norm, load-balancing loss, every parameter's gradient and the
    updated weights are bitwise equal on every rank (torch's CPU grouped product is one product
    per group, the one megatron's linear layers make)."""
    for rank in world:
        runs = rank["grouped_gemm_experts"]
        assert set(runs) == {"E1", "E2/alltoall", "T2E2/allgather"}
        for name, run in runs.items():
            ref, got = run["ref"], run["grouped"]
            assert run["experts"] == ["GroupedGemmExperts"], name
            diff = max(abs(a - b) for x, y in zip(got["logprobs"], ref["logprobs"]) for a, b in zip(x, y))
            assert len(got["logprobs"]) == 8 and diff == 0, (name, diff)
            assert got["grad_norm"] == ref["grad_norm"] > 0 and got["aux_loss_sum"] == ref["aux_loss_sum"], name
            assert run["grad_max_diff"] == 0 and run["params_max_diff"] == 0, (name, run)
