"""4-rank world: intra-stage time-sharing (PUZZLE §4.2) against megatron's sequential 1F1B.

Two trainable models of DIFFERENT hidden sizes and DIFFERENT microbatch counts share the
devices and P.  Each check builds the engines twice from the same seeds, runs one training step
sequentially (megatron's schedule, run_stage 'sequential') and once time-shared (our executor),
and compares gradients, updated weights, loss reports and per-rank in-flight peaks.
"""

import torch

from puzzle.config import ModelArch
from puzzle.parallel.groups import layout_for
from puzzle.parallel.plan import ParallelPlan
from puzzle.pipeline import time_sharing_executor
from puzzle.pipeline.stage import StageContext, run_stage
from puzzle.training.engine import ModelEngine, OptimConfig
from puzzle.training.steps import lm_nll_step
from tests.harness import world_main

SEQ = 12
ARCH_A = ModelArch.llama(num_layers=4, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                         num_query_groups=2, vocab_size=100, make_vocab_size_divisible_by=64, seq_length=16)
ARCH_B = ModelArch.llama(num_layers=4, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4,
                         num_query_groups=4, vocab_size=100, make_vocab_size_divisible_by=64, seq_length=16)


def _tokens(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, ARCH_A.vocab_size, (n, SEQ), generator=g)


def _value_step(store):
    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        pos = torch.arange(mb.shape[1]).unsqueeze(0).expand_as(mb)
        values = model(mb, pos, None)

        def loss_func(v):
            store.append(v.detach().clone())
            loss = (v.squeeze(-1) - 0.5).pow(2).sum()
            return loss, torch.tensor(v.numel(), dtype=torch.int), {"sq": loss.detach().clone()}

        return values, loss_func

    return forward_step


def _engines(plan, trainable):
    lay = layout_for(plan)
    opt = OptimConfig(lr=1e-2) if trainable else None
    a = ModelEngine("actor", ARCH_A, lay, trainable=trainable, optim=opt, seed=11)
    b = ModelEngine("critic", ARCH_B, lay, trainable=trainable, optim=opt, seed=22)
    return lay, a, b


def _contexts(plan, lay, a, b, n_a, n_b, stores):
    """Each DP rank takes its share: n_k microbatches of size 1."""
    ta, tb = _tokens(n_a * plan.D, 1), _tokens(n_b * plan.D, 2)
    d = max(lay.d, 0)
    ma, mb_ = ta[d * n_a:(d + 1) * n_a], tb[d * n_b:(d + 1) * n_b]
    return [StageContext(a, lm_nll_step(ARCH_A.vocab_size, stores[0]), iter(ma.split(1)), n_a, SEQ, 1),
            StageContext(b, _value_step(stores[1]), iter(mb_.split(1)), n_b, SEQ, 1)]


def _snapshot(eng, what):
    out = {}
    for name, p in eng.module.named_parameters():
        t = p.main_grad if what == "grad" else p
        out[name] = t.detach().clone()
    return out


def _maxdiff(x, y):
    assert x.keys() == y.keys()
    return max((float((x[k] - y[k]).abs().max()) for k in x), default=0.0)


def _bitwise(x, y):
    return all(torch.equal(x[k], y[k]) for k in x)


def _train_once(plan, n_a, n_b, placement):
    lay, a, b = _engines(plan, True)
    if not lay.member:
        return None
    stores = ([], [])
    ctxs = _contexts(plan, lay, a, b, n_a, n_b, stores)
    a.zero_grad()
    b.zero_grad()
    stats = time_sharing_executor.ExecStats()
    if placement == "time-sharing":
        reports = time_sharing_executor.run_time_shared(ctxs, forward_only=False, stats=stats)
    else:
        reports = run_stage(ctxs, forward_only=False, placement=placement)
    grads = [_snapshot(a, "grad"), _snapshot(b, "grad")]
    steps = [a.optimizer_step(), b.optimizer_step()]
    weights = [_snapshot(a, "w"), _snapshot(b, "w")]
    return dict(reports=reports, stores=stores, grads=grads, weights=weights, stats=stats,
                grad_norms=[s["grad_norm"] for s in steps], layout=lay)


def _compare_training(plan, n_a, n_b):
    seq = _train_once(plan, n_a, n_b, "sequential")
    ts = _train_once(plan, n_a, n_b, "time-sharing")
    if seq is None:
        return {"member": False}
    st = ts["stats"]
    res = {"member": True, "stage": st.stage, "mode": st.mode,
           "peak_in_flight": st.peak_in_flight, "sequential_peak": st.sequential_peak,
           "expected_peak": st.expected_peak, "order": " ".join(st.order),
           "grad_norms_seq": seq["grad_norms"], "grad_norms_ts": ts["grad_norms"]}
    for k, name in enumerate(("A", "B")):
        res[f"grad_diff_{name}"] = _maxdiff(seq["grads"][k], ts["grads"][k])
        res[f"weight_diff_{name}"] = _maxdiff(seq["weights"][k], ts["weights"][k])
        res[f"grad_bitwise_{name}"] = _bitwise(seq["grads"][k], ts["grads"][k])
        res[f"weight_bitwise_{name}"] = _bitwise(seq["weights"][k], ts["weights"][k])
        res[f"grad_nonzero_{name}"] = any(bool(g.abs().sum() > 0) for g in ts["grads"][k].values())
        r_seq, r_ts = seq["reports"][k], ts["reports"][k]
        res[f"n_reports_{name}"] = [len(r_seq), len(r_ts)]
        res[f"reports_equal_{name}"] = (len(r_seq) == len(r_ts) and all(
            all(torch.equal(x[key], y[key]) for key in x) for x, y in zip(r_seq, r_ts)))
        s_seq, s_ts = seq["stores"][k], ts["stores"][k]
        res[f"outputs_equal_{name}"] = (len(s_seq) == len(s_ts)
                                        and all(torch.equal(x, y) for x, y in zip(s_seq, s_ts)))
    return res


def check_train_p2():
    """P=2 with D=2 (4 ranks): N_A=3, N_B=5 per DP rank."""
    return _compare_training(ParallelPlan(2, 2, 1), 3, 5)


def check_train_p2_tp():
    """P=2 with T=2: vocab-parallel / TP inside the stream."""
    return _compare_training(ParallelPlan(2, 1, 2), 4, 2)


def check_train_p4():
    """P=4: N_A=4, N_B=6."""
    return _compare_training(ParallelPlan(4, 1, 1), 4, 6)


def check_train_p1():
    """P=1 (D=4): falls back to megatron's no-pipelining schedule per context."""
    return _compare_training(ParallelPlan(1, 4, 1), 2, 3)


def check_forward_only():
    """Frozen models (scoring) at P=4: time-shared outputs == sequential outputs."""
    plan = ParallelPlan(4, 1, 1)
    lay, a, b = _engines(plan, False)
    outs, stats = {}, time_sharing_executor.ExecStats()
    for placement in ("sequential", "time-sharing"):
        stores = ([], [])
        ctxs = _contexts(plan, lay, a, b, 3, 5, stores)
        with torch.no_grad():
            if placement == "time-sharing":
                time_sharing_executor.run_time_shared(ctxs, forward_only=True, stats=stats)
            else:
                run_stage(ctxs, forward_only=True, placement=placement)
        outs[placement] = stores
    s, t = outs["sequential"], outs["time-sharing"]
    return {"n": [len(s[0]), len(s[1]), len(t[0]), len(t[1])],
            "equal": all(len(x) == len(y) and all(torch.equal(u, v) for u, v in zip(x, y))
                         for x, y in zip(s, t)),
            "stage": stats.stage, "mode": stats.mode}


def check_unequal_p():
    """A stream of a P=2 and a P=4 model is rejected with a clear error (before any P2P)."""
    la, lb = layout_for(ParallelPlan(2, 2, 1)), layout_for(ParallelPlan(4, 1, 1))
    a = ModelEngine("actor", ARCH_A, la, trainable=False, seed=1)
    b = ModelEngine("critic", ARCH_B, lb, trainable=False, seed=2)
    ctxs = [StageContext(a, None, iter([]), 2, SEQ, 1), StageContext(b, None, iter([]), 2, SEQ, 1)]
    try:
        run_stage(ctxs, forward_only=True, placement="time-sharing")
    except ValueError as e:
        return {"raised": True, "message": str(e)}
    return {"raised": False, "message": ""}


def check_memory_guard():
    """All N_k < P - stage: the stream would hold more than sequential 1F1B -> sequential program."""
    plan = ParallelPlan(4, 1, 1)
    lay, a, b = _engines(plan, True)
    stores = ([], [])
    ctxs = _contexts(plan, lay, a, b, 1, 2, stores)
    a.zero_grad()
    b.zero_grad()
    st = time_sharing_executor.ExecStats()
    time_sharing_executor.run_time_shared(ctxs, forward_only=False, stats=st)
    return {"mode": st.mode, "peak": st.peak_in_flight, "sequential_peak": st.sequential_peak}


if __name__ == "__main__":
    world_main([("train_p2", check_train_p2), ("train_p2_tp", check_train_p2_tp),
                ("train_p4", check_train_p4), ("train_p1", check_train_p1),
                ("forward_only", check_forward_only), ("unequal_p", check_unequal_p),
                ("memory_guard", check_memory_guard)])
