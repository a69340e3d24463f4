"""LoRA's flags (Megatron-Bridge's names) and the input refused at start, naming the flag."""

import pytest

from puzzle.arguments import ArgumentError, parse_args, validate_args
from puzzle.lora_config import LORA_TARGETS, LoRAConfig, check_lora, target_shapes
from tests.unit.test_arguments import BASE


def cfg(*extra):
    return validate_args(parse_args(BASE + list(extra)), 4, 259)


def test_no_lora_by_default():
    lora = cfg().lora
    assert not lora.enabled and lora.target_modules == LORA_TARGETS


def test_flags_fill_the_config_with_bridges_defaults():
    lora = cfg("--lora-dim", "8").lora
    assert (lora.dim, lora.alpha, lora.dropout, lora.target_modules) == (8, 32.0, 0.0, LORA_TARGETS)
    assert lora.scale == 4.0
    lora = cfg("--lora-dim", "4", "--lora-alpha", "8", "--lora-dropout", "0.1",
               "--lora-target-modules", "linear_qkv, linear_fc2").lora
    assert (lora.dim, lora.alpha, lora.dropout, lora.target_modules) == (4, 8.0, 0.1, ("linear_qkv", "linear_fc2"))


@pytest.mark.parametrize("extra, flag, words", [
    (["--lora-dim", "0"], "--lora-dim", "must be > 0"),
    (["--lora-dim", "-2"], "--lora-dim", "must be > 0"),
    (["--lora-dim", "65"], "--lora-dim", "larger than linear_"),   # hidden 64: every target's smaller side
    (["--lora-dim", "4", "--lora-target-modules", "linear_qkv,q_proj"], "--lora-target-modules", "q_proj"),
    (["--lora-dim", "4", "--lora-target-modules", ","], "--lora-target-modules", "nothing"),
    (["--lora-dim", "4", "--lora-alpha", "0"], "--lora-alpha", "must be > 0"),
    (["--lora-dim", "4", "--lora-dropout", "1"], "--lora-dropout", "[0, 1)"),
    (["--lora-alpha", "16"], "--lora-alpha", "needs --lora-dim"),
])
def test_bad_lora_input_names_the_flag(extra, flag, words):
    with pytest.raises(ArgumentError) as e:
        cfg(*extra)
    assert str(e.value).startswith(flag + ":") and words in str(e.value), str(e.value)


def test_checkpoints_and_a_pretrained_base_are_accepted(tmp_path):
    assert cfg("--lora-dim", "4", "--save", str(tmp_path / "ckpt"), "--load", str(tmp_path / "ckpt")).lora.dim == 4


def test_the_reference_of_a_lora_actor_is_its_base():
    kl = ["--kl-coef", "0.1"]
    plain, lora = cfg(*kl), cfg("--lora-dim", "4", *kl)
    assert "ref" in plain.roles and not plain.reference_is_actor_base
    assert "ref" not in lora.roles and lora.reference_is_actor_base  # no reference model is built
    assert not cfg("--lora-dim", "4", "--kl-coef", "0").reference_is_actor_base  # no KL: no reference at all
    assert cfg("--lora-dim", "4", "--kl-coef", "0", "--use-kl-loss").reference_is_actor_base
    with pytest.raises(ArgumentError, match="^--ref-num-layers: the run builds no ref model .*LoRA actor's base"):
        cfg("--lora-dim", "4", *kl, "--ref-num-layers", "2")


def test_a_generation_layout_of_its_own_is_accepted():
    run = cfg("--lora-dim", "4", "--actor-gen-tensor-model-parallel-size", "2")
    assert run.lora.dim == 4 and run.roles["actor"].gen_plan != run.roles["actor"].plan


def test_a_generation_pool_is_refused_for_now():
    with pytest.raises(ArgumentError, match="^--actor-gen-rank-offset: a LoRA actor's generation pool"):
        cfg("--lora-dim", "4", "--rl-desired-lag", "1", "--actor-gen-rank-offset", "2",
            "--rl-inference-logprobs-is-correction")


def test_rank_limit_is_the_target_layers_smaller_side():
    # hidden 64, 4 heads, ffn 4*64 with SwiGLU: qkv 192x64, proj 64x64, fc1 512x64, fc2 64x256
    assert cfg("--lora-dim", "64").lora.dim == 64
    arch = cfg().roles["actor"].arch
    assert target_shapes(arch) == {"linear_qkv": (192, 64), "linear_proj": (64, 64),
                                   "linear_fc1": (512, 64), "linear_fc2": (64, 256)}


def test_moe_experts_get_adapters_up_to_their_smaller_side():
    moe = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32"]
    assert cfg("--lora-dim", "32", *moe).lora.target_modules == LORA_TARGETS  # the experts' fc1 and fc2 too
    with pytest.raises(ArgumentError, match="^--lora-dim: 33 is larger than an expert's linear_fc2's smaller side 32"):
        cfg("--lora-dim", "33", *moe)
    assert cfg("--lora-dim", "33", "--lora-target-modules", "linear_qkv,linear_proj", *moe).lora.dim == 33
    with pytest.raises(ArgumentError, match="^--lora-dim: 4 with --moe-grouped-gemm: .* a multiple of 8"):
        cfg("--lora-dim", "4", "--moe-grouped-gemm", *moe)
    assert cfg("--lora-dim", "8", "--moe-grouped-gemm", *moe).lora.dim == 8


def test_config_checks_itself():
    with pytest.raises(ArgumentError, match="^--lora-dim: must be > 0"):
        LoRAConfig(dim=0)


def test_transformer_engine_layers_are_refused_for_now():
    arch = cfg().roles["actor"].arch
    with pytest.raises(ArgumentError, match="^--lora-dim: needs --transformer-impl local for now"):
        check_lora(LoRAConfig(dim=4), arch, "transformer_engine")
    check_lora(LoRAConfig(), arch, "transformer_engine")  # no LoRA: nothing to refuse


def test_critic_lora_has_its_own_flags_and_shares_nothing_with_the_actors():
    run = cfg("--lora-dim", "8")
    assert run.lora.dim == 8 and not run.critic_lora.enabled  # the actor's LoRA is not the critic's
    run = cfg("--critic-lora-dim", "4", "--critic-lora-alpha", "8", "--critic-lora-target-modules", "linear_qkv")
    assert not run.lora.enabled and run.role_lora("critic") == LoRAConfig(dim=4, alpha=8.0, target_modules=("linear_qkv",))
    assert run.role_lora("ref") == LoRAConfig()


@pytest.mark.parametrize("extra, flag, words", [
    (["--critic-lora-dim", "0"], "--critic-lora-dim", "must be > 0"),
    (["--critic-lora-alpha", "8"], "--critic-lora-alpha", "needs --critic-lora-dim"),
    (["--critic-lora-dim", "65"], "--critic-lora-dim", "65 is larger than linear_qkv's smaller side 64"),
    (["--critic-lora-dim", "4", "--advantage-estimator", "grpo", "--n-samples-per-prompt", "4"],
     "--critic-lora-dim", "the run builds no critic model"),
])
def test_critic_lora_bad_input_names_the_critics_flag(extra, flag, words):
    with pytest.raises(ArgumentError, match=f"^{flag}: .*{words}"):
        cfg(*extra)
