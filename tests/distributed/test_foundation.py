import math

import pytest

from tests.harness import run_world


@pytest.fixture(scope="module")
def world():
    return run_world("distributed/worlds/foundation.py", 4)


def test_layouts_give_identical_logprobs(world):
    res = world[0]["layouts_agree"]
    ref = res["(P=1, D=1, T=1)"]
    assert len(ref) == 4 and len(ref[0]) == 11
    for plan, lp in res.items():
        assert len(lp) == len(ref), plan
        for row, ref_row in zip(lp, ref):
            for a, b in zip(row, ref_row):
                assert abs(a - b) < 1e-5, f"{plan}: {a} != {b}"
    # a sanity floor: log-probs of a random LM are near -log(vocab)
    assert all(-8 < x < 0 for row in ref for x in row)


def test_two_models_with_different_layouts_train(world):
    for r, res in enumerate(world):
        t = res["two_layouts_train"]
        assert t["actor_changed"] and t["critic_changed"], (r, t)
        assert math.isfinite(t["actor_grad_norm"]) and t["actor_grad_norm"] > 0
        assert math.isfinite(t["critic_grad_norm"]) and t["critic_grad_norm"] > 0
        assert t["value_shape"] == [1, 12, 1]
    # grad norms are global: identical on every rank of a model
    assert len({round(res["two_layouts_train"]["actor_grad_norm"], 6) for res in world}) == 1
