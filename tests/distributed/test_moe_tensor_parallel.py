"""The tiny MoE run trained at tensor parallelism T = 2 without sequence parallelism (each
tensor-parallel rank routing its share of the sequence; the actor's experts split over E = ETP = 2,
the critic's whole at E = ETP = 1) gives the metrics of the run at T = 1 and E = 2, up to fp32
reduction order. Checked in the 4-rank world of tests/distributed/worlds/moe_switch.py."""

import pytest

from puzzle.tools.compare_metrics import compare
from tests.harness import run_world


@pytest.fixture(scope="module")
def world():
    return run_world("distributed/worlds/moe_switch.py", 4)


def test_tiny_moe_run_at_tensor_parallel_2_matches_tensor_parallel_1(world):
    run = world[0]["tiny_run"]
    assert run["tensor_parallel_plans"]["actor"] == "(P=1, D=2, T=2, E=2) ETP=2"
    assert run["tensor_parallel_plans"]["critic"] == "(P=1, D=2, T=2, E=1, ETP=1) ETP=1"
    straight, tensor_parallel = run["straight"], run["tensor_parallel"]
    assert [r["iteration"] for r in tensor_parallel] == [1, 2]
    # the straight run trains at (1, 4, 1, E=2); the load-balancing loss and both gradient norms
    # (experts' and routers' gradients included) must agree, not only the rollouts
    for row in tensor_parallel:
        assert 0.5 < row["moe_aux_loss"] < 4.0 and row["actor_grad_norm"] > 0 and row["critic_grad_norm"] > 0
    # near-zero fields (the policy loss of a first PPO epoch) compare up to 1e-6 absolute
    assert compare(straight, tensor_parallel, rtol=1e-5, atol=1e-6) == []
