"""Command-line driver behind train_ppo.py (kept out of the entry script so it can be tested)."""

from __future__ import annotations

import sys


def run(argv) -> int:
    from puzzle.arguments import ArgumentError, parse_args, validate_args
    from puzzle.data.prompts import bundled_prompts_path, load_prompt_dataset
    from puzzle.data.tokenizers import build_tokenizer

    import os

    args = parse_args(argv)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    try:  # everything is checked before torch.distributed starts and before any allocation
        tokenizer = build_tokenizer(args.tokenizer_type, args.tokenizer_model)
        cfg = validate_args(args, world_size, tokenizer.vocab_size)
        if cfg.reward_fn:
            from puzzle.rewards import load_reward_fn

            load_reward_fn(cfg.reward_fn)
        dataset = load_prompt_dataset(cfg.prompt_data or bundled_prompts_path(), tokenizer,
                                      cfg.prompt_key, max_prompt_len=cfg.ppo.max_prompt_length)
    except (ArgumentError, ValueError, FileNotFoundError) as e:
        if rank == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    if rank == 0:
        _print_plan(cfg)
    return _train(cfg, tokenizer, dataset)


def _print_plan(cfg) -> None:
    print(f"puzzle PPO: world size {cfg.world_size}", flush=True)
    for role, spec in cfg.roles.items():
        gen = f", generation {spec.gen_plan}" if spec.gen_plan is not None and spec.gen_plan != spec.plan else ""
        a = spec.arch
        print(f"  {role:7s} layers={a.num_layers} hidden={a.hidden_size} heads={a.num_attention_heads}"
              f"/{a.num_query_groups} layout {spec.plan}{gen} {'trainable' if spec.trainable else 'frozen'}",
              flush=True)


def _train(cfg, tokenizer, dataset) -> int:
    import torch.distributed as dist

    from puzzle.data.prompts import PromptLoader
    from puzzle.parallel.groups import init_distributed
    from puzzle.trainer import PPOTrainer

    init_distributed()
    loader = PromptLoader(dataset.prompts, cfg.ppo.rollout_batch_size, dp_rank=0, dp_size=1,
                          seed=cfg.seed)
    trainer = PPOTrainer(cfg, tokenizer, dataset)
    try:
        for _ in range(cfg.train_iters):
            trainer.step(next(loader).prompts)
    finally:
        trainer.close()
    dist.barrier()
    dist.destroy_process_group()
    return 0
