"""Token-budget micro-batches (--use-dynamic-bsz) give the fixed-count path's numbers within fp32
rounding: scored fields, and the gradients of a training mini-batch, under every --loss-agg-mode
for PPO at (1,4,1) (DP ranks balanced by tokens, each with its own number of micro-batches), under
the default one for PPO at (2,1,2) time-shared with the switch and GRPO at (1,2,2) (tests/distributed/worlds/token_budget.py,
in a shared 4-rank world)."""

import math

import pytest

from puzzle.algorithms.losses import LOSS_AGG_MODES
from tests.harness import run_world

#: case -> the --loss-agg-modes whose gradients it compares (tests/distributed/worlds/token_budget.py)
CASES = {"ppo/141": LOSS_AGG_MODES, "ppo/212_ts_switch": LOSS_AGG_MODES[:1], "grpo/122": LOSS_AGG_MODES[:1]}


@pytest.fixture(scope="module")
def world():
    return run_world("distributed/worlds/token_budget.py", 4)


@pytest.mark.parametrize("case", CASES)
def test_budget_micro_batches_equal_fixed_count(world, case):
    outs = [res["budget_equals_fixed"][case] for res in world]
    assert any(max(out["rows_per_budget_micro_batch"]) >= 2 for out in outs)  # short rows share one
    for mode in CASES[case]:  # the two paths cut the rows differently
        assert any(len(set(out[f"micro_batches/{mode}"])) == 2 for out in outs), (case, mode)
    for rank, out in enumerate(outs):
        fields = [k for k, v in out.items() if isinstance(v, dict)]
        assert {"old_logprobs", "ref_logprobs", "entropy"} <= set(fields)
        assert {f"actor_grad/{mode}" for mode in CASES[case]} <= set(fields)
        for k in fields:
            diff, scale = out[k]["diff"], out[k]["scale"]
            assert math.isfinite(diff) and scale > 0, (rank, case, k, out[k])
            tol = 1e-4 * scale if "_grad/" in k else 2e-6 * max(1.0, scale)
            assert diff <= tol, (rank, case, k, diff, scale)


def test_dp_ranks_may_run_different_micro_batch_counts(world):
    counts = {res["budget_equals_fixed"]["ppo/141"]["micro_batches/token-mean"][1] for res in world}
    assert len(counts) > 1, counts  # and the gradients above still agree
