"""Command-line driver behind train_ppo.py (kept out of the entry script so it can be tested)."""

from __future__ import annotations


def run(argv) -> int:
    import torch.distributed as dist

    from puzzle.config import ROLES, ModelArch
    from puzzle.parallel.groups import init_distributed, layout_for
    from puzzle.parallel.plan import ParallelPlan
    from puzzle.training.engine import ModelEngine

    rank, world = init_distributed()
    arch = ModelArch(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=256)
    plan = ParallelPlan(1, world, 1)
    for role in ROLES:
        eng = ModelEngine(role, arch, layout_for(plan), trainable=role in ("actor", "critic"))
        n = sum(p.numel() for p in eng.module.parameters())
        if rank == 0:
            print(f"built {role}: {n} parameters on rank 0 at {plan}", flush=True)
    dist.destroy_process_group()
    return 0
