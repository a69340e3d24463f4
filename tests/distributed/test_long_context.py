"""Memory levers of long sequences change no number (tests/distributed/worlds/long_context.py)."""

import pytest

from tests.harness import run_world


@pytest.fixture(scope="module")
def world():
    return run_world("distributed/worlds/long_context.py", 2)


def test_recompute_gives_the_same_gradients(world):
    for res in world:
        r = res["recompute_gradients"]
        assert r["ref_norm"] > 0
        for name, v in r.items():
            if name != "ref_norm":
                assert v["equal"], (name, v)


def test_chunked_logprobs_at_tp2(world):
    for res in world:
        r = res["chunked_logprobs_tp2"]
        assert r["grad_sum"] > 0
        assert r["max_diff_1"] < 1e-5 and r["max_diff_5"] < 1e-5, r
