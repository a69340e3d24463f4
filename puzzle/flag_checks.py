"""Value checks of single flags, run by ``validate_args`` before any process group or model exists.

``check_values`` needs nothing but the parsed flags; ``check_environment`` looks at this machine
(writable output directories, a GPU for --fp16, the optional logging packages). Every error is an
ArgumentError whose message starts with the flag's name.
"""

from __future__ import annotations

import os
import uuid

from puzzle.config_flags import ArgumentError, fail  # noqa: F401  (the error of every flag check)




def _at_least(args, flag: str, low, *, strict: bool = False, optional: bool = False):
    value = getattr(args, flag.lstrip("-").replace("-", "_"))
    if value is None and optional:
        return
    if value < low or (strict and value == low):
        fail(flag, f"must be {'>' if strict else '>='} {low} (got {value})")


def check_values(args) -> None:
    """Ranges and combinations of the flags that are read before their config is built (pure: no
    files, no devices); the configs check their other fields themselves."""
    from puzzle.data.tokenizers import BYTE_NAMES

    _at_least(args, "--critic-lr", 0, optional=True)
    if args.tokenizer_model and args.tokenizer_type in BYTE_NAMES:
        fail("--tokenizer-model", f"--tokenizer-type {args.tokenizer_type} reads no files (got "
                                  f"{args.tokenizer_model!r}); use --tokenizer-type HuggingFaceTokenizer")
    _at_least(args, "--seq-length", 1)
    for flag in ("--global-batch-size", "--max-prompt-length", "--max-position-embeddings"):
        _at_least(args, flag, 1, optional=True)
    for flag, lr in (("--lr", args.lr), ("--critic-lr", args.critic_lr)):
        if lr is not None and args.min_lr > lr:
            fail("--min-lr", f"{args.min_lr} exceeds {flag} {lr}")
    if args.max_position_embeddings is not None and args.seq_length > args.max_position_embeddings:
        fail("--seq-length", f"{args.seq_length} exceeds --max-position-embeddings "
                              f"{args.max_position_embeddings}")
    if args.keep_last_checkpoints is not None and not args.save:
        fail("--keep-last-checkpoints", "needs --save DIR")


def _check_writable(flag: str, path: str) -> None:
    """Create ``path`` (as the run would) and a file in it; the message says why not."""
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".write-test-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as e:
        fail(flag, f"{path!r} is not a writable directory ({e.strerror or e})")


def check_environment(args) -> None:
    """What the run needs from this machine, checked before it starts."""
    for flag in ("save", "log_dir", "tensorboard_dir", "wandb_save_dir"):
        path = getattr(args, flag)
        if path:
            _check_writable("--" + flag.replace("_", "-"), path)
    if args.fp16:
        import torch

        if not torch.cuda.is_available():
            fail("--fp16", "fp16 training needs a GPU (its loss scaling and kernels are CUDA-only); "
                            "on CPU train in fp32 (the default) or --bf16")
    if args.tensorboard_dir:
        try:
            from torch.utils.tensorboard import SummaryWriter  # noqa: F401
        except ImportError:
            fail("--tensorboard-dir", "the tensorboard package is not installed "
                                       "(pip install -e '.[tb]')")
    if args.wandb_project:
        try:
            import wandb  # noqa: F401
        except ImportError:
            fail("--wandb-project", "the wandb package is not installed (pip install -e '.[wandb]')")


def check_algorithm_args(args) -> None:
    """The GRPO-family / DAPO / reward-function flags and their combinations."""
    from puzzle.algorithms.advantage_estimators import ESTIMATORS

    est, N = args.advantage_estimator, args.n_samples_per_prompt
    spec = ESTIMATORS[est]
    if spec.needs_groups and N < 2:
        fail("--n-samples-per-prompt", f"--advantage-estimator {est} compares the samples of a prompt: "
                                        f"it needs at least 2 samples per prompt (got {N})")
    if args.filter_groups:
        if est == "gae":
            fail("--filter-groups", "dynamic sampling filters groups of samples; it needs a group "
                                     "estimator (--advantage-estimator grpo, rloo, ...), not gae")
        if N < 2:
            fail("--filter-groups", f"needs --n-samples-per-prompt >= 2 (got {N})")
        if not args.reward_fn:
            fail("--filter-groups", "needs --reward-fn (groups are filtered in the generation stage)")
        if spec.needs_greedy_baseline:
            fail("--filter-groups", "not with --advantage-estimator remax (its greedy baseline is generated "
                                     "for the iteration's first prompts)")
    if getattr(args, "max_turns", 1) > 1:  # multi-turn episodes score the rows as they are generated
        for given, what in ((args.filter_groups, "--filter-groups"), (spec.needs_greedy_baseline, f"--advantage-estimator {est}")):
            if given:
                fail("--max-turns", f"multi-turn samples are not yet scored for {what}")
    if spec.needs_greedy_baseline and not args.reward_fn:
        fail("--advantage-estimator", "remax scores its greedy baseline in the generation stage: it needs "
                                       "--reward-fn, not a reward model")
    check_partial_rollouts(args, spec)


def check_partial_rollouts(args, spec) -> None:
    """--rl-partial-rollouts and its over-sampling factor (the layout's part: arguments.py)."""
    if args.rl_partial_rollouts_oversample < 1:
        fail("--rl-partial-rollouts-oversample", f"must be >= 1 (the groups served per iteration over the "
                                                 f"batch's; got {args.rl_partial_rollouts_oversample})")
    stale = getattr(args, "rl_partial_rollouts_max_staleness", None)
    if stale is not None and stale < 0:
        fail("--rl-partial-rollouts-max-staleness", f"must be >= 0 (policy versions a trained token may lag "
                                                    f"the batch's; got {stale})")
    if not args.rl_partial_rollouts:
        return
    if spec.needs_greedy_baseline:
        # the baseline is the greedy response of the policy that trains: a sample carried from an
        # older policy would be compared with a baseline of another policy
        fail("--rl-partial-rollouts", "not with --advantage-estimator remax: its baseline is a greedy response "
                                      "of the current policy, which a carried (stale) sample does not share")
    if args.filter_groups:
        fail("--rl-partial-rollouts", "not with --filter-groups (dynamic sampling over-generates in rounds "
                                      "of whole groups; the two would serve the same prompts twice)")
    if not args.rl_inference_logprobs_is_correction:
        fail("--rl-partial-rollouts", "needs --rl-inference-logprobs-is-correction: carried tokens were sampled "
                                      "under an older policy and the loss must weight them by the log-probs "
                                      "they were sampled with (decoupled PPO)")


def check_partial_generation(gen) -> None:
    """--rl-partial-rollouts: the stop rule runs in continuous batching (P=1) and counts one
    share's groups (the carried samples are the same on every rank). Multi-turn samples (--max-turns
    > 1) are carried mid-episode (puzzle/dataflow/partial_stage.py), at any T (the TP group's first
    rank steps the episodes and holds their instances)."""
    if gen.P > 1:
        fail("--rl-partial-rollouts", f"needs an actor generation layout with P=1 (the quota stops continuous "
                                       f"batching; got P={gen.P})")
    shares = gen.generation_share(gen.offset)[1]
    if shares > 1:
        fail("--rl-partial-rollouts", f"the actor generates in {shares} data-parallel shares; partial rollouts "
                                       f"need one (give --actor-gen-tensor-model-parallel-size so that the "
                                       f"generation layout has D=1)")


def check_generation_pool(args, roles, world_size: int) -> None:
    """--rl-desired-lag and the generation pool (--actor-gen-rank-offset): the pool on ranks no
    training role uses, as many as the actor's training layout (the switch maps rank to rank),
    rank 0 a training rank (it writes the metrics), and what the overlapped rounds cannot do yet
    (--save/--load and --eval-prompts they do: puzzle/dataflow/trainer.py _train_overlapped; a
    checkpoint's batches in flight that a lag cannot take: checkpointing.in_flight_problem)."""
    lag, gen, actor = args.rl_desired_lag, roles["actor"].gen_plan, roles["actor"].plan
    if args.actor_gen_rank_offset or args.actor_gen_data_parallel_size:
        flag = "--actor-gen-rank-offset"
        used = {r: spec.plan for r, spec in roles.items() if set(spec.plan.ranks) & set(gen.ranks)}
        if used:
            fail(flag, f"the generation pool {gen} (ranks {gen.ranks[0]}..{gen.ranks[-1]}) overlaps "
                       + ", ".join(f"{r} {p}" for r, p in used.items())
                       + "; the training roles must stay on the ranks before it")
        if gen.offset == 0:
            fail(flag, "the generation pool must not hold rank 0 (rank 0 trains and writes the metrics)")
        if gen.size != actor.size:
            fail(flag, f"the generation pool {gen} has {gen.size} ranks, the actor's training layout {actor} "
                       f"{actor.size}: the switch maps the pools rank to rank (give them equal sizes)")
    elif lag:
        fail("--rl-desired-lag", f"a lag of {lag} needs a generation pool on ranks of its own "
                                 "(--actor-gen-rank-offset); colocated generation cannot overlap training")
    if not lag:
        return
    reasons = [(not args.rl_inference_logprobs_is_correction, "needs --rl-inference-logprobs-is-correction "
                "(the loss must use the log-probs each token was sampled under)"),
               (args.rl_partial_rollouts, "not with --rl-partial-rollouts yet"),
               (gen.P > 1, f"needs an actor generation layout with P=1 (got P={gen.P})"),
               (bool(args.num_experts), "not with MoE models (--num-experts) yet"),
               (getattr(args, "max_turns", 1) > 1, "not with --max-turns > 1 yet"),
               (args.filter_groups, "not with --filter-groups (its rounds score in the generation stage)"),
               (args.advantage_estimator == "remax", "not with --advantage-estimator remax (its greedy "
                                                     "baseline is the training policy's)")]
    for bad, why in reasons:
        if bad:
            fail("--rl-desired-lag", why)
