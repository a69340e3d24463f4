"""Qwen3-MoE and Mixtral through import, critic heads, puzzle.tools.generate and export_hf; LoRA on
their experts in the world of one.

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


# ---- LoRA on the experts (issue #39; tests/distributed/worlds/lora_experts.py) ----------------------
@pytest.mark.parametrize("experts", ["(1,1,1,1)", "(1,1,1,1) grouped"])
def test_expert_adapters_zero_b_and_gradients_equal_plain_pytorch(one_rank, experts):
    res = one_rank["lora_experts"]["grads"][experts]
    assert res["equal_bitwise"] and res["names"] and res["replicas_agree"], res
    assert res["expert_adapters"] == 16  # A and B of fc1 and fc2 of each of 4 experts (layer 0; layer 1 is dense)
    assert res["min_grad_max"] > 1e-4, "a reference gradient is zero: the check would pass vacuously"
    assert res["worst_relative_grad_error"] < 1e-5, res


def test_static_moe_decode_step_refuses_adapted_experts(one_rank):
    plain, adapted = one_rank["lora_experts"]["lean_decode"]
    assert plain == [True, True] and adapted == [False, False], (plain, adapted)


@pytest.mark.parametrize("fam", FAMILIES)
def test_expert_adapters_exported_give_puzzles_greedy_tokens_in_peft(one_rank, fam):
    res = one_rank["lora_experts"]["peft"]
    assert "missing" not in res, res["missing"]  # peft is the test extra's: without it this fails
    r = res[fam]
    assert r["peft"] == r["ours"] != r["base"], r  # the adapters change the tokens: the check has teeth
    assert r["expert_keys"] == 4 * {"qwen3_moe": 6, "mixtral": 12}[fam]  # A and B of 3 projections, 4 experts
