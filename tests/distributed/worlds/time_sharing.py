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
from puzzle.pipeline.time_sharing_schedule import ContextSpec
from puzzle.engine.model_engine import ModelEngine, OptimConfig
from puzzle.dataflow.steps import lm_nll_step
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


def _mixed_guard_once(placement: str, stats):
    """Actor (2,1,2) with one micro-batch of 12 tokens and critic (2,2,1) with two of 4 tokens on
    its DP rank 0 and of 12 on DP rank 1, trained once under ``placement``; gradients and the
    memory guard's local decision on this rank."""
    la, lb = layout_for(ParallelPlan(2, 1, 2)), layout_for(ParallelPlan(2, 2, 1))
    opt = OptimConfig(lr=1e-2)
    a = ModelEngine("actor", ARCH_A, la, trainable=True, optim=opt, seed=11)
    b = ModelEngine("critic", ARCH_B, lb, trainable=True, optim=opt, seed=22)
    seq_b = 4 if lb.d == 0 else 12
    tb = torch.randint(0, ARCH_B.vocab_size, (2, seq_b), generator=torch.Generator().manual_seed(5 + lb.d))
    ctxs = [StageContext(a, lm_nll_step(ARCH_A.vocab_size, []), iter(_tokens(1, 1).split(1)), 1, SEQ, 1),
            StageContext(b, _value_step([]), iter(tb.split(1)), 2, seq_b, 1)]
    a.zero_grad()
    b.zero_grad()
    if placement == "time-sharing":
        time_sharing_executor.run_time_shared(ctxs, forward_only=False, stats=stats)
    else:
        run_stage(ctxs, forward_only=False, placement=placement)
    specs = [ContextSpec(str(k), c.num_microbatches) for k, c in enumerate(ctxs)]
    local = time_sharing_executor._guard_ok(2, specs, time_sharing_executor._weights(ctxs))
    return [_snapshot(a, "grad"), _snapshot(b, "grad")], local


def check_mixed_plans_guard():
    """Models of different (D, T) at equal P: the memory guard's local decision differs between the
    critic's DP ranks (activation sizes differ), the stream runs the decision of every rank (the
    sequential program everywhere), with sequential's gradients."""
    seq, _ = _mixed_guard_once("sequential", None)
    st = time_sharing_executor.ExecStats()
    ts, local = _mixed_guard_once("time-sharing", st)
    return {"local_guard_ok": local, "mode": st.mode,
            "bitwise": all(_bitwise(x, y) for x, y in zip(seq, ts))}


# ---- PPO with an actor at (2,1,2) and the other models at (2,2,1), time-shared vs sequential ----------
MIXED = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
         "--critic-tensor-model-parallel-size", "1", "--ref-tensor-model-parallel-size", "1",
         "--score-placement", "time-sharing", "--train-placement", "time-sharing"]


def _uneven_budget(lengths) -> int:
    """The smallest token budget at which the two balanced DP shares of these rows need different
    numbers of micro-batches (0: none up to four times the longest row)."""
    from puzzle.dataflow.token_budget import balance_rows, budget_micro_batches

    for budget in range(max(lengths), 4 * max(lengths)):
        if len({len(budget_micro_batches([lengths[i] for i in s], budget)) for s in balance_rows(lengths, 2)}) > 1:
            return budget
    return 0


def _mixed_score(trainer, batch, placement: str, budget) -> dict:
    from dataclasses import replace

    from tests.distributed.worlds.packing import SCORED

    ppo = replace(trainer.cfg.ppo, log_prob_max_token_len_per_gpu=budget)
    trainer.scoring.cfg = replace(trainer.cfg, score_placement=placement, ppo=ppo)
    batch, _ = trainer.score(batch)
    return {k: batch.fields[k].clone() for k in SCORED if k in batch.fields}, batch


def _mixed_gradients(trainer, mini, placement: str, budget) -> tuple:
    """Each trained model's gradient buffers and loss sums after one training mini-batch under
    ``placement``; each model's micro-batch count on this rank; the stream's mode."""
    from puzzle.dataflow import steps

    ppo, R = trainer.cfg.ppo, mini.max_new_tokens
    jobs = [("actor", steps.actor_train_step(trainer.vocab, ppo.temperature, R, ppo.clip_eps, ppo.entropy_coef)),
            ("critic", steps.critic_train_step(R, ppo.value_clip_eps))]
    contexts = trainer.micro.contexts(mini, jobs, budget, placement)
    stats = time_sharing_executor.ExecStats()
    if placement == "time-sharing":
        outs = time_sharing_executor.run_time_shared(contexts, forward_only=False, stats=stats)
    else:
        outs = run_stage(contexts, forward_only=False, placement=placement)
    grads, sums = {}, {}
    for (role, _), out in zip(jobs, outs):
        eng = trainer.engines[role]
        grads[role] = torch.cat([b.grad_data.float().flatten() for b in eng.model.buffers]).clone()
        sums[role] = [float(sum(float(o[k]) for o in out)) for k in sorted(out[0])] if out else []
        eng.zero_grad()
    return grads, sums, [c.num_microbatches for c in contexts], stats.mode


def check_mixed_plans_ppo():
    """PPO (actor, critic, reference, reward model) with the actor at (2,1,2) and the critic and the
    reference at (2,2,1) on the same 4 ranks: the scored fields and one training mini-batch's
    gradients and loss sums time-shared and sequential, with fixed-count micro-batches (same
    micro-batches: bitwise) and token budgets (the critic's and reference's DP ranks get as many
    micro-batches when time-shared: the same numbers within fp32 rounding)."""
    from puzzle.arguments import parse_args, validate_args
    from puzzle.data.prompts import bundled_prompts_path, load_prompt_dataset
    from puzzle.data.tokenizers import build_tokenizer
    from puzzle.dataflow.trainer import PPOTrainer
    from tests.distributed.worlds.packing import CONFIGS, MODEL, _largest

    tok = build_tokenizer("ByteLevelTokenizer", None)
    cfg = validate_args(parse_args(MODEL + CONFIGS["ppo"] + MIXED), torch.distributed.get_world_size(),
                        tok.vocab_size)
    ds = load_prompt_dataset(bundled_prompts_path(), tok, max_prompt_len=cfg.ppo.max_prompt_length)
    trainer = PPOTrainer(cfg, tok, ds)
    try:
        batch, _ = trainer.generate(ds.prompts[:cfg.ppo.rollout_batch_size])
        mask = batch.response_mask.bool()
        uneven = _uneven_budget(batch.sequence_lengths)  # the rows of the one training mini-batch too
        out = {"plans": {r: str(e.layout.plan) for r, e in trainer.engines.items()}, "budget": uneven}
        for mode, dynamic in (("fixed", False), ("budget", True)):
            trainer.micro.dynamic_bsz = dynamic  # --use-dynamic-bsz, at the budget chosen above
            jobs = trainer.scoring.jobs(batch.max_new_tokens)
            out[f"{mode}/scoring_micro_batches"] = {p: [c.num_microbatches for c in trainer.micro.contexts(
                batch, jobs, uneven if dynamic else None, p)] for p in ("sequential", "time-sharing")}
            (seq, _), (ts, scored) = (_mixed_score(trainer, batch, p, uneven) for p in ("sequential", "time-sharing"))
            for k in seq:
                out[f"{mode}/{k}"] = _largest(seq[k], ts[k], None if k == "scores" else mask)
                out[f"{mode}/{k}"]["bitwise"] = torch.equal(seq[k], ts[k])
            trained, _ = trainer.compute_advantages(scored)
            mini = trained.rows(torch.arange(cfg.ppo.mini_batch_size))
            budget = uneven if dynamic else None
            g_seq, s_seq, n_seq, _ = _mixed_gradients(trainer, mini, "sequential", budget)
            g_ts, s_ts, n_ts, out[f"{mode}/stream"] = _mixed_gradients(trainer, mini, "time-sharing", budget)
            out[f"{mode}/micro_batches"] = {"sequential": n_seq, "time-sharing": n_ts}
            for role in g_seq:
                out[f"{mode}/{role}_grad"] = _largest(g_seq[role], g_ts[role])
                out[f"{mode}/{role}_grad"]["bitwise"] = torch.equal(g_seq[role], g_ts[role])
                out[f"{mode}/{role}_sums"] = [s_seq[role], s_ts[role]]
        return out
    finally:
        trainer.close()


if __name__ == "__main__":
    world_main([("train_p2", check_train_p2), ("train_p2_tp", check_train_p2_tp),
                ("train_p4", check_train_p4), ("train_p1", check_train_p1),
                ("forward_only", check_forward_only), ("unequal_p", check_unequal_p),
                ("memory_guard", check_memory_guard), ("mixed_plans_guard", check_mixed_plans_guard),
                ("mixed_plans_ppo", check_mixed_plans_ppo)])
