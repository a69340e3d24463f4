"""Export a role model as an HF LLaMA directory (config.json + safetensors).

For now the source is an HF directory (``--load``), imported at the layout given by the flags and
exported again — a round trip through our sharded model that exercises import, the layout
(P, D, T) and the gather-to-rank-0 export. Wiring ``--load`` to puzzle's dist-checkpoints is the
next step (the export half, puzzle.models.hf_llama.export_hf, already takes any built model).

    torchrun --standalone --nproc-per-node 4 -m puzzle.tools.export_hf \\
        --load /ckpt/llama-hf --save /tmp/llama-out \\
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2

Plain ``python -m puzzle.tools.export_hf ...`` runs a world of one (T = P = 1).
"""

from __future__ import annotations

import argparse
import sys


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m puzzle.tools.export_hf", description=__doc__.split("\n\n")[0])
    g = p.add_argument_group("checkpoint")
    g.add_argument("--load", required=True, help="source: an HF LLaMA directory (config.json + safetensors)")
    g.add_argument("--save", required=True, help="destination HF directory")
    g.add_argument("--role", default="actor", choices=("actor", "ref", "critic", "reward"))
    g.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                   help="dtype of the saved tensors (default: the model's)")
    g.add_argument("--max-shard-size-mb", type=int, default=5 * 1024)
    g = p.add_argument_group("layout")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    import megatron_patches

    megatron_patches.apply()
    import torch.distributed as dist

    from puzzle.models.builders import build_role_model
    from puzzle.models.hf_llama import arch_from_hf_dir, export_hf, load_hf_into_model
    from puzzle.parallel.groups import init_distributed, layout_for
    from puzzle.parallel.plan import ParallelPlan

    rank, world = init_distributed()
    T, P = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if world % (T * P):
        raise SystemExit(f"world size {world} is not divisible by T*P = {T * P}")
    plan = ParallelPlan(P, world // (T * P), T)
    arch = arch_from_hf_dir(args.load, make_vocab_size_divisible_by=args.make_vocab_size_divisible_by)
    module = build_role_model(args.role, arch, layout_for(plan), layout_independent_init=False)
    stats = load_hf_into_model(module, arch, args.role, args.load)
    files = export_hf(module, arch, args.role, args.save, dtype=args.dtype,
                      max_shard_bytes=args.max_shard_size_mb * 2 ** 20)
    if rank == 0:
        print(f"export_hf: {args.load} -> {args.save} at {plan} ({stats['bytes_read']} bytes read on "
              f"rank 0): {', '.join(files)}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
