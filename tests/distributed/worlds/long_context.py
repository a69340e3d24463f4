"""4-rank world (shared, tests/harness.py SHARED_WORLDS): the memory levers of long sequences change
no number (recompute, chunked log-probs, stage offload, a KV budget). The model runs at T = 2 with
D = 2: a model must span the world (megatron's optimizer gathers its parameter groups over all ranks)."""

import torch

from puzzle.config import ModelArch, Recompute
from puzzle.parallel.groups import layout_for
from puzzle.parallel.plan import ParallelPlan
from puzzle.engine.model_engine import ModelEngine, OptimConfig
from puzzle.dataflow.steps import lm_nll_step
from tests.harness import world_main

ARCH = ModelArch.llama(num_layers=4, hidden_size=64, ffn_hidden_size=96, num_attention_heads=8,
                       num_query_groups=4, vocab_size=200, make_vocab_size_divisible_by=64, seq_length=32)
B, S = 4, 12
T2D2 = ParallelPlan(1, 2, 2)


def _tokens(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, ARCH.vocab_size, (B, S), generator=g)


def _grads(recompute):
    """This rank's gradients of one forward/backward of the actor at T=2 (main_grad buffers)."""
    eng = ModelEngine("actor", ARCH, layout_for(T2D2), trainable=True, optim=OptimConfig(lr=1e-3), seed=3,
                      recompute=recompute)
    eng.zero_grad()
    eng.forward_backward(lm_nll_step(ARCH.vocab_size), iter(_tokens().split(2)), B // 2, S, 2,
                         forward_only=False)
    return [p.main_grad.detach().clone() for p in eng.module.parameters()]


def check_recompute_gradients():
    """Every granularity/method gives the gradients of the run without recompute, bitwise."""
    ref = _grads(None)
    out = {}
    for rc in (Recompute("full", "uniform", 1), Recompute("full", "uniform", 2), Recompute("full", "block", 3),
               Recompute("selective")):
        grads = _grads(rc)
        out[f"{rc.granularity}/{rc.method}/{rc.num_layers}"] = {
            "equal": all(torch.equal(a, b) for a, b in zip(ref, grads)),
            "max_diff": max(float((a - b).abs().max()) for a, b in zip(ref, grads))}
    out["ref_norm"] = float(torch.stack([g.norm() for g in ref]).norm())
    return out


def check_chunked_logprobs_tp2():
    """At T=2 (each rank a vocabulary half, padding ids on rank 1): log-probs, entropy and their
    gradients a chunk of the sequence at a time equal the whole computation."""
    from puzzle.engine.vocab_parallel import logprobs_in_chunks, vocab_parallel_logprobs

    layout = layout_for(T2D2)
    g = torch.Generator().manual_seed(5)
    full = 3 * torch.randn(B, S, ARCH.padded_vocab_size, generator=g)
    targets = torch.randint(0, ARCH.vocab_size, (B, S), generator=g)
    half = ARCH.padded_vocab_size // 2
    mine = full[..., layout.t * half:(layout.t + 1) * half]

    def run(chunk):
        x = mine.clone().requires_grad_(True)
        args = (x, targets, layout.tp_group, ARCH.vocab_size, 0.8, True)
        lp, ent = vocab_parallel_logprobs(*args) if chunk is None else logprobs_in_chunks(*args, chunk)
        (lp.sum() + 0.3 * ent.sum()).backward()
        return lp.detach(), ent.detach(), x.grad

    ref = run(None)
    out = {"grad_sum": float(ref[2].abs().sum())}
    for chunk in (1, 5):
        got = run(chunk)
        out[f"max_diff_{chunk}"] = max(float((a - b).abs().max()) for a, b in zip(ref, got))
    return out


def _train_twice(plan, offload, distributed_optimizer):
    """Actor and a frozen reference in ``plan``: two training steps; with ``offload``, the
    stage offload runs its whole cycle between them. Returns (actor params, frozen state seen
    while offloaded, reference log-probs after)."""
    from puzzle.engine.offload import StageOffload

    layout = layout_for(plan)
    optim = OptimConfig(lr=1e-2, use_distributed_optimizer=distributed_optimizer)
    actor = ModelEngine("actor", ARCH, layout, trainable=True, optim=optim, seed=3)
    ref = ModelEngine("ref", ARCH, layout, trainable=False, seed=3)
    stages = StageOffload({"actor": actor, "ref": ref}, enabled=offload)
    share = B // plan.D
    mine = _tokens(2)[layout.d * share:(layout.d + 1) * share]
    seen = {}
    for it in range(2):
        stages.before("generation")
        if offload and it == 1:
            opt_copy, ref_copy = stages.copies["actor"], stages.copies["ref"]
            seen = {"opt_bytes_on_host": opt_copy.nbytes,
                    "opt_storages_freed": all(s.size() == 0 for s in opt_copy.storages.values()),
                    "ref_freed": all(p.untyped_storage().size() == 0 for p in ref.module.parameters()),
                    "grads_freed": all(b.grad_data.untyped_storage().size() == 0 for b in actor.model.buffers)}
        stages.before("scoring")
        stages.before("training")
        actor.train_step(lm_nll_step(ARCH.vocab_size), iter(mine.split(1)), share, S, 1)
    store = []
    with torch.no_grad():
        ref.forward_backward(lm_nll_step(ARCH.vocab_size, store), iter(mine.split(share)), 1, S, share,
                             forward_only=True)
    return [p.detach().clone() for p in actor.module.parameters()], seen, store


def check_offload_round_trip():
    """Training after an offload round trip equals training without it, bitwise (T=2 with the
    plain optimizer, D=4 with the distributed optimizer); the offloaded storages are freed."""
    out = {}
    for name, plan, dist_opt in (("tp2", T2D2, False), ("dp4_distopt", ParallelPlan(1, 4, 1), True)):
        ref_params, _, ref_lp = _train_twice(plan, False, dist_opt)
        params, seen, lp = _train_twice(plan, True, dist_opt)
        out[name] = {"params_equal": all(torch.equal(a, b) for a, b in zip(ref_params, params)),
                     "ref_logprobs_equal": all(torch.equal(a, b) for a, b in zip(ref_lp, lp)), **seen}
    return out


def check_budgeted_generation():
    """Generation under a KV budget that holds 3 of the 8 sequences (the rows the budget flag
    derives) streams them through 3 cache slots: the tokens equal those of all 8 at once, greedy
    and sampled (seeded), at T=2, with EOS so that slots free up at different steps."""
    from puzzle.rollout import SamplingParams, generate

    eng = ModelEngine("actor", ARCH, layout_for(T2D2), trainable=False, seed=3)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, ARCH.vocab_size, (n,), generator=g).tolist() for n in (5, 3, 8, 2, 6, 4, 7, 3)]
    max_new = 10
    per_seq = ARCH.shape.kv_bytes_per_sequence(8 + max_new, T2D2, 4)
    rows = int(3.5 * per_seq // per_seq)
    out = {"rows": rows}
    greedy = generate(eng, prompts, SamplingParams(max_new, greedy=True), seed=9).responses()
    eos = greedy[0][2]
    for name, params in (("greedy", SamplingParams(max_new, greedy=True, eos_id=eos)),
                         ("sampled", SamplingParams(max_new, temperature=0.9, top_p=0.9, eos_id=eos))):
        whole = generate(eng, prompts, params, seed=9).responses()
        budgeted = generate(eng, prompts, params, seed=9, micro_batch_size=rows).responses()
        out[name] = {"equal": whole == budgeted, "lengths": sorted({len(r) for r in whole})}
    return out


if __name__ == "__main__":
    world_main([("recompute_gradients", check_recompute_gradients),
                ("chunked_logprobs_tp2", check_chunked_logprobs_tp2),
                ("offload_round_trip", check_offload_round_trip),
                ("budgeted_generation", check_budgeted_generation)])
