"""4-rank world: token-budget micro-batches (--use-dynamic-bsz) against fixed-count ones, in process,
on one generated batch per layout: PPO (actor, critic, reference, reward model) at (1,4,1) (four
DP ranks, balanced by tokens, holding different numbers of micro-batches), (2,1,2) time-shared with
the actor generating at (1,2,2) through the switch (pipeline stages exchange the shapes), and GRPO
at (1,2,2). Every rank reports the largest difference of each scored field and of the gradients of
one training mini-batch under every --loss-agg-mode, with the scale of each quantity, and how many
micro-batches each path ran.
"""

from dataclasses import replace

import torch

from puzzle.algorithms.losses import LOSS_AGG_MODES
from puzzle.arguments import parse_args, validate_args
from puzzle.data.prompts import bundled_prompts_path, load_prompt_dataset
from puzzle.data.tokenizers import build_tokenizer
from puzzle.pipeline.stage import run_stage
from puzzle.dataflow.trainer import PPOTrainer
from puzzle.dataflow import steps
from puzzle.dataflow.micro_batching import micro_batch_rows, share_rows
from tests.distributed.worlds.packing import CONFIGS, LAYOUTS, MODEL, SCORED, _largest
from tests.harness import world_main

BUDGET = ["--use-dynamic-bsz", "--ppo-max-token-len-per-gpu", "80", "--log-prob-max-token-len-per-gpu", "90"]
#: case -> (algorithm, layout, the --loss-agg-modes whose gradients it compares): every mode where DP
#: ranks run different numbers of micro-batches, the default mode at the other layouts
CASES = {"ppo/141": ("ppo", "141", LOSS_AGG_MODES), "ppo/212_ts_switch": ("ppo", "212_ts_switch", LOSS_AGG_MODES[:1]),
         "grpo/122": ("grpo", "122", LOSS_AGG_MODES[:1])}


def _fixed(cfg):
    return replace(cfg, ppo=replace(cfg.ppo, use_dynamic_bsz=False))


def _score(trainer, batch, cfg) -> dict:
    trainer.micro.dynamic_bsz = cfg.ppo.use_dynamic_bsz
    batch, _ = trainer.score(batch)
    return {k: batch.fields[k].clone() for k in SCORED if k in batch.fields}, batch


def _gradients(trainer, mini, loss_agg: str, budget) -> tuple:
    """Each trained model's gradient buffers after one training mini-batch; micro-batches run."""
    ppo, R = trainer.cfg.ppo, mini.max_new_tokens
    jobs = [("actor", steps.actor_train_step(trainer.vocab, ppo.temperature, R, ppo.clip_eps, ppo.entropy_coef,
                                             loss_agg=loss_agg, kl_loss_coef=ppo.kl_loss_coef,
                                             use_kl_loss=ppo.use_kl_loss))]
    if "critic" in trainer.engines and loss_agg == LOSS_AGG_MODES[0]:  # the critic's loss has no mode
        jobs.append(("critic", steps.critic_train_step(R, ppo.value_clip_eps)))
    for role, _ in jobs:
        if trainer.engines[role].member:
            trainer.engines[role].zero_grad()
    contexts = trainer._contexts(mini, jobs, budget)
    run_stage(contexts, forward_only=False, placement=trainer.cfg.train_placement)
    grads = {}
    for role, _ in jobs:
        eng = trainer.engines[role]
        if eng.member:
            grads[role] = torch.cat([b.grad_data.float().flatten() for b in eng.model.buffers]).clone()
            eng.zero_grad()
    return grads, contexts[0].num_microbatches


def _compare(name: str, layout: str, modes) -> dict:
    tok = build_tokenizer("ByteLevelTokenizer", None)
    cfg = validate_args(parse_args(MODEL + CONFIGS[name] + LAYOUTS[layout] + BUDGET),
                        torch.distributed.get_world_size(), tok.vocab_size)
    ds = load_prompt_dataset(bundled_prompts_path(), tok, max_prompt_len=cfg.ppo.max_prompt_length)
    trainer = PPOTrainer(cfg, tok, ds)
    try:
        batch, _ = trainer.generate(ds.prompts[:cfg.ppo.rollout_batch_size])
        mask = batch.response_mask.bool()
        (fixed, _), (budget, scored) = _score(trainer, batch, _fixed(cfg)), _score(trainer, batch, cfg)
        out = {"roles": sorted(trainer.engines), "lengths": batch.sequence_lengths}
        for k in fixed:
            out[k] = _largest(fixed[k], budget[k], None if k == "scores" else mask)
        batch, _ = trainer.compute_advantages(scored)
        mini = batch.rows(torch.arange(cfg.ppo.mini_batch_size))
        share = mini.rows(share_rows(mini, trainer.engines["actor"].layout, balance=True))
        out["rows_per_budget_micro_batch"] = [len(g) for g in micro_batch_rows(
            share, 1, cfg.ppo.ppo_max_token_len_per_gpu)]
        for mode in modes:
            g_fixed, n_fixed = _gradients(trainer, mini, mode, None)
            g_budget, n_budget = _gradients(trainer, mini, mode, cfg.ppo.ppo_max_token_len_per_gpu)
            out[f"micro_batches/{mode}"] = [n_fixed, n_budget]
            for role in g_fixed:
                out[f"{role}_grad/{mode}"] = _largest(g_fixed[role], g_budget[role])
        return out
    finally:
        trainer.close()


def check_budget_equals_fixed():
    return {case: _compare(*spec) for case, spec in CASES.items()}


if __name__ == "__main__":
    world_main([("budget_equals_fixed", check_budget_equals_fixed)])
