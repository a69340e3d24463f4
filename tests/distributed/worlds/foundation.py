"""4-rank world: models with different layouts side by side (foundation issue)."""

import torch
import torch.distributed as dist

from puzzle.config import ModelArch
from puzzle.parallel.groups import layout_for
from puzzle.parallel.plan import ParallelPlan
from puzzle.engine.model_engine import ModelEngine, OptimConfig
from puzzle.dataflow.steps import lm_nll_step
from tests.harness import world_main

ARCH = ModelArch.llama(num_layers=4, hidden_size=64, ffn_hidden_size=96, num_attention_heads=8,
                       num_query_groups=4, vocab_size=200, make_vocab_size_divisible_by=64, seq_length=32)
B, S = 4, 12


def _tokens(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, ARCH.vocab_size, (B, S), generator=g)


def _logprobs_at(plan: ParallelPlan, role="actor"):
    layout = layout_for(plan)
    eng = ModelEngine(role, ARCH, layout, trainable=False, seed=7)
    if not eng.member:
        return None
    tokens = _tokens()
    # each DP rank takes its share of the batch
    share = B // plan.D
    mine = tokens[layout.d * share:(layout.d + 1) * share]
    store = []
    mbs = 1
    with torch.no_grad():
        eng.forward_backward(lm_nll_step(ARCH.vocab_size, store), iter(mine.split(mbs)), share // mbs, S, mbs,
                             forward_only=True)
    if not layout.is_last_stage or layout.t != 0:
        return None
    return {"d": layout.d, "lp": torch.cat(store).tolist()}


def check_layouts_agree():
    """Same seed -> same log-probs at every layout (layout-independent init + vocab-parallel lp)."""
    out = {}
    for plan in [ParallelPlan(1, 1, 1), ParallelPlan(1, 1, 4), ParallelPlan(2, 1, 2),
                 ParallelPlan(2, 2, 1), ParallelPlan(1, 2, 2), ParallelPlan(4, 1, 1)]:
        res = _logprobs_at(plan)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, res)
        parts = sorted([g for g in gathered if g is not None], key=lambda g: g["d"])
        out[str(plan)] = [row for g in parts for row in g["lp"]]
    return out


def check_two_layouts_train():
    """actor (2,1,2) and critic (1,2,2) live together; each runs forward+backward+step."""
    la, lc = layout_for(ParallelPlan(2, 1, 2)), layout_for(ParallelPlan(1, 2, 2))
    actor = ModelEngine("actor", ARCH, la, trainable=True, optim=OptimConfig(lr=1e-3), seed=1)
    critic = ModelEngine("critic", ARCH, lc, trainable=True, optim=OptimConfig(lr=1e-3), seed=2)
    tokens = _tokens(1)
    res = {}
    before = [p.detach().clone() for p in actor.module.parameters()]
    store = []
    st = actor.train_step(lm_nll_step(ARCH.vocab_size, store), iter(tokens.split(1)), B, S, 1)
    res["actor_grad_norm"] = st["grad_norm"]
    res["actor_changed"] = any(not torch.equal(a, p) for a, p in zip(before, actor.module.parameters()))

    share = B // 2
    mine = tokens[lc.d * share:(lc.d + 1) * share]

    def value_step(data_iterator, model):
        mb = next(data_iterator)
        pos = torch.arange(mb.shape[1]).unsqueeze(0).expand_as(mb)
        values = model(mb, pos, None)

        def loss_func(v):
            loss = (v.squeeze(-1) - 1.0).pow(2).sum()
            return loss, torch.tensor(v.numel(), dtype=torch.int), {"v": v.detach().mean()}

        return values, loss_func

    cbefore = [p.detach().clone() for p in critic.module.parameters()]
    st = critic.train_step(value_step, iter(mine.split(1)), share, S, 1)
    res["critic_grad_norm"] = st["grad_norm"]
    res["critic_changed"] = any(not torch.equal(a, p) for a, p in zip(cbefore, critic.module.parameters()))
    res["value_shape"] = list(critic.module(mine[:1], torch.arange(S).unsqueeze(0), None).shape)
    return res


if __name__ == "__main__":
    world_main([("layouts_agree", check_layouts_agree), ("two_layouts_train", check_two_layouts_train)])
