"""2-rank world: the memory levers of long sequences change no number (recompute)."""

import torch

from puzzle.config import ModelArch, Recompute
from puzzle.parallel.groups import layout_for
from puzzle.parallel.plan import ParallelPlan
from puzzle.training.engine import ModelEngine, OptimConfig
from puzzle.training.steps import lm_nll_step
from tests.harness import world_main

ARCH = ModelArch.llama(num_layers=4, hidden_size=64, ffn_hidden_size=96, num_attention_heads=8,
                       num_query_groups=4, vocab_size=200, make_vocab_size_divisible_by=64, seq_length=32)
B, S = 4, 12
TP2 = ParallelPlan(1, 1, 2)


def _tokens(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, ARCH.vocab_size, (B, S), generator=g)


def _grads(recompute):
    """This rank's gradients of one forward/backward of the actor at T=2 (main_grad buffers)."""
    eng = ModelEngine("actor", ARCH, layout_for(TP2), trainable=True, optim=OptimConfig(lr=1e-3), seed=3,
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
    from puzzle.training.vocab_parallel import logprobs_in_chunks, vocab_parallel_logprobs

    layout = layout_for(TP2)
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


if __name__ == "__main__":
    world_main([("recompute_gradients", check_recompute_gradients),
                ("chunked_logprobs_tp2", check_chunked_logprobs_tp2)])
