"""Tests for puzzle.pipeline.time_sharing_schedule: 1F1B tables, PUZZLE time-sharing (Fig. 5(b)),
the blocking-P2P simulator and Eq. (1)."""

import itertools
import types
import warnings

import pytest

from puzzle.pipeline import time_sharing_schedule as sch
from puzzle.pipeline.time_sharing_schedule import (
    Action,
    CommStep,
    ContextSpec,
    DeadlockError,
    eq1_makespans,
    executor_program,
    one_f_one_b,
    p2p_ops,
    peak_in_flight,
    sequential_schedule,
    simulate,
    stream_makespan,
    theoretical_speedup,
    time_shared_schedule,
)


def order(actions):
    """Compact form: 'F1.0' = forward of context 1 microbatch 0."""
    return [f"{a.kind}{a.context}.{a.microbatch}" for a in actions]


def ctxs(*ns, forward_only=False):
    return [ContextSpec(f"m{k}", n, forward_only) for k, n in enumerate(ns)]


# ----------------------------------------------------------------------------- 1F1B

def test_one_f_one_b_p4_n8_matches_megatron_order():
    expected = {
        0: "F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7",
        1: "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 B6 B7",
        2: "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 B7",
        3: "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7",
    }
    for stage, exp in expected.items():
        got = [f"{a.kind}{a.microbatch}" for a in one_f_one_b(4, stage, 8)]
        assert got == exp.split(), stage
        assert {a.context for a in one_f_one_b(4, stage, 8)} == {0}


def test_one_f_one_b_few_microbatches_and_forward_only():
    # N < warm-up: all forwards, then all backwards (megatron's min(P-s-1, N)).
    assert [f"{a.kind}{a.microbatch}" for a in one_f_one_b(4, 0, 2)] == ["F0", "F1", "B0", "B1"]
    assert [f"{a.kind}{a.microbatch}" for a in one_f_one_b(4, 0, 3, forward_only=True)] == [
        "F0", "F1", "F2"]


def _megatron_trace(S, P, stage, N, forward_only):
    """Run the installed megatron 1F1B function with recording fakes; return its
    sequence of P2PCommunicator calls and forward/backward steps."""
    log, nb = [], [0]

    class Group:
        def size(self):
            return P

        def rank(self):
            return stage

    class Comm:
        pp_group = Group()

        def __getattr__(self, name):
            return lambda *a, **k: log.append(name)

    cfg = types.SimpleNamespace(
        overlap_p2p_comm=False, finalize_model_grads_func=None, timers=None, no_sync_func=None,
        num_microbatches_with_partial_activation_checkpoints=None, deallocate_pipeline_outputs=False,
        grad_sync_func=None, fine_grained_activation_offloading=False)

    def fwd(*a, current_microbatch, **k):
        log.append(("F", current_microbatch))
        return ("out",), 0

    def bwd(*a, **k):
        log.append(("B", nb[0]))  # megatron pops input_tensors FIFO: backward i is microbatch i
        nb[0] += 1

    pgc = types.SimpleNamespace(tp=None, cp=types.SimpleNamespace(size=lambda: 1), embd=None,
                                pos_embd=None, pp=Group(), dp_cp=None)
    patches = dict(
        get_model_config=lambda m: cfg, get_model_type=lambda m: None, forward_step=fwd,
        backward_step=bwd, deallocate_output_tensor=lambda *a, **k: None,
        get_tensor_shapes=lambda **k: [(1,)], is_pp_first_stage=lambda g: g.rank() == 0,
        is_pp_last_stage=lambda g: g.rank() == g.size() - 1,
        torch=types.SimpleNamespace(zeros=lambda *a, **k: 0, int=int))
    old = {k: getattr(S, k) for k in patches}
    try:
        for k, v in patches.items():
            setattr(S, k, v)
        S.forward_backward_pipelining_without_interleaving(
            forward_step_func=None, data_iterator=None, model=object(), num_microbatches=N,
            seq_length=1, micro_batch_size=1, forward_only=forward_only,
            p2p_communicator=Comm(), pg_collection=pgc)
    finally:
        for k, v in old.items():
            setattr(S, k, v)
    return log


def test_executor_program_matches_installed_megatron_call_sequence():
    """Compute order AND P2P call placement equal megatron-core's own 1F1B code."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import megatron.core.pipeline_parallel.schedules as S
    for P in (1, 2, 4):
        for stage, N, fo in itertools.product(range(P), (1, 3, 8), (False, True)):
            ref = _megatron_trace(S, P, stage, N, fo)
            ours = [(s.kind, s.microbatch) if isinstance(s, Action) else s.call
                    for s in executor_program(P, stage, ctxs(N, forward_only=fo))]
            assert ours == ref, (P, stage, N, fo)


# ----------------------------------------------------------------------------- Figure 5(b)

FIG5B_STAGE0 = ("F0.0 F0.1 F0.2 F0.3 B0.0 F1.0 B0.1 F1.1 B0.2 F1.2 B0.3 F1.3 "
                "B1.0 B1.1 B1.2 B1.3").split()
FIG5B_LAST = ("F0.0 B0.0 F0.1 B0.1 F0.2 B0.2 F0.3 B0.3 "
              "F1.0 B1.0 F1.1 B1.1 F1.2 B1.2 F1.3 B1.3").split()


def test_figure5b_orders_stage0_and_last_stage():
    two = ctxs(4, 4)
    assert order(time_shared_schedule(4, 0, two)) == FIG5B_STAGE0
    assert order(time_shared_schedule(4, 3, two)) == FIG5B_LAST
    # stage 1: 2 warm-up slots of model 1's cool-down are filled by model 2.
    assert order(time_shared_schedule(4, 1, two)) == (
        "F0.0 F0.1 F0.2 B0.0 F0.3 B0.1 F1.0 B0.2 F1.1 B0.3 F1.2 B1.0 F1.3 B1.1 B1.2 B1.3").split()
    # the sequential baseline (Figure 5(a)) keeps the models apart
    assert order(sequential_schedule(4, 0, two))[:8] == "F0.0 F0.1 F0.2 F0.3 B0.0 B0.1 B0.2 B0.3".split()


def test_figure5b_timing_model2_first_forward_at_slot_9_not_15():
    two = ctxs(4, 4)
    ts = simulate(4, two, [1, 1], [1, 1])
    seq = simulate(4, two, [1, 1], [1, 1], time_shared=False)

    def start(tl, act):
        return next(s for s, _, a in tl.stages[0] if a == act)

    assert start(ts, Action("F", 1, 0)) == 8   # 1-indexed slot 9, right after B1.0 ends
    assert start(seq, Action("F", 1, 0)) == 14  # 1-indexed slot 15
    assert ts.makespan == 22 == (8 + 4 - 1) * 2  # "like 8 microbatches of one model"
    assert seq.makespan == 28


@pytest.mark.parametrize("P", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("ns", [(4, 4), (3, 5), (2, 3, 4), (1, 1), (1, 7, 2)])
def test_time_shared_is_1f1b_over_concatenated_stream(P, ns):
    offs = [sum(ns[:k]) for k in range(len(ns))]
    for stage in range(P):
        got = time_shared_schedule(P, stage, ctxs(*ns))
        flat = [(a.kind, offs[a.context] + a.microbatch) for a in got]
        ref = [(a.kind, a.microbatch) for a in one_f_one_b(P, stage, sum(ns))]
        assert flat == ref
        # every (context, local microbatch) exactly once per kind, local indices valid
        for kind in "FB":
            keys = sorted((a.context, a.microbatch) for a in got if a.kind == kind)
            assert keys == [(k, m) for k, n in enumerate(ns) for m in range(n)]


# ----------------------------------------------------------------------------- P2P protocol

def test_p2p_ops_per_action_and_stage():
    f, b = Action("F", 1, 2), Action("B", 1, 2)
    assert p2p_ops(1, 0, f) == ((), ()) and p2p_ops(1, 0, b) == ((), ())
    recv, send = p2p_ops(3, 1, f)
    assert [(o.op, o.peer, o.payload, o.context, o.microbatch) for o in recv + send] == [
        ("recv", "prev", "act", 1, 2), ("send", "next", "act", 1, 2)]
    recv, send = p2p_ops(3, 1, b)
    assert [(o.op, o.peer, o.payload) for o in recv + send] == [
        ("recv", "next", "grad"), ("send", "prev", "grad")]
    assert p2p_ops(3, 0, f)[0] == () and p2p_ops(3, 2, f)[1] == ()
    assert p2p_ops(3, 2, b)[0] == () and p2p_ops(3, 0, b)[1] == ()


def test_combined_step_at_context_boundary_carries_both_contexts():
    prog = executor_program(4, 0, ctxs(4, 4))
    i = prog.index(Action("F", 1, 0))
    step = prog[i + 1]
    assert isinstance(step, CommStep) and step.call == "send_forward_recv_backward"
    assert [(o.op, o.payload, o.context, o.microbatch) for o in step.ops] == [
        ("send", "act", 1, 0), ("recv", "grad", 0, 1)]
    assert step.recv_context == 0  # receive buffer must have model 1's shape
    last = executor_program(4, 3, ctxs(4, 4))
    assert all(o.peer == "prev" for s in last if isinstance(s, CommStep) for o in s.ops)


@pytest.mark.parametrize("P", [1, 2, 3, 5])
@pytest.mark.parametrize("ns,fo", [((3, 5), False), ((2, 1, 4), False), ((1,), False),
                                   ((3, 5), True), ((2, 1, 4), True)])
def test_simulate_no_deadlock_and_every_action_runs(P, ns, fo):
    cs = ctxs(*ns, forward_only=fo)
    fwd = [1 + k for k in range(len(ns))]
    for shared in (True, False):
        tl = simulate(P, cs, fwd, None if fo else [2] * len(ns), time_shared=shared)
        for s in range(P):
            ref = (time_shared_schedule if shared else sequential_schedule)(P, s, cs)
            assert tl.order(s) == ref
            assert all(e >= st for st, e, _ in tl.stages[s])
            ends = [e for _, e, _ in tl.stages[s]]
            assert ends == sorted(ends)


def test_simulate_per_stage_durations_by_hand():
    # P=2, N=2, forward is 3x slower on the last stage (e.g. the LM head)
    tl = simulate(2, ctxs(2), [[1, 3]], [[1, 1]])
    assert [(st, e, repr(a)) for st, e, a in tl.stages[1]] == [
        (1, 4, "F0.0"), (4, 5, "B0.0"), (5, 8, "F0.1"), (8, 9, "B0.1")]
    assert [(st, e, repr(a)) for st, e, a in tl.stages[0]] == [
        (0, 1, "F0.0"), (1, 2, "F0.1"), (5, 6, "B0.0"), (9, 10, "B0.1")]
    assert tl.makespan == 10


def _naive_program(P, stage, contexts, time_shared=True):
    """Blocking send right after each compute, separate recv before it: the classic
    1F1B deadlock that megatron's combined calls avoid."""
    prog = []
    for a in time_shared_schedule(P, stage, contexts):
        recv, send = p2p_ops(P, stage, a)
        prog += [CommStep("recv", recv), a, CommStep("send", send)]
    return prog


def test_simulator_detects_deadlock_and_mismatch(monkeypatch):
    monkeypatch.setattr(sch, "executor_program", _naive_program)
    with pytest.raises(DeadlockError):
        simulate(4, ctxs(4, 4), [1, 1], [1, 1])
    monkeypatch.undo()

    real = sch.executor_program

    def swapped(P, stage, contexts, time_shared=True):  # stage 1 disagrees on context order
        return real(P, stage, contexts[::-1] if stage == 1 else contexts, time_shared)

    monkeypatch.setattr(sch, "executor_program", swapped)
    with pytest.raises(RuntimeError, match="mismatch"):
        simulate(3, ctxs(2, 3), [1, 1], [1, 1])


# ----------------------------------------------------------------------------- Eq. (1)

@pytest.mark.parametrize("P,ns,f,b", [
    (4, 4, [1, 1], [1, 1]),            # Figure 5: equal models
    (4, 8, [1, 1], [2, 2]),            # equal models, B = 2F
    (8, 16, [2, 2, 2], [3, 3, 3]),     # three equal models
    (4, 8, [1, 3], [2, 6]),            # unequal models (same f:b ratio)
    (4, 8, [3, 1], [6, 2]),            # ... bigger model first
    (3, [3, 5], [1, 2], [2, 4]),       # unequal models and N_k
    (2, [5, 2, 4], [1, 2, 3], [1, 2, 3]),  # 3 contexts ordered small -> big
])
def test_simulated_makespans_equal_eq1(P, ns, f, b):
    K = len(f)
    nlist = [ns] * K if isinstance(ns, int) else ns
    seq_pred, shared_pred = eq1_makespans(P, ns, f, b)
    seq = simulate(P, ctxs(*nlist), f, b, time_shared=False).makespan
    shared = simulate(P, ctxs(*nlist), f, b).makespan
    assert seq == seq_pred
    assert shared == shared_pred == stream_makespan(P, ns, f, b)
    assert seq / shared == pytest.approx(theoretical_speedup(P, ns, f, b))


def test_eq1_closed_form_and_unequal_n_reduction():
    # paper's Eq. (1) written out
    P, NB, f, b = 4, 6, [1.0, 2.5], [2.0, 4.0]
    T = [x + y for x, y in zip(f, b)]
    paper = (NB + P - 1) * sum(T) / (NB * sum(T) + (P - 1) * max(T))
    assert theoretical_speedup(P, NB, f, b) == pytest.approx(paper)
    assert theoretical_speedup(P, [NB, NB], f, b) == pytest.approx(paper)
    # equal models: idle time halves, 2(P-1)T -> (P-1)T (paper §4.2)
    seq, sh = eq1_makespans(4, 4, [1, 1], [1, 1])
    assert (seq - 8 * 2, sh - 8 * 2) == (2 * 3 * 2, 3 * 2)
    assert eq1_makespans(4, [3, 5], [1, 1], [1, 1]) == ((3 + 3) * 2 + (5 + 3) * 2, 8 * 2 + 3 * 2)
    assert theoretical_speedup(1, 5, [1, 2], [1, 2]) == 1.0  # no pipeline, no bubbles


def test_eq1_is_optimistic_for_big_small_big_order():
    P, ns, f, b = 4, [8, 5, 6], [2, 1, 2], [6, 3, 6]
    shared = simulate(P, ctxs(*ns), f, b).makespan
    assert shared == stream_makespan(P, ns, f, b) == 168
    assert shared > eq1_makespans(P, ns, f, b)[1] == 156
    # reordering to a single peak (small, big, big) restores Eq. (1)
    ns2, f2, b2 = [5, 8, 6], [1, 2, 2], [3, 6, 6]
    assert simulate(P, ctxs(*ns2), f2, b2).makespan == eq1_makespans(P, ns2, f2, b2)[1]


def test_stream_makespan_exact_for_large_n_upper_bound_otherwise():
    for P, f, b in itertools.product((2, 3, 4), ([1, 3], [3, 1], [2, 2, 1]), ([4, 1], [1, 5])):
        b = (b * 2)[: len(f)]
        for ns in itertools.product((1, P - 1, P, P + 2), repeat=len(f)):
            sim = simulate(P, ctxs(*ns), f, b).makespan
            pred = stream_makespan(P, list(ns), f, b)
            seq = simulate(P, ctxs(*ns), f, b, time_shared=False).makespan
            assert seq == eq1_makespans(P, list(ns), f, b)[0]  # sequential: always exact
            assert sim <= pred
            if min(ns) >= P:
                assert sim == pred, (P, ns, f, b)


# ----------------------------------------------------------------------------- memory

@pytest.mark.parametrize("P,ns", [(4, (4, 4)), (4, (8, 5)), (3, (3, 5)), (5, (6, 5, 7))])
def test_peak_in_flight_not_above_sequential(P, ns):
    for s in range(P):
        shared = peak_in_flight(time_shared_schedule(P, s, ctxs(*ns)))
        seq = peak_in_flight(sequential_schedule(P, s, ctxs(*ns)))
        assert shared <= seq
        assert shared == P - s  # one 1F1B stream: exactly what one model holds


def test_peak_in_flight_small_n_and_weights():
    # every N_k < P - s: the stream may hold more microbatches than either model alone,
    # but never more than P - s
    assert peak_in_flight(time_shared_schedule(4, 0, ctxs(1, 1))) == 2
    assert peak_in_flight(sequential_schedule(4, 0, ctxs(1, 1))) == 1
    for s in range(4):
        assert peak_in_flight(time_shared_schedule(4, s, ctxs(1, 2, 1))) <= 4 - s
    # weighted (bytes per microbatch): bounded by (P - s) * max weight, = sequential peak
    w = {0: 3.0, 1: 1.0}
    for s in range(4):
        sh = peak_in_flight(time_shared_schedule(4, s, ctxs(4, 4)), w)
        sq = peak_in_flight(sequential_schedule(4, s, ctxs(4, 4)), w)
        assert sh <= sq == (4 - s) * 3.0
    w2 = {0: 1.0, 1: 3.0}  # heavier model second: its own steady state sets the peak
    assert peak_in_flight(time_shared_schedule(4, 0, ctxs(4, 4)), w2) == 12.0
    assert peak_in_flight(time_shared_schedule(4, 0, ctxs(4, 4))[:6], w2) == 6.0  # 3x m0 + 1x m1


def test_peak_in_flight_forward_only_and_bad_lists():
    assert peak_in_flight(time_shared_schedule(4, 0, ctxs(3, 5, forward_only=True))) == 1
    assert peak_in_flight([]) == 0
    with pytest.raises(ValueError):
        peak_in_flight([Action("B", 0, 0)])
    with pytest.raises(ValueError):
        peak_in_flight([Action("F", 0, 0), Action("F", 0, 0), Action("B", 0, 0)])


# ----------------------------------------------------------------------------- forward-only

def test_forward_only_stream():
    cs = ctxs(3, 2, forward_only=True)
    for s in range(3):
        assert order(time_shared_schedule(3, s, cs)) == "F0.0 F0.1 F0.2 F1.0 F1.1".split()
    calls = [x.call if isinstance(x, CommStep) else "F" for x in executor_program(3, 1, cs)]
    assert calls == ["recv_forward", "F", "send_forward"] * 5
    tl = simulate(3, cs, [1, 2])
    assert tl.makespan == (1 * 3 + 2 * 2) + 2 * 2  # work + drain of the last (slowest) one


# ----------------------------------------------------------------------------- errors

def test_value_errors():
    with pytest.raises(ValueError, match="P"):
        one_f_one_b(0, 0, 4)
    with pytest.raises(ValueError, match="stage"):
        one_f_one_b(4, 4, 4)
    with pytest.raises(ValueError, match="num_microbatches"):
        one_f_one_b(4, 0, 0)
    with pytest.raises(ValueError, match="num_microbatches"):
        ContextSpec("actor", 0)
    with pytest.raises(ValueError, match="forward-only"):
        time_shared_schedule(4, 0, [ContextSpec("actor", 4), ContextSpec("ref", 4, True)])
    with pytest.raises(ValueError, match="forward-only"):
        simulate(2, [ContextSpec("actor", 4), ContextSpec("ref", 4, True)], [1, 1], [1, 1])
    with pytest.raises(ValueError):
        time_shared_schedule(4, 0, [])
    with pytest.raises(ValueError, match="P"):
        theoretical_speedup(0, 4, [1], [1])
    with pytest.raises(ValueError, match="num_microbatches"):
        theoretical_speedup(4, [4, 0], [1, 1], [1, 1])
    with pytest.raises(ValueError):
        simulate(2, ctxs(2, 2), [1], [1, 1])  # one duration per context


def test_stream_needs_equal_p_and_one_plan_where_experts_split():
    """Equal P on the same ranks with another (D, T) is one stream (the trainer gives its pipelines one
    program); unequal P, and experts split at another plan, are refused before any P2P
    (time_sharing_executor.validate_stream)."""
    from puzzle.parallel.plan import ParallelPlan
    from puzzle.pipeline.time_sharing_executor import validate_stream

    def ctx(role, plan):
        eng = types.SimpleNamespace(role=role, layout=types.SimpleNamespace(plan=plan))
        return types.SimpleNamespace(engine=eng, num_microbatches=2)

    validate_stream([ctx("actor", ParallelPlan(2, 1, 2)), ctx("critic", ParallelPlan(2, 1, 2))])
    validate_stream([ctx("actor", ParallelPlan(2, 1, 2)), ctx("critic", ParallelPlan(2, 2, 1))])
    with pytest.raises(ValueError, match=r"equal P.*actor: \(P=2, D=2, T=1\), critic: \(P=4, D=1, T=1\)"):
        validate_stream([ctx("actor", ParallelPlan(2, 2, 1)), ctx("critic", ParallelPlan(4, 1, 1))])
    with pytest.raises(ValueError, match=r"experts split .* same plan \(P, D, T, E, ETP\).*"
                                         r"ref: \(P=1, D=4, T=1, E=2\)"):
        validate_stream([ctx("actor", ParallelPlan(1, 4, 1, E=4)), ctx("ref", ParallelPlan(1, 4, 1, E=2))])
    validate_stream([ctx("actor", ParallelPlan(2, 2, 1, E=2)), ctx("ref", ParallelPlan(2, 2, 1, E=2))])


def _coupled_pipelines_stuck(P, counts, tp, time_shared):
    """Run the executor programs of several pipelines (one per index j of a stage's ranks) with
    blocking P2P inside each pipeline and, per context k, a collective joining the pipelines
    j // tp[k] alike (that model's tensor-parallel group) at each of its actions. ``counts[j][k]``:
    micro-batches of context k on pipeline j; ``time_shared[j]``: its program. Returns the blocked
    steps (empty: every program ran to its end)."""
    J = len(counts)
    progs = {(j, s): executor_program(P, s, [ContextSpec(str(k), n) for k, n in enumerate(counts[j])],
                                      time_shared[j]) for j in range(J) for s in range(P)}
    pc, posted, board, seqs = dict.fromkeys(progs, 0), dict.fromkeys(progs), {}, {}
    progress = True
    while progress:
        progress = False
        for (j, s), prog in progs.items():
            while pc[j, s] < len(prog):
                step = prog[pc[j, s]]
                if isinstance(step, Action):
                    group = [i for i in range(J) if i // tp[step.context] == j // tp[step.context]]
                    if any(pc[i, s] >= len(progs[i, s]) or progs[i, s][pc[i, s]] != step for i in group):
                        break  # the collective waits for every member to reach the same action
                    for i in group:
                        pc[i, s] += 1
                elif posted[j, s] is None:  # post the call's sends/recvs (FIFO per link and side)
                    posted[j, s] = []
                    for o in step.ops:
                        key = (j, o.payload, s if o.peer == "next" else s - 1, o.op)
                        seqs[key] = seqs.get(key, -1) + 1
                        board[key + (seqs[key],)] = True
                        posted[j, s].append(key[:3] + ("recv" if o.op == "send" else "send", seqs[key]))
                    continue
                elif all(k in board for k in posted[j, s]):
                    posted[j, s] = None
                    pc[j, s] += 1
                else:
                    break
                progress = True
    return {key: progs[key][pc[key]] for key in progs if pc[key] < len(progs[key])}


def test_coupled_pipelines_need_the_same_program():
    """Why a stream of models at equal P but another (D, T) must run one program on every rank
    (puzzle.parallel.streams.needs_one_program): a model's TP collectives span pipelines; they
    deadlock as soon as those pipelines' programs differ, and run when the programs are the same."""
    # P=3, two pipelines: T=2 model, a T=1 model with 7 and 1 micro-batches on its DP ranks, T=2 model
    assert _coupled_pipelines_stuck(3, [[2, 7, 5], [2, 1, 5]], [2, 1, 2], [True, True])
    assert not _coupled_pipelines_stuck(3, [[2, 7, 5], [2, 7, 5]], [2, 1, 2], [True, True])
    # two T=2 models, equal counts, one pipeline on the sequential program (another memory-guard choice)
    assert _coupled_pipelines_stuck(2, [[5, 3], [5, 3]], [2, 2], [False, True])
    assert not _coupled_pipelines_stuck(2, [[5, 3], [5, 3]], [2, 2], [True, True])
    # without coupling (every model T=1, i.e. one plan per pipeline group) differing programs are fine
    assert not _coupled_pipelines_stuck(3, [[2, 7, 5], [2, 1, 5]], [1, 1, 1], [True, True])


def _mixed_stream_counts(placement):
    """Per rank of 6: the token-budget micro-batch counts MicroBatching gives an actor at (3,1,2), a
    critic at (3,2,1) and a reference at (3,1,2) for rows of unequal lengths (the critic's two DP
    shares, balanced by tokens, need 2 and 1 micro-batches of at most 23 tokens)."""
    import torch

    from puzzle.parallel.plan import ParallelPlan
    from puzzle.dataflow.batch import RolloutBatch
    from puzzle.dataflow.micro_batching import MicroBatching

    lengths = torch.tensor([10, 19, 6, 11])
    batch = RolloutBatch(torch.ones(4, 19, dtype=torch.long), torch.full((4,), 2), lengths - 2, 17)
    plans = {"actor": ParallelPlan(3, 1, 2), "critic": ParallelPlan(3, 2, 1), "ref": ParallelPlan(3, 1, 2)}
    counts = []
    for rank in range(6):
        engines = {role: types.SimpleNamespace(
            layout=types.SimpleNamespace(plan=plan, d=plan.coords(rank)[1], member=True), member=True,
            arch=types.SimpleNamespace(is_moe=False), config=types.SimpleNamespace()) for role, plan in plans.items()}
        micro = MicroBatching(engines, 1, packed=True, seq_multiple=1, pad_id=0, dynamic_bsz=True)
        contexts = micro.contexts(batch, [(role, None) for role in plans], 23, placement)
        counts.append([c.num_microbatches for c in contexts])
    return counts


def test_mixed_stream_runs_one_program_on_every_rank():
    """A time-shared stream of an actor at (3,1,2), a critic at (3,2,1) and a reference at (3,1,2) on
    6 ranks with unequal token loads: every rank of a pipeline stage runs the same program (the
    critic's DP ranks get as many token-budget micro-batches, token_budget.split_to_count), which the
    coupled-pipeline simulation runs to its end; run model by model ('sequential') the counts differ
    per DP rank, and those counts in one stream deadlock."""
    sequential, shared = _mixed_stream_counts("sequential"), _mixed_stream_counts("time-sharing")
    assert sequential[0::2] == [[3, 2, 3]] * 3 and sequential[1::2] == [[3, 1, 3]] * 3  # critic's DP ranks 0, 1
    assert shared == [[3, 2, 3]] * 6
    P = 3
    for s in range(P):  # rank = p * 2 + j: the two ranks of stage s hold the pipelines j = 0, 1
        programs = [executor_program(P, s, [ContextSpec(str(k), n) for k, n in enumerate(shared[s * 2 + j])])
                    for j in range(2)]
        assert programs[0] == programs[1]
    # the actor and the reference (T=2) tie pipelines 0 and 1 together; the critic (T=1) does not
    assert not _coupled_pipelines_stuck(P, shared[:2], [2, 1, 2], [True, True])
    assert _coupled_pipelines_stuck(P, sequential[:2], [2, 1, 2], [True, True])
