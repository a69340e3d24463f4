"""4-rank world: packed scoring and training (--use-remove-padding) against the padded path, in
process, on one generated batch per configuration: PPO (actor, critic, reference, reward model)
and GRPO (actor, reference, KL loss) at (1,4,1) (each rank runs the whole model on its rows, as at
(1,1,1); a trainable model on one rank of four waits in megatron's optimizer construction, which
gathers over the whole world), (2,1,2) time-shared with the actor generating at
(1,2,2) through the switch, and (1,2,2). Every rank reports the largest per-token difference of
each scored field, of the advantages and returns, and of the gradients of one training
mini-batch, with the scale of each quantity; and for PPO the same with the rows made all equally
long (packed micro-batches of equal sequences run as dense [k, n] batches: the padded path's numbers).
"""

from dataclasses import replace

import torch

from puzzle.arguments import parse_args, validate_args
from puzzle.data.prompts import bundled_prompts_path, load_prompt_dataset
from puzzle.data.tokenizers import build_tokenizer
from puzzle.pipeline.stage import run_stage
from puzzle.dataflow.trainer import PPOTrainer
from puzzle.dataflow import steps
from puzzle.dataflow.batch import ROW_FIELDS, RolloutBatch
from tests.harness import world_main

MODEL = ["--num-layers", "2", "--hidden-size", "32", "--ffn-hidden-size", "64", "--num-attention-heads", "4",
         "--group-query-attention", "--num-query-groups", "2", "--seq-length", "48",
         "--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope",
         "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--max-new-tokens", "12",
         "--micro-batch-size", "2", "--train-iters", "1", "--temperature", "1.0", "--lr", "1e-3"]
LAYOUTS = {
    "141": [],
    "212_ts_switch": ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                      "--actor-gen-tensor-model-parallel-size", "2", "--actor-gen-pipeline-model-parallel-size", "1",
                      "--score-placement", "time-sharing", "--train-placement", "time-sharing"],
    "122": ["--tensor-model-parallel-size", "2"],
}
CONFIGS = {
    "ppo": ["--rollout-batch-size", "8", "--global-batch-size", "8", "--reward-model", "random",
            "--kl-coef", "0.05"],
    "grpo": ["--advantage-estimator", "grpo", "--n-samples-per-prompt", "2", "--rollout-batch-size", "4",
             "--global-batch-size", "8", "--kl-coef", "0", "--use-kl-loss", "--kl-loss-coef", "0.1",
             "--reward-fn", "puzzle.reward_functions.builtin:lowercase_fraction"],
}
SCORED = ("old_logprobs", "entropy", "ref_logprobs", "values", "scores")


def _largest(a: torch.Tensor, b: torch.Tensor, mask=None) -> dict:
    d = (a.double() - b.double()).abs()
    scale = torch.maximum(a.double().abs(), b.double().abs())
    if mask is not None:
        d, scale = d[mask], scale[mask]
    return {"diff": float(d.max()) if d.numel() else 0.0, "scale": float(scale.max()) if scale.numel() else 0.0}


def _score(trainer, batch, packed: bool) -> dict:
    trainer.remove_padding = packed
    batch, _ = trainer.score(batch)
    return {k: batch.fields[k].clone() for k in SCORED if k in batch.fields}


def _advantages(trainer, batch, scored: dict) -> tuple:
    """(advantages and returns, the batch with them, the logged ``kl``)."""
    batch = replace(batch, **{k: v.clone() for k, v in scored.items()})
    batch, stats = trainer.compute_advantages(batch)
    return {k: batch.fields[k].clone() for k in ("advantages", "returns")}, batch, stats["kl"]


def _kl_with_reference_nudged(trainer, batch) -> float:
    """The packed run's logged ``kl`` with every weight of the reference's first linear moved by
    one ulp (the planted control of the exact 0 at iteration 1), the weights restored after."""
    ref = trainer.engines["ref"]
    weights = [p for name, p in ref.module.named_parameters() if "layers.0.self_attention.linear_qkv" in name] \
        if ref.member else []
    saved = [w.detach().clone() for w in weights]
    with torch.no_grad():
        for w in weights:
            w.copy_(torch.nextafter(w, torch.full_like(w, float("inf"))))
    try:
        return _advantages(trainer, batch, _score(trainer, batch, True))[2]
    finally:
        with torch.no_grad():
            for w, s in zip(weights, saved):
                w.copy_(s)


def _gradients(trainer, mini, packed: bool) -> dict:
    """Each trained model's gradient buffers after one training mini-batch (no optimizer step)."""
    ppo, R = trainer.cfg.ppo, mini.max_new_tokens
    jobs = [("actor", steps.actor_train_step(trainer.vocab, ppo.temperature, R, ppo.clip_eps, ppo.entropy_coef,
                                             loss_agg=ppo.loss_agg_mode, kl_loss_coef=ppo.kl_loss_coef,
                                             use_kl_loss=ppo.use_kl_loss))]
    if "critic" in trainer.engines:
        jobs.append(("critic", steps.critic_train_step(R, ppo.value_clip_eps)))
    trainer.remove_padding = packed
    for role, _ in jobs:
        if trainer.engines[role].member:
            trainer.engines[role].zero_grad()
    run_stage(trainer._contexts(mini, jobs), forward_only=False, placement=trainer.cfg.train_placement)
    grads = {}
    for role, _ in jobs:
        eng = trainer.engines[role]
        if eng.member:
            grads[role] = torch.cat([b.grad_data.float().flatten() for b in eng.model.buffers]).clone()
            eng.zero_grad()
    return grads


def _compare(name: str, layout: str) -> dict:
    tok = build_tokenizer("ByteLevelTokenizer", None)
    cfg = validate_args(parse_args(MODEL + CONFIGS[name] + LAYOUTS[layout]), torch.distributed.get_world_size(),
                        tok.vocab_size)
    ds = load_prompt_dataset(bundled_prompts_path(), tok, max_prompt_len=cfg.ppo.max_prompt_length)
    trainer = PPOTrainer(cfg, tok, ds)
    try:
        prompts = ds.prompts[:cfg.ppo.rollout_batch_size]
        batch, _ = trainer.generate(prompts)
        mask = batch.response_mask.bool()
        padded, packed = _score(trainer, batch, False), _score(trainer, batch, True)
        out = {"roles": sorted(trainer.engines), "switch": trainer.switch is not None,
               "padded_tokens": batch.tokens.numel(),
               "packed_tokens": int((batch.prompt_lengths + batch.response_lengths).sum())}
        for k in padded:
            out[k] = _largest(padded[k], packed[k], None if k == "scores" else mask)
        adv_padded, _, kl_padded = _advantages(trainer, batch, padded)
        adv_packed, trained, kl_packed = _advantages(trainer, batch, packed)
        # iteration 1: the reference holds the actor's weights at the actor's layout
        out["kl_at_iteration_1"] = {"padded": kl_padded, "packed": kl_packed,
                                    "old_minus_ref_packed": float((packed["old_logprobs"] - packed["ref_logprobs"])
                                                                  .abs().max())}
        if (name, layout) == ("ppo", "122"):
            out["kl_at_iteration_1"]["packed_ref_nudged"] = _kl_with_reference_nudged(trainer, batch)
        for k in adv_padded:
            out[k] = _largest(adv_padded[k], adv_packed[k], mask)
        mini = trained.rows(torch.arange(cfg.ppo.mini_batch_size))
        g_padded, g_packed = _gradients(trainer, mini, False), _gradients(trainer, mini, True)
        for role in g_padded:
            out[f"{role}_grad"] = _largest(g_padded[role], g_packed[role])
        if name == "ppo":  # every role's head (log-probs, values, scores); GRPO's actor is the same path
            out.update(_compare_equal_lengths(trainer, batch, cfg.ppo.mini_batch_size))
        return out
    finally:
        trainer.close()


def _compare_equal_lengths(trainer, batch, mini_batch_size: int) -> dict:
    """The same rows with every sequence as long as the padded width (nothing to remove: packed
    micro-batches run as [k, n] batches, scoring_stage.schedule_shape): ``equal_``-prefixed
    differences of the scored fields and of one mini-batch's gradients."""
    B, S = batch.tokens.shape
    R = int(batch.response_lengths.max())
    eq = RolloutBatch(batch.tokens.clone(), torch.full((B,), S - R, dtype=torch.long),
                      torch.full((B,), R, dtype=torch.long), batch.max_new_tokens,
                      **{k: v.clone() for k, v in batch.fields.items() if ROW_FIELDS[k] in ("generation", "reward")})
    padded, packed = _score(trainer, eq, False), _score(trainer, eq, True)
    out = {f"equal_{k}": _largest(padded[k], packed[k]) for k in padded}
    _, eq, _ = _advantages(trainer, eq, padded)
    mini = eq.rows(torch.arange(mini_batch_size))
    g_padded, g_packed = _gradients(trainer, mini, False), _gradients(trainer, mini, True)
    out.update({f"equal_{role}_grad": _largest(g_padded[role], g_packed[role]) for role in g_padded})
    return out


def check_packed_equals_padded():
    return {f"{name}/{layout}": _compare(name, layout) for name in CONFIGS for layout in LAYOUTS}


if __name__ == "__main__":
    world_main([("packed_equals_padded", check_packed_equals_padded)])
