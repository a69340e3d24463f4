"""Command-line driver behind train_ppo.py (kept out of the entry script so it can be tested)."""

from __future__ import annotations

import os
import sys
from dataclasses import replace

from puzzle.parallel import launcher

#: environment variables through which the tests inject faults into a real run (config.FaultInjection)
NONFINITE_ENV = "PUZZLE_TEST_NONFINITE_AT"  # "role:iteration[,role:iteration]": a NaN gradient
FAIL_SAVE_ENV = "PUZZLE_TEST_FAIL_SAVE_AT"  # "rank:iteration": that rank raises half way through the save


def run(argv) -> int:
    from puzzle.arguments import ArgumentError, parse_args, validate_args
    from puzzle.data.prompts import bundled_prompts_path, load_prompt_dataset
    from puzzle.data.tokenizers import build_tokenizer, fit_to_rows

    rank = launcher.rank()
    if rank != 0 and any(a in ("-h", "--help") for a in argv):
        return 0  # the usage text once, from rank 0
    try:  # everything is checked before torch.distributed starts and before any allocation
        args = parse_args(argv)
        layouts = _plan_layouts(args)
        if args.dry_run:
            return _dry_run(args, layouts, rank)
        world_size = launcher.world_size()
        if args.world_size is not None and args.world_size != world_size:
            raise ArgumentError(f"--world-size: {args.world_size} but the job has {world_size} ranks")
        tokenizer = build_tokenizer(args.tokenizer_type, args.tokenizer_model)
        cfg = validate_args(args, world_size, tokenizer.vocab_size, layouts=layouts)
        cfg = replace(cfg, faults=fault_injection_from_env(os.environ))
        if cfg.reward_fn:
            from puzzle.reward_functions import load_reward_fn

            load_reward_fn(cfg.reward_fn)
        dataset = load_prompt_dataset(cfg.prompt_data or bundled_prompts_path(), tokenizer,
                                      cfg.prompt_key, max_prompt_len=cfg.ppo.max_prompt_length,
                                      overflow=cfg.prompt_overflow, split=cfg.prompt_split,
                                      apply_chat_template=cfg.apply_chat_template,
                                      skip_bad_records=cfg.skip_bad_records)
        eval_dataset = _eval_dataset(cfg, tokenizer)
        for data, source in ((dataset, cfg.prompt_data or "the bundled prompts"), (eval_dataset, "--eval-prompts")):
            if data is not None:  # ids beyond the model's rows: never fed (a pad beyond them: padding feeds eos)
                fit_to_rows(tokenizer, cfg.roles["actor"].arch.vocab_size, data.prompts, source=source)
    except (ArgumentError, ValueError, OSError) as e:  # OSError: unreadable tokenizer or data files
        from puzzle.tools.fail_fast import report_usage_error

        return report_usage_error(e)
    if rank == 0:
        _print_plan(cfg)
    return _train(cfg, tokenizer, dataset, eval_dataset)


def _eval_dataset(cfg, tokenizer):
    """--eval-prompts, read like --prompt-data and checked against --eval-iters; None without it
    or with --eval-iters 0."""
    from puzzle.arguments import ArgumentError
    from puzzle.data.prompts import load_prompt_dataset
    from puzzle.evaluation import eval_batches

    ev = cfg.evaluation
    if not ev.enabled:
        return None
    try:
        data = load_prompt_dataset(ev.prompts, tokenizer, cfg.prompt_key, max_prompt_len=cfg.ppo.max_prompt_length,
                                   overflow=cfg.prompt_overflow, apply_chat_template=cfg.apply_chat_template,
                                   skip_bad_records=cfg.skip_bad_records)
        eval_batches(len(data.prompts), cfg.ppo.rollout_batch_size, ev.iters)
    except (ValueError, OSError) as e:  # the loader's messages name --prompt-data
        raise ArgumentError(f"--eval-prompts: {str(e).replace('--prompt-data ', '')}") from None
    return data


def fault_injection_from_env(environ):
    """The faults the tests ask for ($PUZZLE_TEST_NONFINITE_AT, $PUZZLE_TEST_FAIL_SAVE_AT), read
    once here and carried by RunConfig.faults; none in an ordinary run."""
    from puzzle.config import FaultInjection

    def pairs(name: str, first):
        out = []
        for item in filter(None, environ.get(name, "").split(",")):
            head, sep, iteration = item.rpartition(":")
            if not sep or not iteration.isdigit() or not (head.isdigit() if first is int else head):
                raise ValueError(f"${name}: expected {'role' if first is str else 'rank'}:iteration, got {item!r}")
            out.append((first(head), int(iteration)))
        return tuple(out)

    saves = pairs(FAIL_SAVE_ENV, int)
    if len(saves) > 1:
        raise ValueError(f"${FAIL_SAVE_ENV}: one rank:iteration (got {len(saves)})")
    return FaultInjection(nonfinite_grads=pairs(NONFINITE_ENV, str), fail_save_at=saves[0] if saves else None)


def _error_once(message: str) -> None:
    if launcher.rank() == 0:
        print(f"error: {message}", file=sys.stderr, flush=True)


def _plan_layouts(args):
    """--plan-file / --plan auto: the plan's layouts and placements (PlanLayouts), which replace the
    layout flags given on the command line (or by a launch script); None without a plan."""
    from puzzle.arguments import ArgumentError, config_for_planning, role_set
    from puzzle.plan_layouts import layouts_as_flags, read_plan_document

    if args.plan_file and args.plan == "auto":
        raise ArgumentError("--plan-file: give either --plan-file or --plan auto")
    if args.profile and args.plan != "auto" and not args.dry_run:
        raise ArgumentError("--profile: used by --plan auto and --dry-run only (this run takes its layouts "
                            "from the flags or --plan-file)")
    if args.plan_file:
        import json

        try:
            with open(args.plan_file) as f:
                doc = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ArgumentError(f"--plan-file: cannot read {args.plan_file!r} ({e})") from None
    elif args.plan == "auto":
        from puzzle.plan_search.command import search
        from puzzle.plan_search.profile_data import load_profile
        from puzzle.plan_search.search import InfeasibleError

        try:
            result, _ = search(config_for_planning(args), load_profile(args.profile or "a100_80gb"))
        except InfeasibleError as e:
            raise ArgumentError(f"--plan: no plan fits: {e}") from None
        doc = result.to_dict()
    else:
        return None
    layouts = read_plan_document(doc)
    levers = _apply_plan_levers(args, doc.get("levers") or {})
    if launcher.rank() == 0:  # the flags that give the same layouts
        print("plan: " + " ".join(layouts_as_flags(layouts, role_set(args)) + levers), flush=True)
    return layouts


def _apply_plan_levers(args, levers: dict) -> list:
    """The memory levers a plan needs (recompute, offload, generation micro-batch) set on ``args``;
    returns them as flags. The plan's generation micro-batch replaces a KV budget."""
    from puzzle.plan_search.command import lever_argv

    for flag, value in levers.items():
        setattr(args, flag[2:].replace("-", "_"), value)
        if flag == "--generation-micro-batch-size":
            args.inference_dynamic_batching_buffer_size_gb = None
    return lever_argv(levers)


def _dry_run(args, layouts, rank: int) -> int:
    from puzzle.arguments import config_for_planning
    from puzzle.plan_search.command import print_dry_run
    from puzzle.plan_search.profile_data import load_profile

    cfg = config_for_planning(args, layouts)
    fits = True
    if rank == 0:
        _print_plan(cfg)
        fits = print_dry_run(cfg, load_profile(args.profile or "a100_80gb"))
    return 0 if fits else 3


def _print_plan(cfg) -> None:
    print(f"puzzle PPO: world size {cfg.world_size}", flush=True)
    if getattr(cfg, "transformer_impl_note", None):
        print(cfg.transformer_impl_note, flush=True)
    for role, spec in cfg.roles.items():
        gen = f", generation {spec.gen_plan}" if spec.gen_plan is not None and spec.gen_plan != spec.plan else ""
        a = spec.arch
        print(f"  {role:7s} layers={a.num_layers} hidden={a.hidden_size} heads={a.num_attention_heads}"
              f"/{a.num_query_groups} layout {spec.plan}{gen} {'trainable' if spec.trainable else 'frozen'}",
              flush=True)


def _watch(trainer, cfg, tokenizer, eval_dataset):
    """The run loop's additions to each iteration (trainer.on_iteration_end): learning rates and
    tokens/s in the metrics, --log-samples rows, evaluation when due; a progress bar of each
    generation on a terminal. Returns the Evaluator (or None) and the sample log."""
    from puzzle.metrics import GenerationProgress, SampleLog, learning_rates, rollout_sample_rows, tokens_per_second

    rank = trainer.rank
    evaluator = None
    if eval_dataset is not None:
        from puzzle.evaluation import Evaluator

        evaluator = Evaluator(cfg, tokenizer, eval_dataset, rank, resumed_from=trainer.iteration)
    samples = SampleLog(cfg.log_dir, cfg.ops.log_samples, rank, trainer.iteration) if cfg.ops.log_samples else None
    where = trainer.progress  # run_control.Progress: "generation stage" or "evaluation"
    trainer.generation_progress = GenerationProgress.for_terminal(
        rank, lambda: f"iteration {where.iteration} {getattr(where, 'phase', 'generation')}")

    def on_iteration_end(batch, metrics):
        metrics.update(learning_rates(trainer.engines, trainer.runtime))
        metrics["tokens_per_sec"] = tokens_per_second(batch, metrics)
        if samples is not None and rank == 0:
            samples.write(rollout_sample_rows(batch, tokenizer, trainer.iteration, cfg.ops.log_samples))
        if evaluator is not None and evaluator.due(trainer.iteration):
            trainer.progress(trainer.iteration, "evaluation")
            metrics.update(evaluator(trainer, trainer.iteration))

    trainer.on_iteration_end = on_iteration_end
    return evaluator, samples


def _train(cfg, tokenizer, dataset, eval_dataset=None) -> int:
    import time

    from puzzle import checkpointing, run_control, save_failures
    from puzzle.data.prompts import PromptLoader
    from puzzle.parallel.groups import DeviceSharingError, init_distributed
    from puzzle.reward_functions import BadRewardError
    from puzzle.trainer import PPOTrainer
    from puzzle.training.nonfinite import NonFiniteError

    start = time.time()
    ckpt_step = cfg.ckpt_step
    if cfg.load:  # metadata and file sizes only: a wrong model shape or a missing file fails here
        try:
            checkpointing.check_checkpoint(cfg, cfg.load, ckpt_step)
        except checkpointing.CheckpointError as e:
            _error_once(str(e))
            return 2
    try:
        init_distributed(backend=cfg.ops.distributed_backend, timeout_minutes=cfg.ops.distributed_timeout_minutes)
    except DeviceSharingError as e:
        _error_once(str(e))
        return 2
    progress = run_control.Progress()
    exit_control = run_control.ExitControl(cfg.ops, start)
    trainer = None
    try:
        if cfg.load:  # checksums, the ranks sharing the work; still before any model is built
            progress(0, "checkpoint verification")
            ckpt_step = checkpointing.verify_checkpoint(cfg.load, ckpt_step)
        loader = PromptLoader(dataset.prompts, cfg.ppo.rollout_batch_size, dp_rank=0, dp_size=1,
                              seed=cfg.seed)
        progress(0, "model building")
        trainer = PPOTrainer(cfg, tokenizer, dataset)
        trainer.progress = progress
        if cfg.load and ckpt_step is not None:
            progress(0, "checkpoint loading")
            checkpointing.load_checkpoint(trainer, loader, cfg.load, load_optim=cfg.load_optim,
                                          load_rng=cfg.load_rng, iteration=ckpt_step)
        _run_iterations(trainer, loader, dataset, cfg, progress, exit_control, eval_dataset, tokenizer)
    except checkpointing.CheckpointError as e:
        _error_once(str(e))
        return _shutdown(trainer, 2)
    except NonFiniteError as e:
        _error_once(str(e))
        return _shutdown(trainer, 3)
    except BadRewardError as e:  # raised on every rank alike (--on-bad-reward error)
        _error_once(str(e))
        return _shutdown(trainer, 1)
    except save_failures.SaveError as e:  # one rank's message; another rank may be inside the save
        save_failures.exit_after_failed_save(e)
    except RuntimeError as e:
        if run_control.is_timeout(e):
            run_control.abort(run_control.describe_timeout(progress, e, cfg.ops.distributed_timeout_minutes))
        raise
    finally:
        exit_control.close()
    return _shutdown(trainer, 0)


def _run_iterations(trainer, loader, dataset, cfg, progress, exit_control, eval_dataset, tokenizer) -> None:
    """The training loop: evaluation at iteration 0, the PPO steps, saves at --save-interval and
    at the end, and the exit checks (--exit-interval, --exit-duration-in-mins, signals)."""
    import torch.distributed as dist

    saved = trainer.iteration
    evaluator, samples = _watch(trainer, cfg, tokenizer, eval_dataset)
    if evaluator is not None and trainer.iteration == 0:  # before training (a resumed run has its own)
        progress(0, "evaluation")
        trainer.logger.log({"iteration": 0, **evaluator(trainer, 0)})

    def next_prompts():  # token ids and the records' other fields (ground truth for rewards)
        pb = next(loader)
        return pb.prompts, [dataset.records[i] if dataset.records else {} for i in pb.indices]

    while trainer.iteration < cfg.train_iters:
        trainer.step(*next_prompts(), refill=next_prompts)
        if cfg.save and cfg.save_interval and trainer.iteration % cfg.save_interval == 0:
            _save(trainer, loader, cfg, progress)
            saved = trainer.iteration
        progress(trainer.iteration, "exit check")
        reason = exit_control.reason_to_exit(trainer.iteration)
        if reason:
            if dist.get_rank() == 0:
                print(f"exiting after iteration {trainer.iteration}: {reason}"
                      + ("" if cfg.save else " (no --save: nothing saved)"), flush=True)
            break
    if cfg.save and saved != trainer.iteration:  # the final state, as Megatron-LM does
        _save(trainer, loader, cfg, progress)
    for log in (evaluator, samples):
        if log is not None:
            log.close()


def _save(trainer, loader, cfg, progress) -> None:
    from puzzle import checkpointing

    progress(trainer.iteration, "checkpoint saving")
    checkpointing.save_checkpoint(trainer, loader, cfg.save, keep_last=cfg.ops.keep_last_checkpoints)


def _shutdown(trainer, code: int) -> int:
    """Every rank reaches here with the same outcome (errors above are collective decisions)."""
    import torch.distributed as dist

    if trainer is not None:
        trainer.close()
    dist.barrier()
    dist.destroy_process_group()
    return code
