"""Make a critic or reward model from an LM checkpoint: its trunk with a scalar head in place of
the vocabulary projection, zero- or normal-initialised.

The source (``--load``) is an HF directory or a Megatron-LM checkpoint of a language model. The result has the source's format
(``--save-format`` to choose): an HF ``*ForSequenceClassification`` directory (``score.weight``,
num_labels=1), which ``--hf-critic-path`` / ``--hf-reward-path`` read, or a Megatron-LM
checkpoint whose ``output_layer.weight`` is the [1, hidden] head, which
``--critic-pretrained-checkpoint`` / ``--reward-pretrained-checkpoint`` read. The head:

    zero     every value 0 at the start (the critic learns its scale from the returns)
    normal   N(0, std), std 1 / (hidden + 1) unless --head-init-std (OpenRLHF's value head;
             TRL's "normal" strategy uses 0.2); the same seed gives the same head at any layout

A reward model made this way still needs training on preference data before its scores mean
anything; a critic can start from it directly (or from the LM: train_ppo.py gives a critic from
an LM checkpoint a fresh head by itself).

    python -m puzzle.tools.make_value_model --load /ckpt/sft-hf --save /ckpt/critic-hf --head-init normal
    torchrun --standalone --nproc-per-node 2 -m puzzle.tools.make_value_model \\
        --load /ckpt/sft-megatron --save /ckpt/critic-megatron --tensor-model-parallel-size 2
"""

from __future__ import annotations

from puzzle.tools.model_source import tool_parser


def _parser():
    p, g = tool_parser("python -m puzzle.tools.make_value_model", __doc__, "value model", "destination directory")
    p.set_defaults(role="critic")  # --role: the model made (critic or reward)
    g.add_argument("--save-format", choices=("hf", "megatron"), default=None,
                   help="default: the source's")
    g.add_argument("--head-init", choices=("zero", "normal"), default="zero")
    g.add_argument("--head-init-std", type=float, default=None, help="normal: the std (default 1 / (hidden + 1))")
    g.add_argument("--seed", type=int, default=1234, help="normal: the head's seed")
    g.add_argument("--bf16", action="store_true", help="save bf16 tensors (default: fp32)")
    return p


def init_scalar_head(module, hidden_size: int, how: str, std, seed: int) -> None:
    """The scalar head of ``module`` (None: a rank outside the model), set the same on every rank."""
    import torch

    from puzzle.models.param_names import HEAD_LOCAL_NAME

    if module is None:
        return
    params = dict(module.named_parameters())
    if HEAD_LOCAL_NAME not in params:
        return  # not the last pipeline stage
    head = params[HEAD_LOCAL_NAME]
    with torch.no_grad():
        if how == "zero":
            head.zero_()
        else:
            gen = torch.Generator().manual_seed(seed)
            head.copy_(torch.randn(head.shape, generator=gen) * (std if std is not None else 1.0 / (hidden_size + 1)))


def _make(argv) -> int:
    from puzzle.tools.model_source import (apply_patches, end_world, is_hf_dir, load_engine, plan_from_flags,
                                           source_arch, start_world)

    apply_patches()
    args = _parser().parse_args(argv)
    if args.role not in ("critic", "reward"):
        raise ValueError(f"--role: critic or reward (the model made), not {args.role}")
    if args.head_init_std is not None and (args.head_init != "normal" or args.head_init_std <= 0):
        raise ValueError(f"--head-init-std: a std > 0 for --head-init normal (got {args.head_init_std} with "
                         f"--head-init {args.head_init})")
    from puzzle.models.megatron_checkpoint import find_megatron_checkpoint

    if not is_hf_dir(args.load) and find_megatron_checkpoint(args.load, args.ckpt_step) is None:
        raise ValueError(f"--load: {args.load!r} is neither an HF directory (config.json) nor a Megatron-LM checkpoint "
                         f"(a puzzle run's actor: export it first with puzzle.tools.export_megatron)")
    plan = plan_from_flags(args)
    # the LM's architecture: an HF LM or a Megatron-LM checkpoint has one model; a puzzle checkpoint's actor
    arch = source_arch(args.load, "actor", plan, step=args.ckpt_step,
                       make_vocab_size_divisible_by=args.make_vocab_size_divisible_by)
    fmt = args.save_format or ("hf" if is_hf_dir(args.load) else "megatron")
    rank, owns_world = start_world(args.distributed_backend)
    engine = load_engine(args.load, args.role, plan, arch, step=args.ckpt_step, bf16=args.bf16,
                         transformer_impl=args.transformer_impl, allow_missing_head=True)
    init_scalar_head(engine.module, arch.hidden_size, args.head_init, args.head_init_std, args.seed)
    if fmt == "hf":
        from puzzle.models.hf_checkpoint import export_hf

        export_hf(engine.module, arch, args.role, args.save)
    else:
        from puzzle.models.megatron_checkpoint import save_megatron_checkpoint

        save_megatron_checkpoint(engine.module, arch, args.save, bf16=args.bf16, fp16=False)
    if rank == 0:
        print(f"make_value_model: {args.load} -> {args.save} ({fmt}, {args.role}, head {args.head_init})", flush=True)
    end_world(owns_world)
    return 0


def main(argv=None) -> int:
    """Bad input: one ``error:`` line from rank 0 and exit status 2 (as train_ppo.py)."""
    from puzzle.fail_fast import run_failing_fast

    return run_failing_fast(_make, argv)


if __name__ == "__main__":
    from puzzle.parallel import launcher

    launcher.exit_process(main())
