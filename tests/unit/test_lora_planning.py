"""A LoRA actor in the planner and its checkpoints' metadata (issue #39): adapters-only gradients
and optimizer state, no reference model (its base is the reference, a second actor forward in
scoring), and adapters refused on another base."""

import pytest

from puzzle.arguments import parse_args, validate_args
from puzzle.checkpoint_metadata import _lora_problems, base_fingerprint_problem
from puzzle.model_shape import lora_layer_params
from puzzle.plan_search.command import memory_estimate, stage_estimate
from puzzle.plan_search.cost_model import LLAMA_SHAPES, ModelRole, trained_params_on_stage
from puzzle.plan_search.profile_data import load_profile
from tests.unit.test_arguments import BASE

LORA = ["--lora-dim", "8", "--kl-coef", "0.1"]


def cfg(*extra):
    return validate_args(parse_args(BASE + list(extra)), 4, 259)


def test_adapter_parameters_split_like_their_linears():
    s = LLAMA_SHAPES["7B"]  # MHA: qkv 3h x h, proj h x h, SwiGLU fc1 2f x h, fc2 h x f
    h, f = s.hidden_size, s.ffn_hidden_size
    split, replicated = lora_layer_params(s, 8, ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"))
    assert split == 8 * (3 * h + h + 2 * f + f)  # B of the column linears, A of the row ones
    assert replicated == 8 * (h + h + h + h)
    role = ModelRole("actor", s, True, True, lora=(8, ("linear_qkv",)))
    assert trained_params_on_stage(role, 2, 4, 0) == s.num_layers // 2 * (8 * 3 * h / 4 + 8 * h)


def test_no_reference_model_is_priced_and_its_pass_is_the_actors():
    profile = load_profile("a100_80gb")
    plain, lora = cfg("--kl-coef", "0.1"), cfg(*LORA)
    with_ref = max(r.total for r in memory_estimate(plain, profile))
    without = max(r.total for r in memory_estimate(lora, profile))
    assert without < with_ref  # no reference weights; adapters' grads and Adam state instead of the actor's
    labels = {label for r in memory_estimate(lora, profile) for label, _ in r.items}
    assert not any(label.startswith("ref ") for label in labels) and "actor adapters" in labels
    # scoring: the actor's forward twice (itself, then its base), as the plain run's actor + reference
    assert stage_estimate(lora, profile)["scoring"] == pytest.approx(stage_estimate(plain, profile)["scoring"])


def test_dry_run_says_what_the_dropped_reference_saves(capsys):
    from puzzle.plan_search.command import print_dry_run

    assert print_dry_run(cfg(*LORA), load_profile("a100_80gb"))
    out = capsys.readouterr().out
    assert "actor LoRA: rank 8" in out and "reference: the actor's base (adapters off)" in out, out
    assert "GiB of weights saved per GPU" in out


def test_resuming_adapters_of_another_rank_or_onto_full_training_is_refused():
    c = cfg(*LORA)
    saved = {"lora": {"dim": 4, "target_modules": list(c.lora.target_modules)}}
    assert "dim: checkpoint 4 vs this run 8" in _lora_problems(c, "actor", saved)[0]
    assert "full-parameter training" in _lora_problems(c, "actor", {})[0]
    assert _lora_problems(c, "actor", {"lora": {"dim": 8, "target_modules": list(c.lora.target_modules)}}) == []


def test_adapters_on_another_base_are_refused_naming_both():
    meta = {"roles": {"actor": {"base": {"source": {"hf_path": "/a", "seed": 1}, "fingerprint": [1.0, 2.0]}}}}
    assert base_fingerprint_problem(meta, "actor", [1.0, 2.0], {"hf_path": "/moved", "seed": 1}) is None
    msg = base_fingerprint_problem(meta, "actor", [1.5, 2.0], {"hf_path": "/b", "seed": 1})
    assert "'/a'" in msg and "[1.0, 2.0]" in msg and "'/b'" in msg and "[1.5, 2.0]" in msg, msg


@pytest.mark.parametrize("targets", [("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"), ("linear_fc2",)])
def test_planner_counts_the_experts_adapters_as_the_model_has_them(targets):
    """A MoE model with a dense layer: the planner's adapter count (dense layers' MLPs, every expert's
    linears) is the number of adapter parameters the model builds, and the memory model holds the
    experts' adapters split over E with their gradients and Adam state."""
    from puzzle.config import ModelArch
    from puzzle.lora_config import LoRAConfig
    from puzzle.model_shape import lora_expert_layer_params
    from puzzle.switch.lora_merge import adapter_param_specs

    arch = ModelArch.llama(num_layers=4, hidden_size=64, ffn_hidden_size=96, num_attention_heads=8, num_query_groups=4,
                           vocab_size=200, num_experts=4, moe_ffn_hidden_size=32, moe_router_topk=2,
                           moe_layer_pattern=(1, 0, 1, 1))
    built = sum(s.numel for s in adapter_param_specs(arch, "actor", LoRAConfig(dim=8, target_modules=targets)))
    shape = arch.shape
    counted = shape.num_layers * (sum(lora_layer_params(shape, 8, targets)) + sum(lora_expert_layer_params(shape, 8, targets)))
    assert counted == built > 0
    moe = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32"]
    rows = memory_estimate(cfg(*LORA, *moe), load_profile("a100_80gb"))
    items = {label: b for r in rows for label, b in r.items}
    assert items["actor expert adapters"] > 0 and items["actor expert grads"] == 2 * items["actor expert adapters"]
    assert "actor expert weights" in items  # the frozen experts themselves: weights only


def test_planner_and_dry_run_know_a_lora_critic(capsys):
    from puzzle.plan_search.command import print_dry_run

    profile = load_profile("a100_80gb")
    full, lora = cfg(), cfg("--critic-lora-dim", "8")
    items = {label: b for r in memory_estimate(lora, profile) for label, b in r.items}
    plain = {label: b for r in memory_estimate(full, profile) for label, b in r.items}
    assert items["critic adapters"] > 0 and items["critic optimizer"] < plain["critic optimizer"] / 5
    assert items["actor optimizer"] == plain["actor optimizer"]  # the actor trains fully: nothing shared
    critic = ModelRole("critic", LLAMA_SHAPES["7B"], True, False, lora=(8, ("linear_qkv",)))
    h = LLAMA_SHAPES["7B"].hidden_size  # the value head [1, h] trains whole, on the last stage
    assert trained_params_on_stage(critic, 2, 4, 1) - trained_params_on_stage(critic, 2, 4, 0) == h
    assert print_dry_run(lora, profile)
    out = capsys.readouterr().out
    assert "critic LoRA: rank 8" in out and "its value head trained whole" in out and "actor LoRA" not in out, out
