"""4-rank world: the inter-stage switch (routing executor, shadow model, overlap with the step)."""

from types import SimpleNamespace

import weakref

import torch
import torch.distributed as dist

from puzzle.config import ModelArch
from puzzle.parallel import groups
from puzzle.parallel.groups import layout_for
from puzzle.parallel.plan import ParallelPlan, PlanError
from puzzle.switch.shadow import param_bytes, switch_to_generation
from puzzle.engine.model_engine import ModelEngine, OptimConfig
from puzzle.dataflow.steps import lm_nll_step
from tests.harness import world_main

ARCH = ModelArch.llama(num_layers=4, hidden_size=64, ffn_hidden_size=96, num_attention_heads=8,
                       num_query_groups=4, vocab_size=200, make_vocab_size_divisible_by=64, seq_length=32)
B, S = 4, 12
SEED = 11
P = ParallelPlan
PAIRS = [(P(4, 1, 1), P(2, 1, 2)), (P(2, 1, 2), P(1, 1, 4)), (P(1, 2, 2), P(1, 1, 4)),
         (P(2, 2, 1), P(1, 2, 2))]
PAIRS = PAIRS + [(d, s) for s, d in PAIRS]


def _tokens(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, ARCH.vocab_size, (B, S), generator=g)


def _logprobs(module, layout):
    """Log-probs of the fixed tokens through ``module`` in ``layout`` (forward only), gathered
    to every rank as a [B, S-1] list (rows in batch order)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    res = None
    if module is not None:
        plan = layout.plan
        share = B // plan.D
        mine = _tokens()[layout.d * share:(layout.d + 1) * share]
        store = []
        fb = get_forward_backward_func(pp_size=plan.P)
        module.eval()
        with torch.no_grad():
            fb(forward_step_func=lm_nll_step(ARCH.vocab_size, store), data_iterator=iter(mine.split(1)), model=[module],
               num_microbatches=share, seq_length=S, micro_batch_size=1, forward_only=True,
               p2p_communicator=layout.p2p_communicator(module.config), pg_collection=layout.pg_collection)
        if layout.is_last_stage and layout.t == 0:
            res = {"d": layout.d, "lp": torch.cat(store).tolist()}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, res)
    parts = sorted([g for g in gathered if g is not None], key=lambda g: g["d"])
    return [row for g in parts for row in g["lp"]]


def _params_equal(a, b):
    if a is None or b is None:
        return a is None and b is None, []
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    bad = [n for n in pa if n not in pb or not torch.equal(pa[n], pb[n])]
    return set(pa) == set(pb) and not bad, bad


def check_pairs():
    """Each pair: shadow == model built at dst with the same seed (bitwise), bytes == lower bound,
    shadow log-probs == training-layout log-probs; then release."""
    me = dist.get_rank()
    plans = []
    for s, d in PAIRS:
        for p in (s, d):
            if p not in plans:
                plans.append(p)
    engines = {p: ModelEngine("actor", ARCH, layout_for(p), trainable=False, seed=SEED) for p in plans}
    lps = {p: _logprobs(engines[p].module, engines[p].layout) for p in plans}
    out = {}
    for src, dst in PAIRS:
        shadow = switch_to_generation(engines[src], dst, segments=2, bucket_bytes=64 * 1024)
        ok, bad = _params_equal(shadow.module, engines[dst].module)
        st = shadow.switch_stats
        shadow_lp = _logprobs(shadow.module, shadow.layout)
        diff = max(abs(x - y) for r1, r2 in zip(shadow_lp, lps[src]) for x, y in zip(r1, r2))
        pb_before = shadow.param_bytes()
        alive = [weakref.ref(t) for t in shadow.module.parameters()]
        mem = shadow.release()
        out[f"{src}->{dst}"] = {
            "bitwise": ok, "bad": bad[:5], "bytes_received": st.bytes_received, "bytes_sent": st.bytes_sent,
            "lacking": shadow.table.bytes_lacking(me), "sent_expected": shadow.table.bytes_sent(me),
            "messages": st.messages_received, "max_lp_diff": diff, "n_lp": len(shadow_lp),
            "param_bytes_before_release": pb_before, "param_bytes_after_release": param_bytes(shadow.module),
            "module_gone": shadow.module is None, "tensors_alive": sum(r() is not None for r in alive),
            "rss": [mem["rss_after_build"], mem["rss_after_release"]],
        }
    # the critic (scalar value head: output_layer.weight <-> value_head.weight)
    src, dst = P(2, 1, 2), P(1, 2, 2)
    crit = ModelEngine("critic", ARCH, layout_for(src), trainable=False, seed=SEED)
    ref = ModelEngine("critic", ARCH, layout_for(dst), trainable=False, seed=SEED)
    shadow = switch_to_generation(crit, dst)
    out["critic"] = {"bitwise": _params_equal(shadow.module, ref.module)[0]}
    shadow.release()
    return out


def _train_world(use_do: bool, mode: str, iters: int = 2):
    """Train the actor at (1,2,2) for ``iters`` steps, switching to (2,1,2) after each.
    mode: 'plain' (train_step then switch) or 'K<n>' (step overlapped with the switch)."""
    src, dst = P(1, 2, 2), P(2, 1, 2)
    layout = layout_for(src)
    eng = ModelEngine("actor", ARCH, layout, trainable=True, seed=SEED,
                      optim=OptimConfig(lr=1e-2, use_distributed_optimizer=use_do))
    init = [p.detach().clone() for p in eng.module.parameters()]
    shadow, norms = None, []
    for it in range(iters):
        tokens = _tokens(100 + it)
        share = B // src.D
        mine = tokens[layout.d * share:(layout.d + 1) * share]
        store = []
        if mode == "plain":
            st = eng.train_step(lm_nll_step(ARCH.vocab_size, store), iter(mine.split(1)), share, S, 1)
            shadow = switch_to_generation(eng, dst, shadow=shadow)
        else:
            eng.model.zero_grad_buffer()
            eng.optimizer.zero_grad()
            eng.forward_backward(lm_nll_step(ARCH.vocab_size, store), iter(mine.split(1)), share, S, 1, forward_only=False)
            shadow = switch_to_generation(eng, dst, segments=int(mode[1:]), shadow=shadow, optimizer_step=True,
                                          bucket_bytes=16 * 1024)
            st = shadow.step_result
        norms.append(st["grad_norm"])
    train = [p.detach().clone() for p in eng.module.parameters()]
    changed = any(not torch.equal(a, b) for a, b in zip(init, train))
    return eng, shadow, train, changed, norms


def check_overlap():
    """K=1 == K=8 == plain step + switch (bitwise), with and without the DistributedOptimizer."""
    out = {}
    for use_do in (False, True):
        runs = {m: _train_world(use_do, m) for m in ("plain", "K1", "K8")}
        ref_eng, ref_shadow, ref_train, _, ref_norms = runs["plain"]
        res = {"changed": runs["plain"][3], "norms": {m: r[4] for m, r in runs.items()}}
        # the shadow of the plain run equals the dst slices of the trained weights: check by a
        # model at dst holding them? -> compare log-probs across layouts
        res["lp_diff"] = max(abs(x - y) for r1, r2 in zip(_logprobs(ref_shadow.module, ref_shadow.layout),
                                                         _logprobs(ref_eng.module, ref_eng.layout))
                             for x, y in zip(r1, r2))
        for m in ("K1", "K8"):
            eng, shadow, train, _, _ = runs[m]
            res[f"{m}_train_equal"] = all(torch.equal(a, b) for a, b in zip(ref_train, train))
            res[f"{m}_shadow_equal"] = _params_equal(shadow.module, ref_shadow.module)[0]
            res[f"{m}_bytes_ok"] = shadow.switch_stats.bytes_received == shadow.table.bytes_lacking(dist.get_rank())
            res[f"{m}_segments"] = shadow.switch_stats.segments
        for r in runs.values():
            r[1].release()
        out["do" if use_do else "nodo"] = res
    return out


def check_bad_plans():
    """Bad plans raise PlanError before any layout, allocation or transfer."""
    src = P(2, 1, 2)
    eng = SimpleNamespace(arch=ARCH, role="actor", layout=SimpleNamespace(plan=src), config=None)
    six = ModelArch.llama(num_layers=6, hidden_size=64, ffn_hidden_size=96, num_attention_heads=8,
                          num_query_groups=4, vocab_size=200, make_vocab_size_divisible_by=64, seq_length=32)
    two_groups = ModelArch.llama(num_layers=4, hidden_size=64, ffn_hidden_size=96, num_attention_heads=8,
                                 num_query_groups=2, vocab_size=200, make_vocab_size_divisible_by=64, seq_length=32)
    cases = {
        "world_size": (eng, P(1, 1, 2)),
        "degrees": (SimpleNamespace(arch=six, role="actor", layout=SimpleNamespace(plan=P(2, 1, 2)),
                                    config=None), P(4, 1, 1)),
        "tp_split": (SimpleNamespace(arch=two_groups, role="actor", layout=SimpleNamespace(plan=P(2, 1, 2)),
                                     config=None), P(1, 1, 4)),
        "not_a_plan": (eng, (1, 1, 4)),
    }
    out = {}
    for name, (e, dst) in cases.items():
        n_layouts = len(groups._LAYOUTS)
        try:
            switch_to_generation(e, dst)
            out[name] = {"raised": False}
        except PlanError as exc:
            out[name] = {"raised": True, "msg": str(exc), "no_layout_built": len(groups._LAYOUTS) == n_layouts}
    return out


if __name__ == "__main__":
    world_main([("bad_plans", check_bad_plans), ("pairs", check_pairs), ("overlap", check_overlap)])
