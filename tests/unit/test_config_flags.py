"""Flags defined on config fields (puzzle/config_flags.py): defaults agree, configs check themselves."""

import pytest

from puzzle.arguments import FLAG_CONFIGS, ArgumentError, build_parser, parse_args
from puzzle.config import MemoryLevers, ModelArch, Operations, OptimConfig, PPOParams, RunConfig
from puzzle.config_flags import field_value, flag_name, flagged_fields, from_args, role_flag
from puzzle.plan_layouts import LayoutFlags


def test_each_flag_defined_once_with_the_fields_default():
    parser = build_parser()
    options = [o for a in parser._actions for o in a.option_strings]
    assert len(options) == len(set(options))
    args = parse_args([])
    for cls in FLAG_CONFIGS:
        for f, spec, name, dest in flagged_fields(cls):
            own = [] if spec.kind == "switches" or spec.role_only else [name]
            for option in own + [o for o, _, _ in spec.switches] + [role_flag(spec, name, r) for r in spec.roles]:
                assert option in options, option
            if f.name != "transformer_impl":  # the field holds the resolved implementation
                assert field_value(cls, args, f.name) == f.default, name


def test_role_flags_override_the_field_for_their_role_only():
    args = parse_args(["--hidden-size", "64", "--critic-hidden-size", "32", "--lr", "0.1", "--critic-lr", "0.2",
                       "--tensor-model-parallel-size", "2", "--reward-tensor-model-parallel-size", "4",
                       "--critic-rank-offset", "2", "--actor-gen-pipeline-model-parallel-size", "3"])
    assert field_value(ModelArch, args, "hidden_size", "critic") == 32
    assert field_value(ModelArch, args, "hidden_size", "reward") == 64
    assert (from_args(OptimConfig, args).lr, from_args(OptimConfig, args, "critic").lr) == (0.1, 0.2)
    layouts = {r: from_args(LayoutFlags, args, r) for r in ("actor", "critic", "reward")}
    assert [layouts[r].tensor_model_parallel_size for r in layouts] == [2, 2, 4]
    assert [layouts[r].rank_offset for r in layouts] == [0, 2, 0]
    actor = layouts["actor"]
    gen = from_args(LayoutFlags, args, "actor-gen", fallback=actor)
    assert (gen.tensor_model_parallel_size, gen.pipeline_model_parallel_size) == (2, 3)


@pytest.mark.parametrize("argv,expected", [
    ([], "auto"), (["--use-flash-attn"], "flash"), (["--attention-backend", "local"], "local"),
    (["--use-flash-attn", "--attention-backend", "flash"], "flash"),
    (["--use-flash-attn", "--attention-backend", "auto"], "--use-flash-attn/--attention-backend:"),
    (["--bf16", "--fp16"], "--bf16/--fp16: choose one"),
])
def test_switches_set_their_field(argv, expected):
    args = parse_args(argv)
    field, cls = ("precision", RunConfig) if "--bf16" in argv else ("attention_backend", ModelArch)
    if expected.startswith("--"):
        with pytest.raises(ArgumentError) as e:
            field_value(cls, args, field)
        assert str(e.value).startswith(expected)
    else:
        assert field_value(cls, args, field) == expected


def test_from_args_reads_every_flagged_field():
    args = parse_args(["--seq-length", "64", "--kl-coef", "0.3", "--no-whiten-advantages", "--exit-interval",
                       "4", "--lr", "0.002", "--no-grpo-std-normalization"])
    ppo = from_args(PPOParams, args)
    assert (ppo.kl_coef, ppo.whiten_advantages, ppo.grpo_std_normalization) == (0.3, False, False)
    assert from_args(Operations, args).exit_interval == 4 and from_args(OptimConfig, args).lr == 0.002


@pytest.mark.parametrize("cls,kwargs,flag", [
    (Operations, {"exit_interval": 0}, "--exit-interval"),
    (Operations, {"wandb_exp_name": "x"}, "--wandb-exp-name"),
    (OptimConfig, {"adam_beta2": 1.0}, "--adam-beta2"),
    (PPOParams, {"top_p": 0.0}, "--top-p"),
    (PPOParams, {"overlong_buffer_len": 17}, "--overlong-buffer-len"),
])
def test_configs_check_themselves_naming_the_flag(cls, kwargs, flag):
    with pytest.raises(ArgumentError) as e:
        cls(**kwargs)
    assert str(e.value).startswith(flag + ":")


def test_run_config_checks_its_fields():
    base = dict(world_size=4, roles={}, ppo=PPOParams(), optim=OptimConfig())
    assert RunConfig(**base).precision == "fp32"
    for kwargs, flag in (({"ckpt_step": 3}, "--ckpt-step"), ({"load_optim": False}, "--no-load-optim"),
                         ({"ranks_per_node": 3}, "--ranks-per-node"), ({"precision": "fp8"}, "--bf16/--fp16")):
        with pytest.raises(ArgumentError) as e:
            RunConfig(**base, **kwargs)
        assert str(e.value).startswith(flag + ":")
    assert flag_name(MemoryLevers, "recompute_granularity") == "--recompute-granularity"


def test_model_arch_defaults_are_megatron_lms_and_llama_is_named():
    a = ModelArch(num_layers=2, hidden_size=64, num_attention_heads=4)
    assert (a.normalization, a.position_embedding_type, a.swiglu, a.untie_embeddings_and_output_weights,
            a.add_bias_linear) == ("LayerNorm", "learned_absolute", False, False, True)
    assert (a.ffn_hidden_size, a.num_query_groups, a.kv_channels) == (256, 4, 16)
    llama = ModelArch.llama(num_layers=2, hidden_size=64, num_attention_heads=4)
    assert (llama.normalization, llama.position_embedding_type, llama.swiglu,
            llama.untie_embeddings_and_output_weights, llama.add_bias_linear) == ("RMSNorm", "rope", True, True, False)
    # the command line's defaults build the same model as the dataclass's
    args = parse_args(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "128"])
    assert from_args(ModelArch, args, vocab_size=256) == a


def test_aliases_fill_the_same_field():
    for argv, field, value in ((["--ppo-mini-batch-size", "4"], "mini_batch_size", 4),
                               (["--global-batch-size", "4", "--ppo-mini-batch-size", "8"], "mini_batch_size", 8),
                               (["--clip-eps-low", "0.1"], "clip_eps", 0.1)):
        assert field_value(PPOParams, parse_args(argv), field) == value
