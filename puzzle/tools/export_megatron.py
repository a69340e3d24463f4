"""Export a role model as a Megatron-LM checkpoint (megatron-core torch_dist) that Megatron-LM's
``pretrain_gpt.py --load DIR`` reads for evaluation or further SFT.

The source (``--load``) is a puzzle checkpoint root (``train_ppo.py --save``; ``--role`` and
``--ckpt-step`` pick the model and the iteration), an HF directory or a Megatron-LM checkpoint,
loaded at the layout given by the flags. The destination is a ``release`` checkpoint
(``latest_checkpointed_iteration.txt`` says ``release``): Megatron-LM loads it at any (P, D, T)
as it loads a model for ``--finetune`` (iteration 0, no optimizer or RNG state), and its common
state holds the model's args (puzzle/models/megatron_checkpoint.py). Give Megatron-LM the same
model flags; its vocabulary padding (the tokenizer's ids rounded up to
--make-vocab-size-divisible-by x T) must give the exported rows (the line printed at the end).

    torchrun --standalone --nproc-per-node 4 -m puzzle.tools.export_megatron \\
        --load /ckpt/ppo-7b --save /ckpt/ppo-7b-megatron \\
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2

Plain ``python -m puzzle.tools.export_megatron ...`` runs a world of one (T = P = 1).
"""

from __future__ import annotations

from puzzle.tools.model_source import tool_parser


def _parser():
    p, g = tool_parser("python -m puzzle.tools.export_megatron", __doc__, "destination",
                       "destination Megatron-LM checkpoint root")
    g.add_argument("--bf16", action="store_true", help="save bf16 tensors (default: fp32)")
    return p


def _export(argv) -> int:
    from puzzle.tools.model_source import apply_patches, end_world, load_source

    apply_patches()
    args = _parser().parse_args(argv)
    rank, owns_world, plan, engine = load_source(args, bf16=args.bf16)
    from puzzle.models.megatron_checkpoint import save_megatron_checkpoint

    arch = engine.arch
    d = save_megatron_checkpoint(engine.module, arch, args.save, bf16=args.bf16, fp16=False)
    if rank == 0:
        print(f"export_megatron: {args.load} -> {d} at {plan}: {arch.padded_vocab_size} vocabulary rows "
              f"(Megatron-LM: --load {args.save} with the model's flags)", flush=True)
    end_world(owns_world)
    return 0


def main(argv=None) -> int:
    """Bad input: one ``error:`` line from rank 0 and exit status 2 (as train_ppo.py)."""
    from puzzle.fail_fast import run_failing_fast

    return run_failing_fast(_export, argv)


if __name__ == "__main__":
    from puzzle.parallel import launcher

    launcher.exit_process(main())
