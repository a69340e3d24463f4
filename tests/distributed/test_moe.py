"""Qwen3-MoE and Mixtral through import, critic heads, puzzle.tools.generate and export_hf.

One 4-rank gloo world (tests/distributed/worlds/moe.py) runs every check."""

import pytest

from tests.harness import run_world

import safetensors  # noqa: F401  (the [hf] extra)
import transformers  # noqa: F401

FAMILIES = ["qwen3_moe", "mixtral"]


@pytest.fixture(scope="module")
def world():
    return run_world("distributed/worlds/moe.py", 4, timeout=400)


@pytest.fixture(scope="module")
def one_rank():
    """The same script in a world of one: puzzle.tools.generate at (1,1,1,1)."""
    return run_world("distributed/worlds/moe.py", 1)[0]


def test_moe_fields_read_from_config(world):
    got = {fam: world[0]["import"][fam]["arch"] for fam in FAMILIES}
    assert got == {
        "qwen3_moe": dict(num_experts=4, topk=2, pre_softmax=True, moe_ffn=32, ffn=96, pattern=[1, 0]),
        "mixtral": dict(num_experts=4, topk=2, pre_softmax=False, moe_ffn=48, ffn=48, pattern=None)}


@pytest.mark.parametrize("fam", FAMILIES)
def test_logprobs_and_values_match_transformers(world, fam):
    r = world[0]["import"][fam]
    assert len(r["lp_err"]) == 2 and max(r["lp_err"].values()) < 1e-4, r["lp_err"]
    assert len(r["value_err"]) == 2 and max(r["value_err"].values()) < 1e-4, r["value_err"]


@pytest.mark.parametrize("fam", FAMILIES)
def test_greedy_generation_matches_transformers(world, one_rank, fam):
    assert world[0]["import"][fam]["greedy_1111"] is True
    assert world[0]["tools"][fam]["greedy"] == {
        "qwen3_moe": {"(1,4,1,4)": True, "(1,2,2,2)": True},
        "mixtral": {"(2,2,1,2)": True, "(1,2,2,2) ETP=1": True}}[fam]
    assert one_rank["tools"][fam] == {"greedy": {"(1,1,1,1)": True}}


@pytest.mark.parametrize("fam", FAMILIES)
def test_export_tool_round_trips_bitwise(world, fam):
    assert world[0]["tools"][fam]["export"] == {"same_keys": True, "bitwise": True, "same_arch": True}
