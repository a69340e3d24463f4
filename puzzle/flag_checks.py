"""Value checks of single flags, run by ``validate_args`` before any process group or model exists.

``check_values`` needs nothing but the parsed flags; ``check_environment`` looks at this machine
(writable output directories, a GPU for --fp16, the optional logging packages). Every error is an
ArgumentError whose message starts with the flag's name.
"""

from __future__ import annotations

import os
import uuid


def _fail(flag: str, message: str):
    from puzzle.arguments import ArgumentError

    raise ArgumentError(f"{flag}: {message}")


def _at_least(args, flag: str, low, *, strict: bool = False, optional: bool = False):
    value = getattr(args, flag.lstrip("-").replace("-", "_"))
    if value is None and optional:
        return
    if value < low or (strict and value == low):
        _fail(flag, f"must be {'>' if strict else '>='} {low} (got {value})")


def _in_unit_interval(args, flag: str):
    value = getattr(args, flag.lstrip("-").replace("-", "_"))
    if not 0.0 <= value < 1.0:
        _fail(flag, f"must lie in [0, 1) (got {value})")


def check_values(args) -> None:
    """Ranges and combinations of the flags (pure: no files, no devices)."""
    for flag in ("--lr", "--min-lr", "--weight-decay", "--clip-grad", "--lr-warmup-iters",
                 "--init-method-std", "--skip-nonfinite-iterations"):
        _at_least(args, flag, 0)
    _at_least(args, "--critic-lr", 0, optional=True)
    for flag in ("--adam-beta1", "--adam-beta2", "--attention-dropout", "--hidden-dropout"):
        _in_unit_interval(args, flag)
    for flag in ("--adam-eps", "--norm-epsilon", "--clip-eps", "--value-clip-eps",
                 "--distributed-timeout-minutes"):
        _at_least(args, flag, 0, strict=True)
    for flag in ("--reward-clip", "--exit-duration-in-mins"):
        _at_least(args, flag, 0, strict=True, optional=True)
    for flag in ("--kl-horizon", "--make-vocab-size-divisible-by", "--seq-length", "--rotary-base"):
        _at_least(args, flag, 1)
    for flag in ("--global-batch-size", "--ppo-mini-batch-size", "--max-prompt-length",
                 "--exit-interval", "--keep-last-checkpoints", "--max-position-embeddings"):
        _at_least(args, flag, 1, optional=True)
    for flag, lr in (("--lr", args.lr), ("--critic-lr", args.critic_lr)):
        if lr is not None and args.min_lr > lr:
            _fail("--min-lr", f"{args.min_lr} exceeds {flag} {lr}")
    if args.max_position_embeddings is not None and args.seq_length > args.max_position_embeddings:
        _fail("--seq-length", f"{args.seq_length} exceeds --max-position-embeddings "
                              f"{args.max_position_embeddings}")
    if args.keep_last_checkpoints is not None and not args.save:
        _fail("--keep-last-checkpoints", "needs --save DIR")
    for flag in ("wandb_exp_name", "wandb_save_dir"):
        if getattr(args, flag) and not args.wandb_project:
            _fail("--" + flag.replace("_", "-"), "needs --wandb-project")


def _check_writable(flag: str, path: str) -> None:
    """Create ``path`` (as the run would) and a file in it; the message says why not."""
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".write-test-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as e:
        _fail(flag, f"{path!r} is not a writable directory ({e.strerror or e})")


def check_environment(args) -> None:
    """What the run needs from this machine, checked before it starts."""
    for flag in ("save", "log_dir", "tensorboard_dir", "wandb_save_dir"):
        path = getattr(args, flag)
        if path:
            _check_writable("--" + flag.replace("_", "-"), path)
    if args.fp16:
        import torch

        if not torch.cuda.is_available():
            _fail("--fp16", "fp16 training needs a GPU (its loss scaling and kernels are CUDA-only); "
                            "on CPU train in fp32 (the default) or --bf16")
    if args.tensorboard_dir:
        try:
            from torch.utils.tensorboard import SummaryWriter  # noqa: F401
        except ImportError:
            _fail("--tensorboard-dir", "the tensorboard package is not installed "
                                       "(pip install -e '.[tb]')")
    if args.wandb_project:
        try:
            import wandb  # noqa: F401
        except ImportError:
            _fail("--wandb-project", "the wandb package is not installed (pip install -e '.[wandb]')")
