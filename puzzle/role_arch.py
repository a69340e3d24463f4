"""Each role's model shape (ModelArch) as the command line gives it: from its HF ``config.json``,
a Megatron-LM checkpoint's args, or the model flags (role-prefixed overrides over the actor's). A
flag that repeats a checkpoint must agree with it; the run's own choices (dropout, attention
kernel, init of fresh heads) apply on top. puzzle.arguments.validate_args calls ``role_arch``."""

from __future__ import annotations

import os
from dataclasses import replace
from typing import List, Optional

from puzzle.config import ROLES, ModelArch
from puzzle.config_flags import field_value, flag_name, flagged_fields, flags_given, from_args, role_flags_given
from puzzle.flag_checks import ArgumentError
from puzzle.flag_checks import fail as _fail
from puzzle.models.megatron_checkpoint import find_megatron_checkpoint

def role_value(args, role: str, flag: str):
    """``--<role>-<flag>`` when given, else the actor's ``--<flag>``."""
    attr = flag.replace("-", "_")
    if role != "actor":
        v = getattr(args, f"{role}_{attr}", None)
        if v is not None:
            return v
    return getattr(args, attr)


#: the model-shape flags a role may override (--critic-num-layers): flag -> ModelArch field
_SHAPE_FLAGS = {name[2:]: f.name for f, spec, name, _ in flagged_fields(ModelArch) if spec.roles}
#: the llama3 RoPE parameters (flags left unset: Megatron-LM's defaults)
_ROPE_FIELDS = ("rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor",
                "rope_original_max_position_embeddings")


def role_arch(args, role: str, vocab_size: int):
    """The role's ModelArch: from its HF ``config.json`` when one is at hand (flags may only
    repeat it; a critic/reward without a checkpoint of its own takes the actor's shape, as its
    model flags default to the actor's, unless role-prefixed shape flags describe it), else from
    the model flags."""
    own = _hf_dir_for(args, role)
    hf, source_flag = (own, ROLES[role].hf_path_flag) if own else \
        (args.hf_actor_path, "--hf-actor-path")
    own_shape_flags = role != "actor" and role_flags_given(ModelArch, args, role)
    megatron = _megatron_dir_for(args, role)
    if not megatron and not own and not own_shape_flags:
        megatron = args.pretrained_checkpoint  # the critic/reward shape defaults to the actor's
    if megatron and find_megatron_checkpoint(megatron) is not None:
        return _arch_from_megatron(args, role, vocab_size, megatron)
    if hf and os.path.isfile(os.path.join(hf, "config.json")) and (own or not own_shape_flags):
        return _arch_from_hf(args, role, vocab_size, hf, source_flag)

    for flag in ("num-layers", "hidden-size", "num-attention-heads"):
        if role_value(args, role, flag) is None:
            _fail(f"--{flag}", "is required (or --hf-actor-path/--hf-critic-path/--hf-reward-path DIR "
                               "with a config.json)")
    groups = role_value(args, role, "num-query-groups")
    if args.group_query_attention and groups is None:
        _fail("--num-query-groups", "is required with --group-query-attention")
    if groups is not None and not args.group_query_attention:
        _fail(f"--{ROLES[role].flag_prefix}num-query-groups", "needs --group-query-attention (without it "
              "every attention head has its own keys and values, as in Megatron-LM)")
    if _rope_flags_given(args) and not args.use_rope_scaling:
        _fail("--rope-scaling-factor", "the llama3 RoPE parameters need --use-rope-scaling")
    if args.rotary_base is not None and args.position_embedding_type != "rope":
        _fail("--rotary-base", "needs --position-embedding-type rope")
    overrides = {} if args.group_query_attention else {"num_query_groups": None}
    return role_config(ModelArch, args, role, vocab_size=args.vocab_size or vocab_size, **overrides)


def role_config(cls, args, role: str, **kwargs):
    """``from_args`` for one role; the error of a field the role set with its own flag names that
    flag (--critic-hidden-size, not --hidden-size)."""
    try:
        return from_args(cls, args, for_role=role, **kwargs)
    except ArgumentError as e:
        flag, _, message = str(e).partition(": ")
        own = {flag_name(cls, field): option for option, field in role_flags_given(cls, args, role)}
        if flag in own:
            _fail(own[flag], message)
        _fail(flag, message if role == "actor" else f"{role}: {message}")


# model-shape flag -> HF config.json field
_HF_SHAPE_FIELDS = {"num-layers": "num_hidden_layers", "hidden-size": "hidden_size",
                    "ffn-hidden-size": "intermediate_size", "num-attention-heads": "num_attention_heads",
                    "num-query-groups": "num_key_value_heads", "kv-channels": "head_dim"}


#: ModelArch fields an HF checkpoint decides: a flag given for one must agree with it (the shape
#: flags are compared per role above; seq length, vocabulary and position bounds below)
_HF_DECIDES = ("normalization", "norm_epsilon", "swiglu", "position_embedding_type", "rotary_base",
               "untie_embeddings_and_output_weights", "add_bias_linear", "add_qkv_bias", "qk_layernorm",
               "use_rope_scaling", "num_experts", "moe_ffn_hidden_size", "moe_router_topk",
               "moe_router_pre_softmax") + _ROPE_FIELDS
#: ModelArch fields that are the run's, not the checkpoint's
_RUN_FIELDS = ("attention_dropout", "hidden_dropout", "attention_backend", "init_method_std",
               "moe_aux_loss_coeff", "moe_router_load_balancing_type", "moe_token_dispatcher_type",
               "moe_grouped_gemm")


def _rope_flags_given(args) -> List[str]:
    return [field for field in _ROPE_FIELDS if getattr(args, field) is not None]


def _hf_dir_for(args, role: str) -> Optional[str]:
    return getattr(args, f"hf_{ROLES[role].weights_from}_path")


def _megatron_dir_for(args, role: str) -> Optional[str]:
    return getattr(args, ROLES[role].pretrained_flag[2:].replace("-", "_"))


def _arch_from_megatron(args, role: str, vocab_size: int, root: str):
    """The architecture in a Megatron-LM checkpoint's args; flags may only repeat it."""
    from puzzle.models.megatron_checkpoint import arch_from_megatron_args, read_common_state

    ckpt = find_megatron_checkpoint(root)
    flag = "--load" if root == args.load else ROLES[role].pretrained_flag
    try:
        arch = arch_from_megatron_args(read_common_state(ckpt)["args"], ckpt.dir, seq_length=args.seq_length)
    except ValueError as e:
        _fail(flag, str(e))
    return _checked_against_flags(args, role, vocab_size, arch, os.path.join(ckpt.dir, "common.pt"), flag)


def _arch_from_hf(args, role: str, vocab_size: int, hf_dir: str, flag_of_role: str):
    """The checkpoint's architecture; a shape flag that disagrees with it is an error naming both."""
    from puzzle.models.hf_checkpoint import arch_from_hf_dir

    cfg_path = os.path.join(hf_dir, "config.json")
    try:
        arch = arch_from_hf_dir(hf_dir, seq_length=args.seq_length,
                                make_vocab_size_divisible_by=args.make_vocab_size_divisible_by)
    except (ValueError, OSError) as e:
        _fail(flag_of_role, str(e))
    return _checked_against_flags(args, role, vocab_size, arch, cfg_path, flag_of_role)


def _checked_against_flags(args, role: str, vocab_size: int, arch, cfg_path: str, flag_of_role: str):
    """``arch`` (read from the checkpoint file ``cfg_path``) with the run's own choices on top;
    a model flag that disagrees with the checkpoint is an error naming both."""
    prefix = ROLES[role].flag_prefix
    for flag, hf_field in _HF_SHAPE_FIELDS.items():
        field, given = _SHAPE_FLAGS[flag], role_value(args, role, flag)
        if given is not None and given != getattr(arch, field):
            _fail(f"--{prefix}{flag}", f"{given} conflicts with {cfg_path} ({hf_field}={getattr(arch, field)}); "
                                       f"drop the flag: {flag_of_role} sets the {role} shape")
    given = flags_given(ModelArch, args)
    for field, flag in given.items():
        value, theirs = field_value(ModelArch, args, field), getattr(arch, field)
        if field in _HF_DECIDES and (value != theirs or field in _ROPE_FIELDS and not arch.use_rope_scaling):
            what = f"whose model has no {field}" if theirs is False else f"({field}={theirs})"
            if field in _ROPE_FIELDS:
                what = f"(use_rope_scaling={arch.use_rope_scaling}, {field}={theirs})"
            _fail(flag, f"{'' if value is True else f'{value} '}conflicts with {cfg_path} {what}; drop the flag: "
                        f"{flag_of_role} sets the {role} model")
    if "max_position_embeddings" in given and args.max_position_embeddings > arch.max_position_embeddings:
        _fail("--max-position-embeddings", f"{args.max_position_embeddings} exceeds the "
                                           f"{arch.max_position_embeddings} of {cfg_path}")
    if "vocab_size" in given and args.vocab_size != arch.vocab_size:
        _fail("--vocab-size", f"{args.vocab_size} conflicts with {cfg_path} (vocab_size={arch.vocab_size})")
    # a tokenizer with more ids than the checkpoint's rows (an added pad) is fine while no id the run
    # feeds lies beyond them: puzzle.data.tokenizers.fit_to_rows checks that once the prompts are read
    # the run's choices apply on top of the checkpoint (dropout, attention kernel, init of fresh heads)
    return replace(arch, **{field: field_value(ModelArch, args, field) for field in _RUN_FIELDS
                            if field in given or field != "init_method_std"})
