"""Flags defined on config fields (puzzle/config_flags.py): defaults agree, configs check themselves."""

import pytest

from puzzle.arguments import ArgumentError, build_parser, parse_args
from puzzle.config import Operations, OptimConfig, PPOParams, RunConfig
from puzzle.config_flags import flag_name, flagged_fields, from_args

CONFIGS = (RunConfig, PPOParams, OptimConfig, Operations)


def test_each_flag_defined_once_with_the_fields_default():
    parser = build_parser()
    options = [o for a in parser._actions for o in a.option_strings]
    assert len(options) == len(set(options))
    args = parse_args(["--seq-length", "64"])
    for cls in CONFIGS:
        for f, spec, name, dest in flagged_fields(cls):
            assert name in options, name
            value = getattr(args, dest)
            assert ((not value) if spec.kind == "negated" else value) == f.default, name


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
    assert flag_name(RunConfig, "recompute") == "--recompute-activations"
