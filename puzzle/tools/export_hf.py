"""Export a role model as an HF directory of its family (config.json + safetensors: Llama,
Mistral, Qwen2, Qwen3 — the family and its features come from the model's architecture).

The source (``--load``) is a puzzle checkpoint root (``train_ppo.py --save``; ``--role`` and
``--ckpt-step`` pick the model and the iteration) or an HF directory (a round trip through our
sharded model), loaded at the layout given by the flags and gathered to rank 0.

    torchrun --standalone --nproc-per-node 4 -m puzzle.tools.export_hf \\
        --load /ckpt/llama-hf --save /tmp/llama-out \\
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2

Plain ``python -m puzzle.tools.export_hf ...`` runs a world of one (T = P = 1).

A LoRA actor's checkpoint (``train_ppo.py --lora-dim ... --save``) exports its adapters as a PEFT
adapter directory (adapter_config.json + adapter_model.safetensors; puzzle/models/peft_export.py),
which ``peft.PeftModel.from_pretrained(base, DIR)`` puts on the HF base model; its base is rebuilt
from the source the run recorded and checked against the saved fingerprint. ``--merge-lora``
writes the merged HF model instead (W + alpha/dim B A); a LoRA critic (``--critic-lora-dim``)
exports that way only (its value head, trained whole, is not an adapter).
"""

from __future__ import annotations

from puzzle.tools.model_source import tool_parser


def _parser():
    p, g = tool_parser("python -m puzzle.tools.export_hf", __doc__, "destination", "destination HF directory")
    g.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                   help="dtype of the saved tensors (default: the model's)")
    g.add_argument("--max-shard-size-mb", type=int, default=5 * 1024)
    g.add_argument("--merge-lora", action="store_true",
                   help="a LoRA actor: write the HF model with its adapters merged into the base weights "
                        "(default: a PEFT adapter directory of the adapters alone)")
    return p


def _export(argv) -> int:
    from puzzle.tools.model_source import apply_patches, end_world, load_source

    apply_patches()
    args = _parser().parse_args(argv)
    if args.merge_lora and not _is_lora_checkpoint(args):
        from puzzle.config_flags import ArgumentError

        raise ArgumentError(f"--merge-lora: {args.load} holds no LoRA adapters of {args.role} "
                            "(a puzzle checkpoint of a --lora-dim run)")
    if not args.merge_lora and args.role != "actor" and _is_lora_checkpoint(args):
        from puzzle.config_flags import ArgumentError

        raise ArgumentError(f"--merge-lora: {args.load} holds a LoRA {args.role}, whose value head trained whole is "
                            "no adapter: it exports as its merged HF model (pass --merge-lora)")
    rank, owns_world, plan, engine = load_source(args)
    from puzzle.models.hf_checkpoint import export_hf

    if engine.lora is not None and not args.merge_lora:
        files = _export_peft(engine, args)
    else:
        if engine.lora is not None and engine.member:
            from puzzle.models.lora import merge_adapters

            merge_adapters(engine.module)
        files = export_hf(engine.module, engine.arch, args.role, args.save, dtype=args.dtype,
                          max_shard_bytes=args.max_shard_size_mb * 2 ** 20)
    if rank == 0:
        print(f"export_hf: {args.load} -> {args.save} at {plan}: {', '.join(files)}", flush=True)
    end_world(owns_world)
    return 0


def _is_lora_checkpoint(args) -> bool:
    from puzzle.models.megatron_checkpoint import find_megatron_checkpoint
    from puzzle.tools.model_source import checkpoint_role_meta, is_hf_dir

    if is_hf_dir(args.load) or find_megatron_checkpoint(args.load, args.ckpt_step) is not None:
        return False
    try:
        return "lora" in checkpoint_role_meta(args.load, args.role, args.ckpt_step)
    except (OSError, ValueError, KeyError):
        return False  # load_source names what is wrong with the source


def _export_peft(engine, args):
    """Rank 0 writes the PEFT adapter directory of ``engine``'s adapters (collective gather)."""
    import torch

    from puzzle.models.lora import gather_adapters
    from puzzle.models.peft_export import write_peft_adapter
    from puzzle.tools.model_source import checkpoint_role_meta

    whole = gather_adapters(engine.module, engine.adapter_specs)
    if whole is None:
        return None
    base = checkpoint_role_meta(args.load, args.role, args.ckpt_step)["base"]["source"].get("hf_path")
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(args.dtype)
    return write_peft_adapter(engine.arch, engine.lora, whole, args.save, base_model=base, dtype=dtype)


def main(argv=None) -> int:
    """Bad input: one ``error:`` line from rank 0 and exit status 2 (as train_ppo.py)."""
    from puzzle.fail_fast import run_failing_fast

    return run_failing_fast(_export, argv)


if __name__ == "__main__":
    from puzzle.parallel import launcher

    launcher.exit_process(main())
