"""Megatron-style command line: argparse groups by topic, ``validate_args`` -> a frozen RunConfig.

Every flag is declared once, on the config field it fills (``flag(...)``, puzzle/config_flags.py):
the model shape on ModelArch, the layouts on LayoutFlags (puzzle/plan_layouts.py), the algorithm
on PPOParams, the optimizer on OptimConfig, the rest of the run on RunConfig, Operations and
RoleSpec; the flags that steer only this command (dry runs, plans) on CommandOptions below.
``build_parser`` turns them into argparse groups; ``validate_args`` builds the configs (each checks
itself) and checks what needs several of them.

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
from dataclasses import dataclass, replace
from typing import List, Optional

from puzzle.config import (ROLES, EvalConfig, MemoryLevers, ModelArch, Operations, OptimConfig, PPOParams,
                           RoleSpec, RunConfig)
from puzzle.config_flags import add_dataclass_args, field_value, flag, flags_given, from_args, role_flags_given
from puzzle.flag_checks import ArgumentError  # noqa: F401  (the error type of every flag check)
from puzzle.flag_checks import fail as _fail
from puzzle.lora_config import LoRAConfig, check_lora
from puzzle.plan_layouts import GENERATION, LayoutFlags, PlanLayouts, layouts_as_flags, read_plan_document
from puzzle.role_arch import role_arch, role_config

_PLAN = "plan"


@dataclass(frozen=True)
class CommandOptions:
    """The flags that steer this command itself (what it runs and plans for), not the run."""

    group_query_attention: bool = flag(False, "model", "Use grouped-query attention (reads --num-query-groups).")
    dry_run: bool = flag(False, _PLAN, "Validate every flag, print the layouts and a per-device memory estimate, "
                                       "exit without allocating.")
    plan_file: Optional[str] = flag(
        None, _PLAN, "Use the layouts and placements of a plan written by search_plan.py --save-plan (they "
        "replace layout flags given on the command line).", type=str)
    plan: str = flag("flags", _PLAN, "auto: search the plan at start with --profile; flags: the layout flags as "
                                     "given.", choices=("auto", "flags"))
    profile: Optional[str] = flag(
        None, _PLAN, "Device profile for planning and memory estimates: a JSON file from python -m "
        "puzzle.tools.profile, or a bundled name (default a100_80gb).", type=str)
    world_size: Optional[int] = flag(
        None, _PLAN, "World size to plan for in --dry-run / search_plan.py (default: $WORLD_SIZE).", type=int)


#: the configs whose fields declare the flags, in the order of their groups in --help
FLAG_CONFIGS = (ModelArch, LayoutFlags, OptimConfig, PPOParams, RoleSpec, RunConfig, Operations, CommandOptions,
                EvalConfig, MemoryLevers, LoRAConfig)


class _Parser(argparse.ArgumentParser):
    """An unknown or malformed flag raises ArgumentError (one short line, printed once by the
    caller) instead of printing the usage text and exiting on every rank."""

    def error(self, message):
        raise ArgumentError(f"{message} (see {self.prog} --help)")


#: the tools' parsers: an unknown or malformed flag raises ArgumentError (see puzzle.fail_fast)
RaisingArgumentParser = _Parser


def build_parser(prog: Optional[str] = None, raise_errors: bool = False, own_options=None,
                 **texts) -> argparse.ArgumentParser:
    """``raise_errors``: an unknown or malformed flag raises ArgumentError instead of exiting.
    Another command built on these flags (search_plan.py) adds ``own_options(parser)`` first, so
    that --help shows them before the training flags, and its own ``texts`` (usage, description,
    epilog)."""
    from puzzle.algorithms import KL_KINDS, LOSS_AGG_MODES
    from puzzle.algorithms.advantage_estimators import ESTIMATORS

    registered = {"advantage_estimator": list(ESTIMATORS), "kl_loss_type": list(KL_KINDS),
                  "loss_agg_mode": list(LOSS_AGG_MODES)}
    cls = _Parser if raise_errors else argparse.ArgumentParser
    texts.setdefault("description", "PPO on megatron-core (puzzle)")
    parser = cls(prog=prog, allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter, **texts)
    if own_options is not None:
        own_options(parser)
    for config in FLAG_CONFIGS:
        add_dataclass_args(parser, config, choices=registered)
    return parser


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """Parse train_ppo.py's flags; an unknown or malformed one raises ArgumentError."""
    parser = build_parser(prog="train_ppo.py", raise_errors=True)
    args = parser.parse_args(argv)
    return args


def _check_generation_device(args, attention_backend: str, transformer_impl: str) -> None:
    """--attention-backend and --cuda-graph-generation against this machine (before any group)."""
    from puzzle.models.attention_backend import resolve_attention_backend
    from puzzle.parallel.device import accelerator_available

    try:
        resolve_attention_backend(attention_backend, te=transformer_impl == "transformer_engine",
                                  cuda=accelerator_available())
    except ValueError as e:
        raise ArgumentError(str(e)) from None
    if args.cuda_graph_generation and not accelerator_available():
        _fail("--cuda-graph-generation", "needs a CUDA device (this run uses the CPU)")


def _plan_for(args, role: str, world_size: int, P: int, T: int, flags: str, *,
              offset: int = 0, D=None, size=None, E: int = 1, ETP=None):
    """The role's plan on ranks offset.. (D given, or all the ranks of ``size`` / the rest)."""
    from puzzle.parallel.plan import ParallelPlan, PlanError

    if offset >= world_size:
        _fail(flags, f"{role} rank offset {offset} is outside the world of {world_size} ranks")
    avail = size if size is not None else world_size - offset
    if D is None:
        if avail % (P * T):
            _fail(flags, f"{role} layout P*T={P * T} does not divide its {avail} ranks "
                         f"(world size {world_size}, offset {offset})")
        D = avail // (P * T)
    try:
        plan = ParallelPlan(P=P, D=D, T=T, offset=offset, E=E, ETP=ETP)
        plan.check_world(world_size, what=role)
    except PlanError as e:
        _fail(flags, str(e))
    return plan


def _describe_plans(plans) -> str:
    return ", ".join(f"{r} {p} on ranks {p.ranks[0]}..{p.ranks[-1]}" for r, p in plans.items())


def _check_placement(flag: str, placement: str, plans) -> None:
    """Models of one stage either share exactly the same ranks or use disjoint ones; time-sharing
    needs equal P on shared ranks (one plan where experts are split: puzzle.parallel.streams);
    disjoint needs at least two disjoint groups."""
    from puzzle.parallel.streams import stream_problem

    ranges = {r: set(p.ranks) for r, p in plans.items()}
    roles = list(plans)
    for i, a in enumerate(roles):
        for b in roles[i + 1:]:
            shared = ranges[a] & ranges[b]
            if shared and ranges[a] != ranges[b] and placement != "sequential":
                _fail(flag, f"{placement} placement needs the models of a stage on the same or on "
                            f"disjoint ranks; {a} and {b} partly overlap ({_describe_plans(plans)})")
            if placement != "time-sharing" or not shared:
                continue
            if plans[a].P != plans[b].P:
                _fail(flag, "time-sharing requires equal P for the models that share devices in a stage; got "
                            f"{_describe_plans(plans)} (use sequential, or give them the same P)")
            problem = stream_problem([plans[a], plans[b]])
            if problem:
                _fail(flag, f"time-sharing of {a} and {b}: {problem}; got "
                            f"{_describe_plans(plans)} (use sequential, or give them the same layout)")
    if placement == "disjoint" and len({frozenset(v) for v in ranges.values()}) < 2:
        _fail(flag, "disjoint placement needs models on disjoint rank ranges (e.g. --critic-rank-offset "
                    f"with --critic-data-parallel-size); got {_describe_plans(plans)}")


def _check_trainable_cover(roles, world_size: int) -> None:
    """Every rank holds part of a trainable model: building megatron's optimizers is collective
    over the whole world, so a rank without one would leave the others waiting for ever."""
    trained = {r: s.plan for r, s in roles.items() if ROLES[r].trainable}
    pool = set(roles["actor"].gen_plan.ranks) - set(roles["actor"].plan.ranks)  # the generation pool's
    idle = sorted(set(range(world_size)) - pool - {k for p in trained.values() for k in p.ranks})
    if idle:
        flags = "/".join(f"--{r}-data-parallel-size/--{r}-rank-offset" for r in trained)
        _fail(flags, f"rank(s) {', '.join(map(str, idle))} of the {world_size}-rank world hold no trainable "
                     f"model ({_describe_plans(trained)}); every rank must hold part of the actor or critic "
                     "(megatron builds their optimizers over the whole world)")


def role_set(args) -> List[str]:
    """The roles a run builds: no critic unless the estimator needs one (gae), no reference when
    KL enters neither the reward (--kl-coef 0) nor the loss or when the actor is LoRA (its base
    is the reference: RunConfig.reference_is_actor_base), a reward model only when given."""
    from puzzle.algorithms.advantage_estimators import ESTIMATORS

    roles = ["actor"]
    if ESTIMATORS[args.advantage_estimator].needs_critic:
        roles.append("critic")
    if (args.kl_coef > 0 or args.use_kl_loss) and getattr(args, "lora_dim", None) is None:
        roles.append("ref")
    if args.reward_model or args.hf_reward_path or args.reward_pretrained_checkpoint:
        roles.append("reward")
    return roles


#: why a run has no model of a role (its role flags are then refused)
_ABSENT = {"critic": "--advantage-estimator {advantage_estimator} has no critic",
           "ref": "no reference model: --kl-coef 0 and no --use-kl-loss",
           "reward": "no reward model: the reward comes from --reward-fn"}


#: (config, field, what the field needs, message): a flag given without what it needs would change nothing
_NEEDS = (
    (PPOParams, "kl_horizon", lambda a, roles: a.kl_target is not None, "needs --kl-target (the adaptive KL "
                                                                         "controller's horizon)"),
    (PPOParams, "kl_target", lambda a, roles: a.kl_coef > 0, "needs --kl-coef > 0 (it adapts the reward's KL "
                                                            "penalty, starting from --kl-coef)"),
    (PPOParams, "kl_loss_coef", lambda a, roles: a.use_kl_loss, "needs --use-kl-loss"),
    (PPOParams, "kl_loss_type", lambda a, roles: a.use_kl_loss, "needs --use-kl-loss"),
    (PPOParams, "max_num_gen_batches", lambda a, roles: a.filter_groups, "needs --filter-groups"),
    (PPOParams, "rl_partial_rollouts_oversample", lambda a, roles: a.rl_partial_rollouts,
     "needs --rl-partial-rollouts"),
    (PPOParams, "rl_partial_rollouts_max_staleness", lambda a, roles: a.rl_partial_rollouts,
     "needs --rl-partial-rollouts (it masks carried samples' stale tokens)"),
    (PPOParams, "rl_importance_sampling_truncation_coef", lambda a, roles: a.rl_inference_logprobs_is_correction,
     "needs --rl-inference-logprobs-is-correction"),
    (PPOParams, "overlong_penalty_factor", lambda a, roles: a.overlong_buffer_len > 0,
     "needs --overlong-buffer-len > 0"),
    (PPOParams, "lam", lambda a, roles: "critic" in roles, "GAE's lambda: needs a critic (--advantage-estimator gae)"),
    (PPOParams, "value_clip_eps", lambda a, roles: "critic" in roles, "clips the critic's values: needs a critic "
                                                                      "(--advantage-estimator gae)"),
    (PPOParams, "kl_estimator", lambda a, roles: a.kl_coef > 0 or a.use_kl_loss, "needs a reference model (--kl-coef > 0 or "
                                                                  "--use-kl-loss)"),
    *((PPOParams, field, lambda a, roles: not a.greedy, "is ignored by --greedy (argmax decoding; log-probs at "
                                                        "temperature 1): drop one of them")
      for field in ("temperature", "top_k", "top_p")),
    (OptimConfig, "min_lr", lambda a, roles: a.lr_decay_style != "constant",
     "needs --lr-decay-style linear or cosine (a constant learning rate never decays to it)"),
)


def _check_needs(args, present: List[str]) -> None:
    given = {(config, field): flag for config in (PPOParams, OptimConfig)
             for field, flag in flags_given(config, args).items()}
    for config, field, ok, message in _NEEDS:
        if (config, field) in given and not ok(args, present):
            _fail(given[config, field], message)


def _check_absent_roles(args, present: List[str]) -> None:
    """A role flag (--critic-lr, --ref-num-layers, --hf-critic-path, ...) of a role the run does not
    build would be ignored: refused."""
    for role, why in _ABSENT.items():
        if role in present:
            continue
        given = [flag for config in (ModelArch, LayoutFlags, OptimConfig, LoRAConfig) for flag, _ in
                 role_flags_given(config, args, role)]
        if ROLES[role].weights_from == role:
            given += [flag for flag, _ in role_flags_given(RoleSpec, args, role)]
        if given:
            if role == "ref" and args.lora_dim is not None:
                why = "the LoRA actor's base, its adapters off, is the reference (--lora-dim)"
            _fail(given[0], f"the run builds no {role} model ({why.format(**vars(args))})")


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

    if args.seq_length is None:
        _fail("--seq-length", "is required")
    optim = from_args(OptimConfig, args)  # the configs that check themselves
    ops = from_args(Operations, args)
    levers = from_args(MemoryLevers, args)
    lora = from_args(LoRAConfig, args)
    flag_checks.check_values(args)
    if args.vocab_size is not None and args.vocab_size < vocab_size:
        _fail("--vocab-size", f"{args.vocab_size} is smaller than the tokenizer's vocabulary ({vocab_size})")
    precision = field_value(RunConfig, args, "precision")  # --bf16/--fp16: one of them
    if check_paths:  # this machine: writable outputs, a GPU for --fp16, optional logging packages
        flag_checks.check_environment(args)
    _resolve_checkpoint_flags(args, check_paths)
    max_prompt = _check_lengths_and_rewards(args, check_paths)
    flag_checks.check_algorithm_args(args)
    N = args.n_samples_per_prompt
    samples = args.rollout_batch_size * N
    mini = args.global_batch_size or samples
    ppo = from_args(PPOParams, args, mini_batch_size=mini, max_prompt_length=max_prompt)
    for flag in ("save", "load"):
        path = getattr(args, flag)
        if path is not None and (not path or os.path.exists(path) and not os.path.isdir(path)):
            _fail(f"--{flag}", f"{path!r} is not a directory")

    roles = _role_specs(args, world_size, vocab_size, layouts)
    _check_batch_division(args, roles, samples, mini)
    gen_D = roles["actor"].gen_plan.D
    ppo = _kv_budget_micro_batch(levers, ppo, roles["actor"], samples // gen_D, 4 if precision == "fp32" else 2)
    if args.cuda_graph_generation and roles["actor"].gen_plan.P > 1:
        _fail("--cuda-graph-generation", f"needs an actor generation layout with P=1 "
                                         f"(got P={roles['actor'].gen_plan.P})")
    if args.rl_partial_rollouts:
        flag_checks.check_partial_generation(roles["actor"].gen_plan)

    args.score_placement = layouts.placements.get("scoring", args.score_placement)
    args.train_placement = layouts.placements.get("training", args.train_placement)
    for flag, placement, members in (("--score-placement", args.score_placement, list(roles)),
                                     ("--train-placement", args.train_placement,
                                      [r for r in roles if ROLES[r].trainable])):
        _check_placement(flag, placement, {r: roles[r].plan for r in members})

    impl, impl_note = _check_transformer_impl(args, roles)
    flag_checks.check_generation_pool(args, roles, world_size)
    _check_trainable_cover(roles, world_size)
    _check_moe_paths(args, roles, impl)
    _check_batch_invariant(ppo, roles)
    ppo = _check_token_budget(ppo)
    _check_recompute_layers(levers, roles)
    check_lora(lora, roles["actor"].arch, impl, actor_plans=(roles["actor"].plan, roles["actor"].gen_plan))
    critic_lora = role_config(LoRAConfig, args, "critic", fallback=LoRAConfig())  # nothing of the actor's
    if "critic" in roles:
        check_lora(critic_lora, roles["critic"].arch, impl, prefix="critic-")
    optim = replace(optim, lr_decay_iters=args.train_iters * args.ppo_epochs * (samples // mini))
    return from_args(
        RunConfig, args, world_size=world_size, roles=roles, ppo=ppo, optim=optim, ops=ops, levers=levers, lora=lora,
        critic_lora=critic_lora, evaluation=from_args(EvalConfig, args), reward_timeout=args.reward_timeout or None, precision=precision,
        transformer_impl=impl, transformer_impl_note=impl_note)


def _resolve_checkpoint_flags(args, check_paths: bool) -> None:
    """Each role's checkpoint (puzzle.weight_sources): a Megatron-LM checkpoint at --load or as
    --reward-model becomes that role's --*pretrained-checkpoint; a run checks that each is one."""
    from puzzle import weight_sources

    weight_sources.resolve_checkpoint_flags(args)
    if check_paths:
        weight_sources.check_checkpoint_paths(args)


def _check_lengths_and_rewards(args, check_paths: bool) -> int:
    """--max-new-tokens within --seq-length, one reward source (and its checkpoint directories).
    Returns the prompt budget. Sets --hf-reward-path / --reward-model from each other."""
    if args.max_new_tokens < 1:
        _fail("--max-new-tokens", f"must be >= 1 (got {args.max_new_tokens})")
    max_prompt = args.max_prompt_length or args.seq_length - args.max_new_tokens
    if max_prompt < 1 or max_prompt + args.max_new_tokens > args.seq_length:
        _fail("--max-new-tokens", f"prompt budget {max_prompt} + max new tokens {args.max_new_tokens} "
                                  f"exceeds --seq-length {args.seq_length}")
    if args.hf_reward_path and not args.reward_model:
        args.reward_model = args.hf_reward_path
    if not args.reward_fn and not args.reward_model and not args.env:
        _fail("--reward-fn", "no reward source: pass --reward-fn module:function, --env, --hf-reward-path DIR, "
                             "--reward-pretrained-checkpoint DIR or --reward-model (an HF or Megatron-LM checkpoint "
                             "directory, or 'random' for tests)")
    if args.reward_model and args.reward_model != "random" and not args.hf_reward_path \
            and not args.reward_pretrained_checkpoint:
        args.hf_reward_path = args.reward_model
    for flag in ("hf_actor_path", "hf_critic_path", "hf_reward_path") if check_paths else ():
        path = getattr(args, flag)
        if path and not os.path.isfile(os.path.join(path, "config.json")):
            _fail("--" + flag.replace("_", "-"), f"{path!r} is not an HF checkpoint directory (no config.json)")
    if args.reward_fn and args.reward_model:
        _fail("--reward-fn", f"give one reward source, not both --reward-fn and a reward model "
                             f"({args.reward_model})")
    if args.env and args.reward_model:
        _fail("--env", f"give one reward source, not both --env and a reward model ({args.reward_model})")
    if "reward_timeout" in flags_given(RunConfig, args) and not (args.reward_fn or args.env):
        _fail("--reward-timeout", "needs --reward-fn or --env (it bounds the reward function's calls)")
    return max_prompt


def _role_specs(args, world_size: int, vocab_size: int, layouts: PlanLayouts) -> dict:
    """Each present role's RoleSpec: its model, its (P, D, T, E) plan from the flags or the plan
    file, checked against the model, and the actor's generation plan."""
    from puzzle.models.builders import check_layout
    from puzzle.parallel.plan import PlanError

    roles = {}
    present = role_set(args)
    _check_absent_roles(args, present)
    _check_needs(args, present)
    for role in ("actor", "critic", "ref", "reward"):
        if role not in present:
            continue
        # the tokenizer's ids are the ones a response may contain (ModelArch.valid_vocab_size)
        arch = replace(role_arch(args, role, vocab_size), tokenizer_vocab_size=vocab_size)
        layout = role_config(LayoutFlags, args, role)
        P, T = layout.pipeline_model_parallel_size, layout.tensor_model_parallel_size
        offset, D = layout.rank_offset, layout.data_parallel_size
        flags = (f"--{role}-tensor-model-parallel-size/--{role}-pipeline-model-parallel-size"
                 if role != "actor" else "--tensor-model-parallel-size/--pipeline-model-parallel-size")
        home = layouts.homes.get(role)
        if home is not None:
            P, T, offset, D = home.P, home.T, home.offset, home.D
        if offset or D:
            flags += f"/--{role}-rank-offset/--{role}-data-parallel-size"
        E, ETP = layout.expert_model_parallel_size, layout.expert_tensor_parallel_size
        if home is not None:  # a plan's expert degrees
            E, ETP = home.E, home.ETP if home.has_experts_split else None
        if E > 1 or ETP is not None:
            flags += ("/--expert-model-parallel-size/--expert-tensor-parallel-size" if role == "actor" else
                      f"/--{role}-expert-model-parallel-size/--{role}-expert-tensor-parallel-size")
        pool = args.actor_gen_rank_offset  # --rl-desired-lag's generation pool: the training roles stop before it
        size = pool - offset if home is None and D is None and 0 < pool and offset < pool else None
        plan = _plan_for(args, role, world_size, P, T, flags, offset=offset, D=D, E=E, ETP=ETP, size=size)
        try:
            check_layout(arch, plan, role)
        except PlanError as e:
            _fail(flags, str(e))
        gen_plan = (_actor_generation_plan(args, world_size, arch, plan, layouts, home, (P, T, E, ETP))
                    if role == "actor" else None)
        lr = role_config(OptimConfig, args, role).lr  # --critic-lr, else --lr
        roles[role] = from_args(RoleSpec, args, for_role=ROLES[role].weights_from, role=role, arch=arch,
                                plan=plan, gen_plan=gen_plan, lr=lr)
    return roles


def _actor_generation_plan(args, world_size: int, arch, plan, layouts: PlanLayouts, home, degrees):
    """The actor's generation plan (--actor-gen-* flags, else the plan file's, else training's
    degrees) on the training plan's ranks, checked against the model."""
    from puzzle.models.builders import check_layout
    from puzzle.parallel.plan import PlanError

    P, T, E, ETP = degrees
    gen = role_config(LayoutFlags, args, GENERATION, fallback=LayoutFlags(
        tensor_model_parallel_size=T, pipeline_model_parallel_size=P, expert_model_parallel_size=E,
        expert_tensor_parallel_size=ETP))
    gP, gT = gen.pipeline_model_parallel_size, gen.tensor_model_parallel_size
    gE, gETP = gen.expert_model_parallel_size, gen.expert_tensor_parallel_size
    if home is not None and layouts.actor_generation is not None:
        ag = layouts.actor_generation
        gP, gT, gE, gETP = ag.P, ag.T, ag.E, ag.ETP if ag.has_experts_split else None
    gflags = "--actor-gen-tensor-model-parallel-size/--actor-gen-pipeline-model-parallel-size"
    if gE > 1 or gETP is not None:
        gflags += "/--actor-gen-expert-model-parallel-size/--actor-gen-expert-tensor-parallel-size"
    offset, size, D = plan.offset, plan.size, None
    if args.actor_gen_rank_offset or args.actor_gen_data_parallel_size:  # the generation pool (--rl-desired-lag)
        gflags += "/--actor-gen-rank-offset/--actor-gen-data-parallel-size"
        offset, size, D = args.actor_gen_rank_offset, None, args.actor_gen_data_parallel_size
    gen_plan = _plan_for(args, "actor generation", world_size, gP, gT, gflags,
                         offset=offset, size=size, D=D, E=gE, ETP=gETP)
    try:
        check_layout(arch, gen_plan, "actor (generation layout)")
    except PlanError as e:
        _fail(gflags, str(e))
    return gen_plan


def _check_batch_division(args, roles, samples: int, mini: int) -> None:
    """The rollout batch splits into PPO mini-batches, micro-batches of every role's data-parallel
    ranks and the actor generation's ranks (and --generation-micro-batch-size divides those)."""
    N = args.n_samples_per_prompt
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


def _check_transformer_impl(args, roles):
    """--transformer-impl resolved on this machine, with the generation device and sequence
    parallelism checked against it. Returns (impl, note)."""
    from puzzle.models.builders import resolve_transformer_impl

    impl, impl_note = resolve_transformer_impl(args.transformer_impl)
    _check_generation_device(args, roles["actor"].arch.attention_backend, impl)
    if args.sequence_parallel and impl == "local" and any(r.plan.T > 1 for r in roles.values()):
        _fail("--sequence-parallel", "needs --transformer-impl transformer_engine (TE on a CUDA machine): "
                                     "megatron-core's local layer spec normalises with torch norms, which "
                                     "refuse sequence parallelism" + (f" ({impl_note})" if impl_note else ""))
    return impl, impl_note


def _check_token_budget(ppo):
    """--use-dynamic-bsz and its budgets (puzzle/dataflow/token_budget.py): packed micro-batches
    only, each budget at least the longest sequence; the scoring budget defaults to the
    training one. Returns ``ppo`` with it filled in."""
    budgets = {"--ppo-max-token-len-per-gpu": ppo.ppo_max_token_len_per_gpu,
               "--log-prob-max-token-len-per-gpu": ppo.log_prob_max_token_len_per_gpu}
    if not ppo.use_dynamic_bsz:
        for name, value in budgets.items():
            if value is not None:
                _fail(name, "needs --use-dynamic-bsz (token-budget micro-batches)")
        return ppo
    if ppo.ppo_max_token_len_per_gpu is None:
        _fail("--use-dynamic-bsz", "needs --ppo-max-token-len-per-gpu (tokens per micro-batch)")
    if not ppo.use_remove_padding:
        _fail("--use-dynamic-bsz", "needs packed micro-batches (--no-use-remove-padding was given)")
    longest = ppo.max_prompt_length + ppo.max_new_tokens
    for name, value in budgets.items():
        if value is not None and value < longest:
            _fail(name, f"{value} tokens is less than the longest sequence: max prompt length "
                        f"{ppo.max_prompt_length} + max new tokens {ppo.max_new_tokens} = {longest} (a "
                        "sequence is never split over micro-batches)")
    if ppo.log_prob_max_token_len_per_gpu is None:
        ppo = replace(ppo, log_prob_max_token_len_per_gpu=ppo.ppo_max_token_len_per_gpu)
    return ppo


def _check_moe_graph_decode(gen) -> None:
    """--cuda-graph-generation of a MoE actor: its decode step runs every expert on every row
    (puzzle/models/moe_decode.py), which needs all of a layer's experts whole on each rank of
    the generation layout; megatron's token dispatchers, which read token counts on the host,
    cannot be captured."""
    if gen.E > 1 or gen.ETP > 1:
        _fail("--cuda-graph-generation", f"a MoE actor's graphed decode step needs every expert whole on each "
                                         f"rank of the generation layout (E=1, ETP=1; {gen} has E={gen.E}, "
                                         f"ETP={gen.ETP}; ETP is T unless set): pass "
                                         f"--actor-gen-expert-model-parallel-size 1 "
                                         f"--actor-gen-expert-tensor-parallel-size 1, or leave the flag out")


def _check_moe_grouped_gemm(role: str, spec) -> None:
    """--moe-grouped-gemm (puzzle/models/moe_experts.py): torch._grouped_mm takes operands whose
    strides are 16-byte multiples, so hidden size and expert width per ETP rank must be multiples
    of 8 at every layout the role runs; the grouped experts have no biases."""
    arch = spec.arch
    if not arch.moe_grouped_gemm:
        return
    if arch.add_bias_linear:
        _fail("--moe-grouped-gemm", f"the {role}'s experts have biases (--add-bias-linear); the grouped experts have none")
    for plan in (spec.plan, spec.gen_plan or spec.plan):
        width = arch.moe_ffn_hidden_size // plan.ETP
        if arch.hidden_size % 8 or width % 8:
            _fail("--moe-grouped-gemm", f"the {role} at {plan}: hidden size {arch.hidden_size} and expert width per "
                                        f"expert-tensor-parallel rank {width} (--moe-ffn-hidden-size "
                                        f"{arch.moe_ffn_hidden_size} / ETP {plan.ETP}) must be multiples of 8")


def _check_moe_paths(args, roles, transformer_impl: str) -> None:
    """Mixture-of-experts models run generation, scoring and training (also at T > 1 without
    sequence parallelism: megatron_patches.moe_tensor_parallel_without_sp); the paths not built
    for them yet are refused here, before anything is allocated."""
    moe = [r for r, spec in roles.items() if spec.arch.is_moe]
    if not moe:
        return
    if args.cuda_graph_generation and roles["actor"].arch.is_moe:
        _check_moe_graph_decode(roles["actor"].gen_plan)
    if transformer_impl == "transformer_engine":
        _fail("--transformer-impl", "MoE models run megatron-core's local layer spec (SequentialMLP experts); "
                                    "the transformer-engine MoE spec is not supported yet: use --transformer-impl local")
    for r in moe:
        _check_moe_grouped_gemm(r, roles[r])
    seq_aux = [r for r in moe if ROLES[r].trainable and roles[r].arch.moe_aux_loss_coeff > 0
               and roles[r].arch.moe_router_load_balancing_type == "seq_aux_loss"]
    if seq_aux and args.use_remove_padding:
        _fail("--moe-router-load-balancing-type", f"seq_aux_loss of the {seq_aux[0]}: megatron's router balances "
                                                  "per row of a micro-batch, and a packed micro-batch is one row of "
                                                  "many sequences; use aux_loss, or --no-use-remove-padding")


def _check_batch_invariant(ppo, roles) -> None:
    """--batch-invariant-mode (puzzle/models/batch_invariant.py) where its parity holds: on CPU, with
    the actor generating at the T it is scored at."""
    from puzzle.parallel.device import accelerator_available

    if not ppo.batch_invariant_mode:
        return
    if accelerator_available():
        _fail("--batch-invariant-mode", "runs on CPU only: on CUDA the matrix products and attention need "
                                        "fixed-tile kernels that are not built yet (docs/ppo.md 'True on-policy'); "
                                        "leave the flag out (--rl-inference-logprobs-is-correction corrects for "
                                        "the mismatch instead)")
    actor = roles["actor"]
    gen = actor.gen_plan or actor.plan
    if gen.T != actor.plan.T:
        _fail("--batch-invariant-mode", f"the actor generates at T={gen.T} and is scored at T={actor.plan.T}: "
                                        "tensor parallelism splits the row-parallel products' sums (and the "
                                        "vocabulary) by T, so the two cannot compute the same log-probs; give "
                                        f"--actor-gen-tensor-model-parallel-size {actor.plan.T}")
    etp = max(actor.plan.ETP, gen.ETP) if actor.arch.is_moe else 1
    if etp > 2:
        _fail("--batch-invariant-mode", f"the actor's experts are split over ETP={etp} ranks: their partial sums are "
                                        "reduce-scattered in the ring's order, which follows the message size; "
                                        "give --expert-tensor-parallel-size 1 or 2")


def _kv_budget_micro_batch(levers: MemoryLevers, ppo, actor, samples_per_rank: int, value_bytes: int):
    """--inference-dynamic-batching-buffer-size-gb: the generation micro-batch (KV-cache rows of the
    continuous-batching loop) that fits the budget, the largest that divides the rank's samples."""
    budget = levers.inference_dynamic_batching_buffer_size_gb
    if budget is None:
        return ppo
    flag = "--inference-dynamic-batching-buffer-size-gb"
    if ppo.generation_micro_batch_size is not None:
        _fail(flag, "sets --generation-micro-batch-size from the KV budget; give one of them")
    gen = actor.gen_plan
    if gen.P > 1:
        _fail(flag, f"needs an actor generation layout with P=1 (continuous batching; got P={gen.P})")
    width = ppo.max_prompt_length + ppo.max_new_tokens
    per_seq = actor.arch.shape.kv_bytes_per_sequence(width, gen, value_bytes)
    fit = int(budget * (1 << 30) // per_seq)
    if fit < 1:
        _fail(flag, f"{budget} GiB holds no sequence of {width} tokens ({per_seq / (1 << 30):.2f} GiB each)")
    rows = max(d for d in range(1, min(fit, samples_per_rank) + 1) if samples_per_rank % d == 0)
    return replace(ppo, generation_micro_batch_size=rows)


def _check_recompute_layers(levers: MemoryLevers, roles) -> None:
    """--recompute-num-layers fits every trainable model's layers per pipeline stage."""
    n = levers.recompute_num_layers
    for role, spec in roles.items():
        per_stage = spec.arch.num_layers // spec.plan.P
        if n is not None and ROLES[role].trainable and n > per_stage:
            _fail("--recompute-num-layers", f"{n} exceeds the {role}'s {per_stage} layers per pipeline stage")


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
    if not args.reward_fn and not args.env and not args.reward_model and not args.hf_reward_path \
            and not args.reward_pretrained_checkpoint:
        args.reward_model = "random"
    return validate_args(args, resolve_world_size(args), resolve_vocab_size(args), check_paths=False,
                         layouts=layouts)


def plan_flags(doc: dict, strict: bool = False, roles=None) -> List[str]:
    """The layout and placement flags of a plan document for a run that builds ``roles`` (default:
    all of the plan's; see puzzle.plan_layouts)."""
    return layouts_as_flags(read_plan_document(doc, strict=strict), roles)
