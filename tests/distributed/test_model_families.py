"""Llama-3.x, Qwen2, Qwen3, Mistral through import, generation, export, switch and checkpoints.

One 4-rank gloo world (tests/distributed/worlds/model_families.py) runs every check."""

import pytest

from tests.harness import run_world

import safetensors  # noqa: F401  (the [hf] extra)
import transformers  # noqa: F401

FAMILIES = ["llama3", "qwen2", "qwen3", "mistral"]
LAYOUTS = ["(P=1, D=1, T=1)", "(P=2, D=1, T=2)", "(P=1, D=1, T=4)"]


@pytest.fixture(scope="module")
def world():
    return run_world("distributed/worlds/model_families.py", 4, timeout=400)


@pytest.mark.parametrize("fam", FAMILIES)
def test_family_features_read_from_config(world, fam):
    a = world[0]["families"][fam]["arch"]
    assert a == {"llama3": dict(qkv_bias=False, qk_layernorm=False, kv_channels=8, rope_scaling=True, tied=False),
                 "qwen2": dict(qkv_bias=True, qk_layernorm=False, kv_channels=8, rope_scaling=False, tied=True),
                 "qwen3": dict(qkv_bias=False, qk_layernorm=True, kv_channels=16, rope_scaling=False, tied=False),
                 "mistral": dict(qkv_bias=False, qk_layernorm=False, kv_channels=8, rope_scaling=False,
                                 tied=False)}[fam]
    assert world[0]["families"][fam]["names_in_spec_order"] is True
    # dist-checkpoint keys are the transformer_engine names: either spec loads the other's files
    assert world[0]["families"][fam]["ckpt_keys_are_te_names"] is True


@pytest.mark.parametrize("fam", FAMILIES)
def test_logprobs_and_values_match_transformers(world, fam):
    r = world[0]["families"][fam]
    for layout in LAYOUTS:
        assert r["lp_err"][layout] < 1e-4, (layout, r["lp_err"])
    assert r["value_err"] < 1e-4, r["value_err"]


@pytest.mark.parametrize("fam", FAMILIES)
def test_greedy_generation_matches_transformers(world, fam):
    r = world[0]["families"][fam]
    assert all(r["greedy"][layout] for layout in LAYOUTS), r["greedy"]
    assert r["greedy_eos"] and r["eos_shortens"], r  # two stop ids, as in generation_config.json


@pytest.mark.parametrize("fam", FAMILIES)
def test_export_round_trips_bitwise(world, fam):
    assert world[0]["families"][fam]["export"] == {"same_keys": True, "bitwise": True}


@pytest.mark.parametrize("fam", FAMILIES)
def test_switch_and_resume_across_layouts(world, fam):
    r = world[0]["families"][fam]
    assert r["switch_bitwise"] and r["switch_lp_err"] < 1e-4, r
    assert r["resume"] == {"differs_before": True, "bitwise": True}, r["resume"]


def test_generate_and_export_tools(world):
    res = dict(world[0]["tool"])
    assert res.pop("export_tool") == {"same_keys": True, "bitwise": True, "model_type": "llama"}
    assert len(res) == len(FAMILIES) + 2, sorted(res)
    for key, r in res.items():
        assert r["equal"] and r["fields"] == ["prompt", "response", "tokens"], (key, r)
