"""Megatron-style command line: argparse groups by topic, ``validate_args`` -> a frozen RunConfig.

The flags of RunConfig, PPOParams, OptimConfig and Operations are declared on their fields
(puzzle/config.py, ``flag(...)``) and added here by ``add_dataclass_args``; the model-shape,
layout and plan flags, which become per-role ModelArch and ParallelPlan objects, are declared in
the ``_add_<topic>_args`` functions below.

Megatron-LM flag names keep their meaning (model shape, batch, optimizer, parallelism, logging,
checkpoints). Critic, reward and reference models take role-prefixed overrides of the model-shape
and layout flags (``--critic-num-layers``, ``--reward-hidden-size``,
``--critic-tensor-model-parallel-size``); unset, they follow the actor's. The actor's generation
layout has its own flags (``--actor-gen-tensor-model-parallel-size``). Later flags override
earlier ones (argparse), abbreviations are refused.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import replace
from typing import List, Optional

from puzzle.config import ROLES, Operations, OptimConfig, PPOParams, RunConfig
from puzzle.config_flags import add_dataclass_args, from_args
from puzzle.flag_checks import ArgumentError  # noqa: F401  (the error type of every flag check)
from puzzle.flag_checks import fail as _fail
from puzzle.plan_layouts import PlanLayouts, layouts_as_flags, read_plan_document

ROLE_PREFIXED = ("critic", "reward", "ref")

# (flag, type, default, help) of model-shape flags that roles may override with a prefix
_MODEL_FLAGS = [
    ("num-layers", int, None, "Number of transformer layers."),
    ("hidden-size", int, None, "Transformer hidden size."),
    ("ffn-hidden-size", int, None, "MLP hidden size (default 4 * hidden size)."),
    ("num-attention-heads", int, None, "Number of attention heads."),
    ("num-query-groups", int, None, "Query groups for grouped-query attention."),
    ("kv-channels", int, None, "Projection size per head (default hidden / heads)."),
]


class _Parser(argparse.ArgumentParser):
    """An unknown or malformed flag raises ArgumentError (one short line, printed once by the
    caller) instead of printing the usage text and exiting on every rank."""

    def error(self, message):
        raise ArgumentError(f"{message} (see {self.prog} --help)")


def _add_model_args(parser):
    g = parser.add_argument_group("model")
    for flag, typ, default, text in _MODEL_FLAGS:
        g.add_argument(f"--{flag}", type=typ, default=default, help=f"Actor/reference: {text}")
    g.add_argument("--group-query-attention", action="store_true", help="Use grouped-query attention.")
    g.add_argument("--seq-length", type=int, default=None, help="Maximum sequence length (prompt + response).")
    g.add_argument("--max-position-embeddings", type=int, default=None)
    g.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm")
    g.add_argument("--norm-epsilon", type=float, default=1e-5)
    g.add_argument("--swiglu", action="store_true", help="SwiGLU MLP (LLaMA).")
    g.add_argument("--position-embedding-type", choices=["learned_absolute", "rope"], default="learned_absolute")
    g.add_argument("--rotary-base", type=int, default=10000)
    g.add_argument("--add-qkv-bias", action="store_true", help="Biases on the q/k/v projections only (Qwen2).")
    g.add_argument("--qk-layernorm", action="store_true", help="Per-head norm of queries and keys (Qwen3).")
    g.add_argument("--use-rope-scaling", action="store_true", help="Llama-3.x RoPE frequency scaling.")
    g.add_argument("--rope-scaling-factor", type=float, default=None, help="Llama-3.x RoPE scaling factor (default 8).")
    g.add_argument("--rope-low-freq-factor", type=float, default=None, help="Llama-3.x RoPE low_freq_factor (default 1).")
    g.add_argument("--rope-high-freq-factor", type=float, default=None, help="Llama-3.x RoPE high_freq_factor (default 4).")
    g.add_argument("--rope-original-max-position-embeddings", type=int, default=None,
                   help="Llama-3.x RoPE original_max_position_embeddings (default 8192).")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--disable-bias-linear", action="store_true")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--attention-dropout", type=float, default=0.0)
    g.add_argument("--hidden-dropout", type=float, default=0.0)
    g.add_argument("--attention-backend", choices=["auto", "flash", "fused", "unfused", "local"],
                   default="auto", help="Core attention (Megatron-LM's names): flash/fused/unfused = "
                   "transformer-engine kernels (unfused without TE: megatron-core's own), local = "
                   "torch SDPA, auto = TE if present, else SDPA on CUDA, else unfused on CPU.")
    for role in ROLE_PREFIXED:
        rg = parser.add_argument_group(f"{role} model (overrides; default: the actor's)")
        for flag, typ, _, text in _MODEL_FLAGS:
            rg.add_argument(f"--{role}-{flag}", type=typ, default=None, help=f"{role}: {text}")


def _add_parallel_args(parser):
    g = parser.add_argument_group("parallelism (per role; D = world / (P * T))")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1, help="Actor training T (default for every role).")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1, help="Actor training P (default for every role).")
    for role in ("actor",) + ROLE_PREFIXED:
        g.add_argument(f"--{role}-tensor-model-parallel-size", type=int, default=None)
        g.add_argument(f"--{role}-pipeline-model-parallel-size", type=int, default=None)
        g.add_argument(f"--{role}-data-parallel-size", type=int, default=None,
                       help=f"{role}: D (default: the ranks from its offset to the end / (P*T)).")
        g.add_argument(f"--{role}-rank-offset", type=int, default=0,
                       help=f"{role}: first rank of its layout (disjoint placement).")
    g.add_argument("--actor-gen-tensor-model-parallel-size", type=int, default=None,
                   help="Actor generation-layout T (default: its training layout).")
    g.add_argument("--actor-gen-pipeline-model-parallel-size", type=int, default=None,
                   help="Actor generation-layout P (default: its training layout).")


def _add_training_args(parser):
    g = parser.add_argument_group("training")
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="Samples per optimizer step (= the PPO mini-batch; default: the rollout batch).")
    g.add_argument("--critic-lr", type=float, default=None, help="Critic learning rate (default: --lr).")
    g.add_argument("--bf16", action="store_true",
                   help="bf16 parameters and activations; fp32 main parameters and gradients in the optimizer.")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--transformer-impl", choices=["transformer_engine", "local"], default="transformer_engine",
                   help="Transformer layer implementation (Megatron-LM's flag): transformer_engine where TE "
                        "imports on a CUDA machine, else local (said once at start).")


def _add_ppo_args(parser):
    g = parser.add_argument_group("PPO")
    g.add_argument("--ppo-mini-batch-size", type=int, default=None, help="Alias of --global-batch-size.")
    g.add_argument("--max-prompt-length", type=int, default=None, help="Prompt budget (default: seq length - max new tokens).")
    g.add_argument("--clip-eps", type=float, default=0.2)


def _add_algorithm_args(parser):
    from puzzle.algorithms import KL_KINDS, LOSS_AGG_MODES
    from puzzle.algorithms.advantage_estimators import ESTIMATORS

    g = parser.add_argument_group("advantage estimators, GRPO family and DAPO (docs/grpo.md)")
    g.add_argument("--advantage-estimator", choices=list(ESTIMATORS), default="gae",
                   help="gae (PPO, with a critic) or a critic-free estimator.")
    g.add_argument("--kl-loss-type", choices=list(KL_KINDS), default="low_var_kl")
    g.add_argument("--clip-eps-low", type=float, default=None, help="Lower ratio clip (default --clip-eps).")
    g.add_argument("--clip-eps-high", type=float, default=None,
                   help="Upper ratio clip (DAPO clip-higher; default --clip-eps-low).")
    g.add_argument("--loss-agg-mode", choices=list(LOSS_AGG_MODES), default="token-mean",
                   help="How the actor's per-token losses are aggregated over the mini-batch.")


def _add_reward_fn_args(parser):
    parser.add_argument_group("reward functions (--reward-fn; docs/grpo.md)")  # RunConfig's, PPOParams' fields


def _add_data_args(parser):
    g = parser.add_argument_group("data")
    g.add_argument("--hf-actor-path", type=str, default=None,
                   help="HF checkpoint dir (Llama-2/3.x, Mistral, Qwen2/2.5, Qwen3) for the actor and the "
                        "reference; its config.json sets their shape.")
    g.add_argument("--hf-critic-path", type=str, default=None,
                   help="HF checkpoint dir for the critic backbone (+ score/v_head when present).")
    g.add_argument("--hf-reward-path", type=str, default=None,
                   help="HF checkpoint dir of the reward model (backbone + score head).")


def _add_logging_args(parser):
    parser.add_argument_group("logging and checkpoints")  # its flags: RunConfig's and Operations' fields


def _add_operations_args(parser):
    parser.add_argument_group("preemption, time limits, hangs and non-finite steps")  # Operations' fields


def _add_plan_args(parser):
    g = parser.add_argument_group("plan")
    g.add_argument("--dry-run", action="store_true",
                   help="Validate every flag, print the layouts and a per-device memory estimate, exit "
                        "without allocating.")
    g.add_argument("--plan-file", type=str, default=None,
                   help="Use the layouts and placements of a plan written by search_plan.py --save-plan "
                        "(they replace layout flags given on the command line).")
    g.add_argument("--plan", choices=["auto", "flags"], default="flags",
                   help="auto: search the plan at start with --profile; flags: the layout flags as given.")
    g.add_argument("--profile", type=str, default=None,
                   help="Device profile for planning and memory estimates: a JSON file from "
                        "python -m puzzle.tools.profile, or a bundled name (default a100_80gb).")
    g.add_argument("--world-size", type=int, default=None,
                   help="World size to plan for in --dry-run / search_plan.py (default: $WORLD_SIZE).")
    g.add_argument("--vocab-size", type=int, default=None,
                   help="Vocabulary size when the tokenizer files are not at hand (dry runs, planning).")


def build_parser(prog: Optional[str] = None, raise_errors: bool = False) -> argparse.ArgumentParser:
    """``raise_errors``: an unknown or malformed flag raises ArgumentError instead of exiting."""
    cls = _Parser if raise_errors else argparse.ArgumentParser
    parser = cls(prog=prog, description="PPO on megatron-core (puzzle)", allow_abbrev=False)
    for add in (_add_model_args, _add_parallel_args, _add_training_args, _add_ppo_args,
                _add_algorithm_args, _add_reward_fn_args, _add_data_args, _add_logging_args,
                _add_operations_args, _add_plan_args):
        add(parser)
    for cls in (RunConfig, PPOParams, OptimConfig, Operations):  # flags declared on config fields
        add_dataclass_args(parser, cls)
    return parser


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """Parse train_ppo.py's flags; an unknown or malformed one raises ArgumentError."""
    parser = build_parser(prog="train_ppo.py", raise_errors=True)
    args = parser.parse_args(argv)
    return args


def role_value(args, role: str, flag: str):
    """``--<role>-<flag>`` when given, else the actor's ``--<flag>``."""
    attr = flag.replace("-", "_")
    if role != "actor":
        v = getattr(args, f"{role}_{attr}", None)
        if v is not None:
            return v
    return getattr(args, attr)


def _arch_for(args, role: str, vocab_size: int):
    """The role's ModelArch: from its HF ``config.json`` when one is at hand (flags may only
    repeat it; a critic/reward without a checkpoint of its own takes the actor's shape, as its
    model flags default to the actor's, unless role-prefixed shape flags describe it), else from
    the model flags."""
    from puzzle.config import ModelArch

    own = _hf_dir_for(args, role)
    hf, source_flag = (own, ROLES[role].hf_path_flag) if own else \
        (args.hf_actor_path, "--hf-actor-path")
    own_shape_flags = role != "actor" and any(getattr(args, f"{role}_{f.replace('-', '_')}", None) is not None
                                              for f, *_ in _MODEL_FLAGS)
    if hf and os.path.isfile(os.path.join(hf, "config.json")) and (own or not own_shape_flags):
        return _arch_from_hf(args, role, vocab_size, hf, source_flag)

    def v(flag):
        return role_value(args, role, flag)

    num_layers, hidden, heads = v("num-layers"), v("hidden-size"), v("num-attention-heads")
    for flag, value in (("num-layers", num_layers), ("hidden-size", hidden), ("num-attention-heads", heads)):
        if value is None:
            _fail(f"--{flag}", "is required (or --hf-actor-path/--hf-critic-path/--hf-reward-path DIR "
                               "with a config.json)")
    groups = v("num-query-groups") if args.group_query_attention else None
    if args.group_query_attention and groups is None:
        _fail("--num-query-groups", "is required with --group-query-attention")
    prefix = ROLES[role].flag_prefix
    if _rope_scaling_kwargs(args) and not args.use_rope_scaling:
        _fail("--rope-scaling-factor", "the llama3 RoPE parameters need --use-rope-scaling")
    try:
        return ModelArch(
            num_layers=num_layers, hidden_size=hidden, ffn_hidden_size=v("ffn-hidden-size"),
            num_attention_heads=heads, num_query_groups=groups, vocab_size=vocab_size,
            kv_channels=v("kv-channels"), add_qkv_bias=args.add_qkv_bias, qk_layernorm=args.qk_layernorm,
            use_rope_scaling=args.use_rope_scaling, **_rope_scaling_kwargs(args),
            make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
            seq_length=args.seq_length, max_position_embeddings=args.max_position_embeddings,
            normalization=args.normalization, norm_epsilon=args.norm_epsilon, swiglu=args.swiglu,
            position_embedding_type=args.position_embedding_type, rotary_base=args.rotary_base,
            untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
            add_bias_linear=not args.disable_bias_linear, attention_dropout=args.attention_dropout,
            hidden_dropout=args.hidden_dropout, init_method_std=args.init_method_std,
            attention_backend=args.attention_backend,
        )
    except ValueError as e:
        _fail(f"--{prefix}num-layers/--{prefix}hidden-size/--{prefix}num-attention-heads", f"{role}: {e}")


def _check_generation_device(args, transformer_impl: str) -> None:
    """--attention-backend and --cuda-graph-generation against this machine (before any group)."""
    from puzzle.models.attention_backend import resolve_attention_backend
    from puzzle.parallel.device import accelerator_available

    try:
        resolve_attention_backend(args.attention_backend, te=transformer_impl == "transformer_engine",
                                  cuda=accelerator_available())
    except ValueError as e:
        raise ArgumentError(str(e)) from None
    if args.cuda_graph_generation and not accelerator_available():
        _fail("--cuda-graph-generation", "needs a CUDA device (this run uses the CPU)")


# Megatron-LM's rope-scaling flags and ours for the other three llama3 parameters -> ModelArch fields
_ROPE_FLAGS = (("rope_scaling_factor", "rope_scaling_factor"), ("rope_low_freq_factor", "rope_low_freq_factor"),
               ("rope_high_freq_factor", "rope_high_freq_factor"),
               ("rope_original_max_position_embeddings", "rope_original_max_position_embeddings"))
# model-shape flag -> (ModelArch field, HF config.json field)
_SHAPE_FIELDS = {"num-layers": ("num_layers", "num_hidden_layers"), "hidden-size": ("hidden_size", "hidden_size"),
                 "ffn-hidden-size": ("ffn_hidden_size", "intermediate_size"),
                 "num-attention-heads": ("num_attention_heads", "num_attention_heads"),
                 "num-query-groups": ("num_query_groups", "num_key_value_heads"),
                 "kv-channels": ("kv_channels", "head_dim")}


def _rope_scaling_kwargs(args) -> dict:
    return {field: getattr(args, attr) for attr, field in _ROPE_FLAGS if getattr(args, attr) is not None}


def _hf_dir_for(args, role: str) -> Optional[str]:
    return getattr(args, f"hf_{ROLES[role].weights_from}_path")


def _arch_from_hf(args, role: str, vocab_size: int, hf_dir: str, flag_of_role: str):
    """The checkpoint's architecture; a shape flag that disagrees with it is an error naming both."""
    from puzzle.models.hf_checkpoint import arch_from_hf_dir

    cfg_path = os.path.join(hf_dir, "config.json")
    try:
        arch = arch_from_hf_dir(hf_dir, seq_length=args.seq_length,
                                make_vocab_size_divisible_by=args.make_vocab_size_divisible_by)
    except (ValueError, OSError) as e:
        _fail(flag_of_role, str(e))
    prefix = ROLES[role].flag_prefix
    for flag, (field, hf_field) in _SHAPE_FIELDS.items():
        given = role_value(args, role, flag)
        if given is not None and given != getattr(arch, field):
            _fail(f"--{prefix}{flag}", f"{given} conflicts with {cfg_path} ({hf_field}={getattr(arch, field)}); "
                                       f"drop the flag: {flag_of_role} sets the {role} shape")
    for attr in ("add_qkv_bias", "qk_layernorm", "use_rope_scaling"):
        if getattr(args, attr) and not getattr(arch, attr):
            _fail("--" + attr.replace("_", "-"), f"conflicts with {cfg_path}, whose model has no {attr}")
    for attr, field in _ROPE_FLAGS:
        given = getattr(args, attr)
        if given is not None and (not arch.use_rope_scaling or given != getattr(arch, field)):
            _fail("--" + attr.replace("_", "-"), f"{given} conflicts with {cfg_path} "
                                                 f"(use_rope_scaling={arch.use_rope_scaling}, {field}="
                                                 f"{getattr(arch, field)})")
    if vocab_size > arch.vocab_size:
        _fail("--tokenizer-model", f"the tokenizer has {vocab_size} tokens, more than the {arch.vocab_size} "
                                   f"rows of {cfg_path} (vocab_size)")
    return arch


def _plan_for(args, role: str, world_size: int, P: int, T: int, flags: str, *,
              offset: int = 0, D=None, size=None):
    """The role's plan on ranks offset.. (D given, or all the ranks of ``size`` / the rest)."""
    from puzzle.parallel.plan import ParallelPlan, PlanError

    if P < 1 or T < 1:
        _fail(flags, f"{role} parallel sizes must be >= 1 (P={P}, T={T})")
    if offset < 0 or offset >= world_size:
        _fail(flags, f"{role} rank offset {offset} is outside the world of {world_size} ranks")
    avail = size if size is not None else world_size - offset
    if D is None:
        if avail % (P * T):
            _fail(flags, f"{role} layout P*T={P * T} does not divide its {avail} ranks "
                         f"(world size {world_size}, offset {offset})")
        D = avail // (P * T)
    try:
        plan = ParallelPlan(P=P, D=D, T=T, offset=offset)
        plan.check_world(world_size, what=role)
    except PlanError as e:
        _fail(flags, str(e))
    return plan


def _describe_plans(plans) -> str:
    return ", ".join(f"{r} {p} on ranks {p.ranks[0]}..{p.ranks[-1]}" for r, p in plans.items())


def _check_placement(flag: str, placement: str, plans) -> None:
    """Models of one stage either share exactly the same ranks or use disjoint ones; time-sharing
    needs identical layouts on shared ranks; disjoint needs at least two disjoint groups."""
    ranges = {r: set(p.ranks) for r, p in plans.items()}
    roles = list(plans)
    for i, a in enumerate(roles):
        for b in roles[i + 1:]:
            shared = ranges[a] & ranges[b]
            if shared and ranges[a] != ranges[b] and placement != "sequential":
                _fail(flag, f"{placement} placement needs the models of a stage on the same or on "
                            f"disjoint ranks; {a} and {b} partly overlap ({_describe_plans(plans)})")
            if placement == "time-sharing" and shared and plans[a] != plans[b]:
                _fail(flag, "time-sharing requires equal P (and the same D, T) for the models that share "
                            f"devices in a stage; got {_describe_plans(plans)} (use sequential, or give "
                            "them the same layout)")
    if placement == "disjoint" and len({frozenset(v) for v in ranges.values()}) < 2:
        _fail(flag, "disjoint placement needs models on disjoint rank ranges (e.g. --critic-rank-offset "
                    f"with --critic-data-parallel-size); got {_describe_plans(plans)}")


def role_set(args) -> List[str]:
    """The roles a run builds: no critic unless the estimator needs one (gae), no reference when
    KL enters neither the reward (--kl-coef 0) nor the loss, a reward model only when given."""
    from puzzle.algorithms.advantage_estimators import ESTIMATORS

    roles = ["actor"]
    if ESTIMATORS[args.advantage_estimator].needs_critic:
        roles.append("critic")
    if args.kl_coef > 0 or args.use_kl_loss:
        roles.append("ref")
    if args.reward_model:
        roles.append("reward")
    return roles


def validate_args(args, world_size: int, vocab_size: int, check_paths: bool = True,
                  layouts: Optional[PlanLayouts] = None):
    """Derive and check every flag; returns a RunConfig. Raises ArgumentError naming the flag.

    Runs before any model is allocated; ``args`` is left as parsed. ``check_paths=False`` (dry
    runs, planning on a laptop) skips the checks that need checkpoint files to be present.
    ``layouts`` (a plan: --plan-file / --plan auto) replace the layout and placement flags of the
    roles and stages they describe.
    """
    args = argparse.Namespace(**vars(args))
    layouts = layouts or PlanLayouts()
    from puzzle import flag_checks
    from puzzle.config import RoleSpec
    from puzzle.models.builders import check_layout
    from puzzle.parallel.plan import PlanError

    if args.seq_length is None:
        _fail("--seq-length", "is required")
    optim = from_args(OptimConfig, args)  # the configs that check themselves
    ops = from_args(Operations, args)
    flag_checks.check_values(args)
    if args.bf16 and args.fp16:
        _fail("--bf16/--fp16", "choose one")
    if check_paths:  # this machine: writable outputs, a GPU for --fp16, optional logging packages
        flag_checks.check_environment(args)
    if args.max_new_tokens < 1:
        _fail("--max-new-tokens", f"must be >= 1 (got {args.max_new_tokens})")
    max_prompt = args.max_prompt_length or args.seq_length - args.max_new_tokens
    if max_prompt < 1 or max_prompt + args.max_new_tokens > args.seq_length:
        _fail("--max-new-tokens", f"prompt budget {max_prompt} + max new tokens {args.max_new_tokens} "
                                  f"exceeds --seq-length {args.seq_length}")
    if args.hf_reward_path and not args.reward_model:
        args.reward_model = args.hf_reward_path
    if not args.reward_fn and not args.reward_model:
        _fail("--reward-fn", "no reward source: pass --reward-fn module:function, --hf-reward-path DIR "
                             "or --reward-model (an HF checkpoint directory, or 'random' for tests)")
    if args.reward_model and args.reward_model != "random" and not args.hf_reward_path:
        args.hf_reward_path = args.reward_model
    for flag in ("hf_actor_path", "hf_critic_path", "hf_reward_path") if check_paths else ():
        path = getattr(args, flag)
        if path and not os.path.isfile(os.path.join(path, "config.json")):
            _fail("--" + flag.replace("_", "-"), f"{path!r} is not an HF checkpoint directory (no config.json)")
    if args.reward_fn and args.reward_model:
        _fail("--reward-fn", f"give one reward source, not both --reward-fn and a reward model "
                             f"({args.reward_model})")
    flag_checks.check_algorithm_args(args)
    N = args.n_samples_per_prompt
    samples = args.rollout_batch_size * N
    mini = args.ppo_mini_batch_size or args.global_batch_size or samples
    ppo = from_args(
        PPOParams, args, mini_batch_size=mini, max_prompt_length=max_prompt,
        clip_eps=args.clip_eps_low if args.clip_eps_low is not None else args.clip_eps,
        clip_eps_high=args.clip_eps_high if args.clip_eps_high is not None else args.clip_eps_low,
        advantage_estimator=args.advantage_estimator, kl_loss_type=args.kl_loss_type,
        loss_agg_mode=args.loss_agg_mode)
    for flag in ("save", "load"):
        path = getattr(args, flag)
        if path is not None and (not path or os.path.exists(path) and not os.path.isdir(path)):
            _fail(f"--{flag}", f"{path!r} is not a directory")

    roles = {}
    present = role_set(args)
    for role in ("actor", "critic", "ref", "reward"):
        if role not in present:
            continue
        arch = _arch_for(args, role, vocab_size)
        P = role_value(args, role, "pipeline-model-parallel-size")
        T = role_value(args, role, "tensor-model-parallel-size")
        if role == "actor":
            P = args.actor_pipeline_model_parallel_size or P
            T = args.actor_tensor_model_parallel_size or T
        flags = (f"--{role}-tensor-model-parallel-size/--{role}-pipeline-model-parallel-size"
                 if role != "actor" else "--tensor-model-parallel-size/--pipeline-model-parallel-size")
        offset = getattr(args, f"{role}_rank_offset")
        D = getattr(args, f"{role}_data_parallel_size")
        home = layouts.homes.get(role)
        if home is not None:
            P, T, offset, D = home.P, home.T, home.offset, home.D
        if offset or D:
            flags += f"/--{role}-rank-offset/--{role}-data-parallel-size"
        plan = _plan_for(args, role, world_size, P, T, flags, offset=offset, D=D)
        try:
            check_layout(arch, plan, role)
        except PlanError as e:
            _fail(flags, str(e))
        gen_plan = None
        if role == "actor":
            gP = args.actor_gen_pipeline_model_parallel_size or P
            gT = args.actor_gen_tensor_model_parallel_size or T
            if home is not None and layouts.actor_generation is not None:
                gP, gT = layouts.actor_generation.P, layouts.actor_generation.T
            gflags = "--actor-gen-tensor-model-parallel-size/--actor-gen-pipeline-model-parallel-size"
            gen_plan = _plan_for(args, "actor generation", world_size, gP, gT, gflags,
                                 offset=plan.offset, size=plan.size)
            try:
                check_layout(arch, gen_plan, "actor (generation layout)")
            except PlanError as e:
                _fail(gflags, str(e))
        lr = args.lr if role == "actor" else (args.critic_lr if args.critic_lr is not None else args.lr)
        hf = _hf_dir_for(args, role)
        roles[role] = RoleSpec(role=role, arch=arch, plan=plan, gen_plan=gen_plan, lr=lr, hf_path=hf)
    what = (f"rollout batch {args.rollout_batch_size}" if N == 1 else
            f"rollout batch {args.rollout_batch_size} prompts x {N} samples = {samples}")
    if samples % mini:
        _fail("--global-batch-size", f"the {what} is not divisible by the PPO mini-batch (global batch) {mini}")
    for role, spec in roles.items():
        D = spec.plan.D
        unit = args.micro_batch_size * D
        if ROLES[role].trainable and mini % unit:
            _fail("--global-batch-size", f"global batch {mini} is not divisible by micro-batch size "
                                         f"{args.micro_batch_size} x {role} data-parallel size {D}")
        if samples % unit:
            _fail("--rollout-batch-size", f"{what} is not divisible by micro-batch size "
                                          f"{args.micro_batch_size} x {role} data-parallel size {D}")
    gen_D = roles["actor"].gen_plan.D
    if samples % gen_D:
        _fail("--rollout-batch-size", f"{what} is not divisible by the actor generation data-parallel "
                                      f"size {gen_D}")
    gmb = args.generation_micro_batch_size
    if gmb is not None and (gmb < 1 or (samples // gen_D) % gmb):
        _fail("--generation-micro-batch-size", f"{gmb} must divide the samples per generation DP rank "
                                               f"({samples // gen_D})")

    if args.cuda_graph_generation and roles["actor"].gen_plan.P > 1:
        _fail("--cuda-graph-generation", f"needs an actor generation layout with P=1 "
                                         f"(got P={roles['actor'].gen_plan.P})")

    args.score_placement = layouts.placements.get("scoring", args.score_placement)
    args.train_placement = layouts.placements.get("training", args.train_placement)
    for flag, placement, members in (("--score-placement", args.score_placement, list(roles)),
                                     ("--train-placement", args.train_placement,
                                      [r for r in roles if ROLES[r].trainable])):
        _check_placement(flag, placement, {r: roles[r].plan for r in members})

    from puzzle.models.builders import resolve_transformer_impl

    impl, impl_note = resolve_transformer_impl(args.transformer_impl)
    _check_generation_device(args, impl)
    if args.sequence_parallel and impl == "local" and any(r.plan.T > 1 for r in roles.values()):
        _fail("--sequence-parallel", "needs --transformer-impl transformer_engine (TE on a CUDA machine): "
                                     "megatron-core's local layer spec normalises with torch norms, which "
                                     "refuse sequence parallelism" + (f" ({impl_note})" if impl_note else ""))
    optim = replace(optim, lr_decay_iters=args.train_iters * args.ppo_epochs * (samples // mini))
    return from_args(
        RunConfig, args, world_size=world_size, roles=roles, ppo=ppo, optim=optim, ops=ops,
        reward_timeout=args.reward_timeout or None, precision="bf16" if args.bf16 else "fp16" if args.fp16 else "fp32",
        transformer_impl=impl, transformer_impl_note=impl_note)

def resolve_world_size(args) -> int:
    if args.world_size is not None:
        if args.world_size < 1:
            _fail("--world-size", f"must be >= 1 (got {args.world_size})")
        return args.world_size
    from puzzle.parallel import launcher

    return launcher.world_size()


def resolve_vocab_size(args) -> int:
    """The tokenizer's vocabulary; --vocab-size when its files are not at hand."""
    from puzzle.data.tokenizers import build_tokenizer

    try:
        return build_tokenizer(args.tokenizer_type, args.tokenizer_model).vocab_size
    except (ValueError, OSError) as e:
        if args.vocab_size:
            return args.vocab_size
        _fail("--tokenizer-model", f"{e} (for a dry run or plan search, --vocab-size N stands in)")


def config_for_planning(args, layouts: Optional[PlanLayouts] = None):
    """A RunConfig for planning and dry runs: no files needed, a reward model assumed if none given."""
    args = argparse.Namespace(**vars(args))
    if not args.reward_fn and not args.reward_model and not args.hf_reward_path:
        args.reward_model = "random"
    return validate_args(args, resolve_world_size(args), resolve_vocab_size(args), check_paths=False,
                         layouts=layouts)


def plan_flags(doc: dict, strict: bool = False) -> List[str]:
    """The layout and placement flags of a plan document (see puzzle.plan_layouts)."""
    return layouts_as_flags(read_plan_document(doc, strict=strict))
