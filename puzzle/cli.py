"""Command-line driver behind train_ppo.py (kept out of the entry script so it can be tested)."""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from typing import Optional

from puzzle import weight_sources
from puzzle.parallel import launcher

#: environment variables through which the tests inject faults into a real run (config.FaultInjection)
NONFINITE_ENV = "PUZZLE_TEST_NONFINITE_AT"  # "role:iteration[,role:iteration]": a NaN gradient
FAIL_SAVE_ENV = "PUZZLE_TEST_FAIL_SAVE_AT"  # "rank:iteration": that rank raises half way through the save
#: set by puzzle.tools.launch: rank 0 writes its ``error:`` line and exit status here (JSON) instead
#: of printing it, and the launcher prints it last, after torchrun has stopped every rank


def run(argv) -> int:
    """train_ppo.py: check everything, then train (or print the --dry-run estimate)."""
    rank = launcher.rank()
    if rank != 0 and any(a in ("-h", "--help") for a in argv):
        return 0  # the usage text once, from rank 0
    checked = _checked(argv, launcher.world_size())
    if isinstance(checked, int):  # bad input, or a dry run's verdict
        return checked
    cfg, args, tokenizer, dataset, eval_dataset = checked
    if rank == 0:
        _print_plan(cfg)
        write_run_config(cfg, argv, args)
    return _train(cfg, tokenizer, dataset, eval_dataset)


def preflight(argv, world_size: int):
    """The launcher's check before it starts torchrun (puzzle.tools.launch), in one plain process:
    the same checks as ``run`` for a job of ``world_size`` ranks (flags, plan, tokenizer, reward
    function, prompt files, the checkpoint's metadata). Returns None when the job can start, else
    the exit status: bad input (its one ``error:`` line printed), --help, or a --dry-run's
    verdict (its output printed). What the checks print on success is dropped: rank 0 prints it
    again."""
    import contextlib
    import io

    if any(a in ("-h", "--help") for a in argv):
        return _usage(argv)
    quiet = io.StringIO()
    with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
        checked = _checked(argv, world_size, report=False)
    if isinstance(checked, BaseException):
        return _report(checked)
    if isinstance(checked, int):  # a dry run: what it printed is its answer
        sys.stdout.write(quiet.getvalue())
        sys.stdout.flush()
        return checked
    return None


def _usage(argv) -> int:
    """--help: the usage text (argparse prints it and exits), or the flag error met first."""
    from puzzle.arguments import ArgumentError, parse_args

    try:
        parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    except ArgumentError as e:
        return _report(e)
    return 0


def _checked(argv, world_size: int, report: bool = True):
    """Everything train_ppo.py checks before torch.distributed starts and before any allocation:
    (cfg, parsed args, tokenizer, dataset, eval dataset); or an exit status (a dry run; bad input,
    reported once) -- with ``report=False`` bad input is returned as the exception."""
    from puzzle import checkpointing
    from puzzle.arguments import ArgumentError, parse_args, validate_args
    from puzzle.data.prompts import bundled_prompts_path, load_prompt_dataset
    from puzzle.data.tokenizers import build_tokenizer, fit_to_rows

    try:
        args = parse_args(argv)
        if not args.dry_run and args.world_size is not None and args.world_size != world_size:
            raise ArgumentError(f"--world-size: {args.world_size} but the job has {world_size} ranks")
        if args.world_size is None:  # --plan auto and --dry-run plan for the job's ranks
            args.world_size = world_size
        layouts = _plan_layouts(args)
        if args.dry_run:
            return _dry_run(args, layouts, launcher.rank())
        tokenizer = build_tokenizer(args.tokenizer_type, args.tokenizer_model)
        cfg = validate_args(args, world_size, tokenizer.vocab_size, layouts=layouts)
        weight_sources.check(cfg)  # a trainable role at random weights needs --init-random
        cfg = replace(cfg, faults=fault_injection_from_env(os.environ))
        if cfg.reward_fn:
            from puzzle.reward_functions import load_reward_fn

            load_reward_fn(cfg.reward_fn)
        if cfg.env:  # an unknown environment is refused here, naming it
            from puzzle.reward_functions.environments import EnvSpec, check_turn_setup

            check_turn_setup(EnvSpec.of(cfg.env, cfg.reward_fn), cfg.max_turns, cfg.max_observation_tokens, tokenizer,
                             chat_template=cfg.apply_chat_template)
        dataset = load_prompt_dataset(cfg.prompt_data or bundled_prompts_path(), tokenizer,
                                      cfg.prompt_key, max_prompt_len=cfg.ppo.max_prompt_length,
                                      overflow=cfg.prompt_overflow, split=cfg.prompt_split,
                                      apply_chat_template=cfg.apply_chat_template,
                                      skip_bad_records=cfg.skip_bad_records, answer_key=cfg.answer_key)
        eval_dataset = _eval_dataset(cfg, tokenizer)
        for data, source in ((dataset, cfg.prompt_data or "the bundled prompts"), (eval_dataset, "--eval-prompts")):
            if data is not None:  # ids beyond the model's rows: never fed (a pad beyond them: padding feeds eos)
                fit_to_rows(tokenizer, cfg.roles["actor"].arch.vocab_size, data.prompts, source=source)
        if cfg.load:  # metadata and file sizes only: a wrong model shape or a missing file fails here
            checkpointing.check_checkpoint(cfg, cfg.load, cfg.ckpt_step)
    except (ArgumentError, ValueError, OSError, checkpointing.CheckpointError) as e:
        # OSError: unreadable tokenizer or data files
        return _report(e) if report else e
    return cfg, args, tokenizer, dataset, eval_dataset


def _report(e: BaseException) -> int:
    from puzzle.fail_fast import USAGE_EXIT_CODE

    return _fail(str(e), USAGE_EXIT_CODE)


def _eval_dataset(cfg, tokenizer):
    """--eval-prompts, read like --prompt-data and checked against --eval-iters; None without it
    or with --eval-iters 0."""
    from puzzle.arguments import ArgumentError
    from puzzle.data.prompts import load_prompt_dataset
    from puzzle.dataflow.evaluation import eval_batches

    ev = cfg.evaluation
    if not ev.enabled:
        return None
    try:
        data = load_prompt_dataset(ev.prompts, tokenizer, cfg.prompt_key, max_prompt_len=cfg.ppo.max_prompt_length,
                                   overflow=cfg.prompt_overflow, apply_chat_template=cfg.apply_chat_template,
                                   skip_bad_records=cfg.skip_bad_records, answer_key=cfg.answer_key)
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


def _fail(message: str, code: int) -> int:
    """Rank 0's one ``error:`` line (handed to the launcher when it asked for it); returns ``code``."""
    if launcher.rank() == 0:
        launcher.report_error_line(f"error: {message}", code)
    return code


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
    weight_sources.check(cfg)
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
    weight_sources.print_sources(cfg)


CONFIG_FILE = "config.json"


def write_run_config(cfg, argv, args) -> Optional[str]:
    """``--log-dir``/config.json, written at the start of the run (a resumed run rewrites it): the
    command line, every flag's resolved value, the validated configuration (each role's layouts:
    the plan), and the versions that ran it -- as Megatron-LM records its args and verl its
    config. Returns the path (None without --log-dir)."""
    import dataclasses
    import json

    if not cfg.log_dir:
        return None
    plan = {role: {"layout": str(spec.plan), "ranks": spec.plan.ranks, "trainable": spec.trainable,
                   **({"generation_layout": str(spec.gen_plan)} if spec.gen_plan is not None else {})}
            for role, spec in cfg.roles.items()}
    doc = {"command": list(argv), "world_size": cfg.world_size, "plan": plan,
           "args": vars(args), "config": dataclasses.asdict(cfg), "versions": _versions()}
    os.makedirs(cfg.log_dir, exist_ok=True)
    path = os.path.join(cfg.log_dir, CONFIG_FILE)
    with open(path + ".tmp", "w") as f:
        json.dump(doc, f, indent=1, default=str)
        f.write("\n")
    os.replace(path + ".tmp", path)
    return path


def _versions() -> dict:
    """Python, torch, megatron-core, transformers, the CUDA device, and puzzle's git commit."""
    import importlib.metadata
    import platform
    import subprocess

    import torch

    out = {"python": platform.python_version(), "torch": torch.__version__}
    for package in ("megatron-core", "transformers", "transformer-engine"):
        try:
            out[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            pass
    if torch.cuda.is_available():
        out["cuda"] = torch.version.cuda
        out["device"] = torch.cuda.get_device_name()
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        commit = subprocess.run(["git", "-C", repo, "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10)
        dirty = subprocess.run(["git", "-C", repo, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
        if commit.returncode == 0:
            out["puzzle_commit"] = commit.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return out


def _train(cfg, tokenizer, dataset, eval_dataset=None) -> int:
    import time

    from puzzle import checkpointing, run_control, save_failures
    from puzzle.parallel.groups import DeviceSharingError, init_distributed
    from puzzle.reward_functions import BadRewardError
    from puzzle.dataflow.trainer import PPOTrainer
    from puzzle.engine.nonfinite import NonFiniteError

    start = time.time()
    try:
        init_distributed(backend=cfg.ops.distributed_backend, timeout_minutes=cfg.ops.distributed_timeout_minutes)
    except DeviceSharingError as e:
        return _fail(str(e), 2)
    progress = run_control.Progress()  # where this rank is, for the message of a timed-out collective
    trainer = None
    try:
        trainer = PPOTrainer.for_run(cfg, tokenizer, dataset, eval_dataset, progress=progress, start_time=start)
        trainer.train()
    except checkpointing.CheckpointError as e:
        return _shutdown(trainer, _fail(str(e), 2))
    except NonFiniteError as e:
        return _shutdown(trainer, _fail(str(e), 3))
    except BadRewardError as e:  # raised on every rank alike (--on-bad-reward error)
        return _shutdown(trainer, _fail(str(e), 1))
    except save_failures.SaveError as e:  # one rank's message; another rank may be inside the save
        save_failures.exit_after_failed_save(e)
    except RuntimeError as e:
        if run_control.is_timeout(e):
            run_control.abort(run_control.describe_timeout(progress, e, cfg.ops.distributed_timeout_minutes))
        raise
    return _shutdown(trainer, 0)


def _shutdown(trainer, code: int) -> int:
    """Every rank reaches here with the same outcome (errors above are collective decisions)."""
    import torch.distributed as dist

    if trainer is not None:
        trainer.close()
    dist.barrier()
    dist.destroy_process_group()
    return code
