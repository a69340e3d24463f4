"""4-rank world: packed scoring and training (--use-remove-padding) against the padded path, in
process, on one generated batch per configuration: PPO (actor, critic, reference, reward model)
and GRPO (actor, reference, KL loss) at (1,4,1) (each rank runs the whole model on its rows, as at
(1,1,1); a trainable model on one rank of four waits in megatron's optimizer construction, which
gathers over the whole world), (2,1,2) time-shared with the actor generating at
(1,2,2) through the switch, and (1,2,2). Every rank reports the largest per-token difference of
each scored field, of the advantages and returns, and of the gradients of one training
mini-batch, with the scale of each quantity; and for PPO the same with the rows made all equally
long (packed micro-batches of equal sequences run as dense [k, n] batches: the padded path's numbers).

Also the batch's assembly (puzzle/dataflow/batch.py ``world_rows``): for PPO at each layout, the
generated batch and the packed scored fields assembled as before (float64 zero buffers summed by
world all-reduces, ``_LEGACY_ASSEMBLY``) against the gathers, bit for bit; and, without a model,
the generation output and scored fields (contiguous shares and token-budget rows) at plans that
gather, broadcast, leave ranks out or generate per expert group, with the bytes by dtype the
collectives delivered (no float64 in the gathers).
"""

from dataclasses import replace

import torch

from puzzle.arguments import parse_args, validate_args
from puzzle.data.prompts import bundled_prompts_path, load_prompt_dataset
from puzzle.data.tokenizers import build_tokenizer
from puzzle.pipeline.stage import run_stage
from puzzle.dataflow.trainer import PPOTrainer
from puzzle.dataflow import steps
from puzzle.dataflow import batch as batch_module
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
            # a list (not a dict: the dicts of ``out`` are differences)
            out["legacy_assembly_same_bits"] = sorted(_legacy_assembly_same_bits(trainer, prompts, batch, packed).items())
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


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bits (float32 compared as int32: -0.0 is not 0.0)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype == torch.float32:
        a, b = a.view(torch.int32), b.view(torch.int32)
    return torch.equal(a, b)


def _legacy_assembly_same_bits(trainer, prompts, batch, scored: dict) -> dict:
    """Generation and packed scoring again with the assembly as before (``_LEGACY_ASSEMBLY``):
    whether each batch field and scored field has the same bits as the gathers gave."""
    batch_module._LEGACY_ASSEMBLY = True
    try:
        old_batch, _ = trainer.generate(prompts)
        old_scored = _score(trainer, batch, True)
    finally:
        batch_module._LEGACY_ASSEMBLY = False
    out = {k: _same_bits(getattr(old_batch, k), getattr(batch, k))
           for k in ("tokens", "prompt_lengths", "response_lengths", "gen_logprobs")}
    out.update({k: _same_bits(old_scored[k], scored[k]) for k in scored})
    return out


#: plans of the model-free assembly check: every rank owns a part (one all-gather), owners on
#: some ranks (broadcasts), ranks off the plan, and generation per expert-parallel group
ASSEMBLY_PLANS = {"141": dict(P=1, D=4, T=1), "212": dict(P=2, D=1, T=2), "221": dict(P=2, D=2, T=1),
                  "121_two_ranks": dict(P=1, D=2, T=1), "141_E2": dict(P=1, D=4, T=1, E=2)}


def check_assembly_gathers():
    """For each plan: whether the gathers give the old assembly's bits (generation output,
    scored fields, token-budget rows), and the bytes by dtype each way delivered to this rank."""
    from types import SimpleNamespace

    from puzzle.bench.dataflow import SCORED, assemble, collective_bytes, synthetic_rollout
    from puzzle.dataflow.micro_batching import gather_outputs
    from puzzle.parallel.groups import layout_for
    from puzzle.parallel.plan import ParallelPlan

    prompts, tokens, lengths, logprobs = synthetic_rollout(8, 6, seed=3)
    g = torch.Generator().manual_seed(4)
    scored = {k: -torch.rand(8, 6, generator=g) for k in SCORED}
    results = {}
    for name, dims in ASSEMBLY_PLANS.items():
        layout = layout_for(ParallelPlan(**dims))
        engine = SimpleNamespace(layout=layout, member=layout.member)
        n = 8 // layout.plan.D
        d = max(layout.d, 0)
        mine = torch.arange(d * n, (d + 1) * n).flip(0)  # token-budget outputs: the share's rows, reordered
        runs = {}
        for mode in ("old", "new"):
            batch_module._LEGACY_ASSEMBLY = mode == "old"
            counts = {}
            try:
                with collective_bytes(counts):
                    batch, fields = assemble(layout, prompts, tokens, lengths, logprobs, scored, torch.device("cpu"))
                    fields["rows"] = gather_outputs([{"values": scored["values"][mine]}], "values", engine, batch,
                                                    rows=mine)
            finally:
                batch_module._LEGACY_ASSEMBLY = False
            runs[mode] = (batch, fields, counts)
        (old_batch, old_fields, old_counts), (new_batch, new_fields, new_counts) = runs["old"], runs["new"]
        same = {k: _same_bits(getattr(old_batch, k), getattr(new_batch, k))
                for k in ("tokens", "prompt_lengths", "response_lengths", "gen_logprobs")}
        same.update({k: _same_bits(old_fields[k], new_fields[k]) for k in old_fields})
        same["rows_in_batch_order"] = _same_bits(new_fields["rows"], scored["values"])
        results[name] = {"same_bits": same, "bytes_old": old_counts, "bytes_new": new_counts}
    return results


def check_packed_equals_padded():
    return {f"{name}/{layout}": _compare(name, layout) for name in CONFIGS for layout in LAYOUTS}


if __name__ == "__main__":
    world_main([("assembly_gathers", check_assembly_gathers), ("packed_equals_padded", check_packed_equals_padded)])
