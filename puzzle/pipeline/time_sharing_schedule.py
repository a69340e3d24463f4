"""Pure pipeline schedule tables for PUZZLE intra-stage time-sharing (ATC'24 §4.2).

Nothing here imports torch or torch.distributed: these are the tables an executor
walks with megatron-core's ``forward_step`` / ``backward_step`` / ``P2PCommunicator``.

1F1B (megatron ``forward_backward_pipelining_without_interleaving``)
    On stage ``s`` of ``P`` with ``N`` microbatches: ``w = min(P-s-1, N)`` warm-up
    forwards, then ``N-w`` steady pairs ``F(w+i), B(i)``, then ``w`` cool-down
    backwards.  ``forward_only``: ``N`` forwards.

Time-sharing = ONE 1F1B stream over the concatenated microbatches
    Contexts (models) that share the same devices and have no data dependence are
    run as one stream of ``N = sum_k N_k`` microbatches; global microbatch ``j`` maps
    to ``(k, j - sum_{k'<k} N_k')`` and each stage runs plain 1F1B over the stream.
    Hence context ``k+1``'s warm-up forwards occupy the slots of context ``k``'s
    cool-down: on stage ``s`` the ``w`` backwards that would be context ``k``'s
    cool-down are interleaved with context ``k+1``'s first ``w`` forwards.

    Check against Figure 5(b) (P=4, two models x 4 microbatches, F=B=1; "Fk.m" is
    context k (0-based: Model1 = 0) microbatch m):
      stage 0 (Device 1): F0.0 F0.1 F0.2 F0.3 B0.0 F1.0 B0.1 F1.1 B0.2 F1.2 B0.3 F1.3 B1.0 ...
        F1.0 comes right after B0.0 and occupies slot 9 (1-indexed) instead of
        slot 15 = (N+P-1)(F+B)+1 when run sequentially -- exactly the paper's text.
        (It is on Device 1 / stage 0 that "Model2's first forward follows Model1's
        first backward"; on the last stage warm-up is 0, so there the order is simply
        F0.0 B0.0 ... F0.3 B0.3 F1.0 B1.0 ... with no gap between models.)
      Total = 8 microbatches of one model: (8+P-1)(F+B) = 22 vs 2*(4+P-1)(F+B) = 28.

Memory
    The stream is 1F1B, so stage ``s`` holds at most ``min(P-s, sum_k N_k)`` forwards
    without their backward -- what one model with >= ``P-s`` microbatches holds.
    If every ``N_k < P-s`` the count can exceed the sequential peak
    ``max_k min(P-s, N_k)`` (e.g. P=4, N=(1,1): 2 vs 1), never exceeding ``P-s``.
    With per-context activation sizes ``a_k`` the weighted peak is
    ``<= (P-s) * max_k a_k``; see :func:`peak_in_flight` (``weights=``).

Executor protocol / P2P (see :func:`executor_program`)
    The program of one stage is megatron's non-interleaved code with the global
    stream index in place of the microbatch index; every ``CommStep.call`` is the
    ``P2PCommunicator`` method megatron calls at that point:

      warm-up i<w:     recv_forward(i); F(i); send_forward(i)
      if N>w:          recv_forward(w)
      steady i<N-w:    F(w+i); send_forward_recv_backward(act w+i, grad i); B(i);
                       send_backward_recv_forward(grad i, act w+i+1)  [last: send_backward(i)]
      cool-down:       recv_backward(i); B(i); send_backward(i)
      forward_only:    recv_forward(i); F(i); send_forward(i)   for every i

    A combined call may send a tensor of one context and receive one of another
    context (at a context boundary).  megatron's ``tensor_shapes`` argument only
    shapes the RECEIVE buffer (the sent tensor carries its own shape), so pass the
    shape of ``CommStep.recv_context`` -- and, if contexts differ in
    ``pipeline_dtype``, call the method on that context's ``P2PCommunicator``.
    On the first/last stage megatron's ``is_first_stage``/``is_last_stage`` flags
    turn the missing half into a no-op; ``CommStep.ops`` already omits it.
    Call ``forward_step`` with the context's own model/iterator and
    ``num_microbatches=N_k`` (loss scaling is per context), ``is_first_microbatch``
    = ``Action.microbatch == 0``, and enable that context's grad sync before its
    last backward (``microbatch == N_k - 1``).  Backwards run in the same global
    order as forwards, so megatron's single FIFO of (input, output) tensors works
    unchanged across contexts.

Deadlock freedom
    Both neighbours derive their programs from the same concatenated order, so the
    sequence of sends on every link equals the sequence of receives on it, item by
    item, and the call structure is megatron's (known deadlock-free for any N).
    :func:`simulate` checks this mechanically: each combined call posts all its
    sends/recvs at once (``batch_isend_irecv`` semantics) and blocks until every one
    is matched by the neighbour's next op on the same FIFO link (rendezvous, no
    buffering); a matched pair must carry the same (kind, context, microbatch).

Eq. (1), unequal N_k, heterogeneous models (:func:`eq1_makespans`, :func:`stream_makespan`)
    Uniform stage times, ``T_k = T_k^f + T_k^b``, zero-cost P2P:
      sequential  = sum_k (N_k + P - 1) T_k                  (exact, always)
      Eq.(1)-shared = sum_k N_k T_k + (P - 1) max_k T_k
    With all ``N_k = N_B`` the ratio is ``(N_B+P-1) sum T_k / (N_B sum T_k + (P-1) max T_k)``,
    i.e. Eq. (1).  The simulated stream (ground truth for this schedule) is, in
    stream order k = 1..K and with ``U(x) = x_1 + sum_k max(0, x_k - x_{k-1})``
    (the "upward variation" of a sequence),
      shared = sum_k N_k T_k + (P - 1) (U(T^f) + U(T^b))   exact when every N_k >= P,
                                                          an upper bound otherwise
    (found and checked by simulation on thousands of random configurations and in
    the tests; not proven).
    ``U(T^f) + U(T^b) = max_k T_k`` -- so Eq. (1) is exact -- when the models are
    equal, or for two models whose f:b ratios agree, or generally when both T^f and
    T^b rise to a common peak context and then fall (order contexts that way!).
    Otherwise (e.g. big-small-big, or different f:b ratios) Eq. (1) is optimistic.
    With zero-cost P2P, blocking (rendezvous) sends cost nothing here: on random
    configurations the makespan equalled that of buffered (eager) sends.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence, Union

__all__ = [
    "ContextSpec", "Action", "P2POp", "CommStep", "Timeline", "DeadlockError",
    "one_f_one_b", "time_shared_schedule", "sequential_schedule", "p2p_ops",
    "executor_program", "simulate", "eq1_makespans", "theoretical_speedup",
    "stream_makespan", "peak_in_flight", "unequal_makespans",
]

Number = Union[int, float]


@dataclass(frozen=True)
class ContextSpec:
    """One context (model + workload) of a time-shared stage."""

    name: str
    num_microbatches: int
    forward_only: bool = False

    def __post_init__(self):
        n = self.num_microbatches
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"context {self.name!r}: num_microbatches must be an int >= 1, got {n!r}")


@dataclass(frozen=True)
class Action:
    """A compute step: ``kind`` 'F' or 'B' of ``(context, microbatch)`` (local index)."""

    kind: str
    context: int
    microbatch: int

    def __repr__(self) -> str:
        return f"{self.kind}{self.context}.{self.microbatch}"


@dataclass(frozen=True)
class P2POp:
    """One point-to-point transfer: ``op`` 'send'/'recv', ``peer`` 'prev'/'next',
    ``payload`` 'act' (forward activation) or 'grad' (activation gradient) of
    ``(context, microbatch)``; the context fixes the tensor shape."""

    op: str
    peer: str
    payload: str
    context: int
    microbatch: int


@dataclass(frozen=True)
class CommStep:
    """A megatron ``P2PCommunicator`` call (``call`` is the method name) with the
    transfers it performs on this stage (empty on first/last-stage no-op halves)."""

    call: str
    ops: tuple

    @property
    def recv_context(self):
        """Context whose shape the receive buffer must have (None: nothing received)."""
        for o in self.ops:
            if o.op == "recv":
                return o.context
        return None


class DeadlockError(RuntimeError):
    """Raised by :func:`simulate` when no stage can make progress."""


@dataclass
class Timeline:
    """Result of :func:`simulate`: per stage a list of ``(start, end, Action)``."""

    stages: list
    makespan: float

    def order(self, stage: int) -> list:
        return [a for _, _, a in self.stages[stage]]


# --------------------------------------------------------------------------- tables

def _check_stage(P: int, stage: int) -> None:
    if isinstance(P, bool) or not isinstance(P, int) or P < 1:
        raise ValueError(f"pipeline size P must be an int >= 1, got {P!r}")
    if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < P:
        raise ValueError(f"stage must be an int in [0, {P}), got {stage!r}")


def _check_contexts(contexts: Sequence[ContextSpec]) -> bool:
    """Validate a time-shared group; return its common forward_only flag."""
    if not contexts:
        raise ValueError("need at least one context")
    for c in contexts:
        if not isinstance(c, ContextSpec):
            raise TypeError(f"expected ContextSpec, got {type(c).__name__}")
    flags = {c.forward_only for c in contexts}
    if len(flags) != 1:
        names = {c.name: c.forward_only for c in contexts}
        raise ValueError(
            "cannot time-share training and forward-only contexts in one stream "
            f"(a stage is either all-training or all-scoring): forward_only={names}")
    return flags.pop()


def _stream(P: int, stage: int, items: list, forward_only: bool) -> list:
    """1F1B order over ``items`` = list of (context, microbatch)."""
    n = len(items)
    F = [Action("F", k, m) for k, m in items]
    if forward_only:
        return F
    B = [Action("B", k, m) for k, m in items]
    w = min(P - stage - 1, n)
    out = F[:w]
    for i in range(n - w):
        out += [F[w + i], B[i]]
    return out + B[n - w:]


def _items(contexts: Sequence[ContextSpec]) -> list:
    return [(k, m) for k, c in enumerate(contexts) for m in range(c.num_microbatches)]


def one_f_one_b(P: int, stage: int, num_microbatches: int, forward_only: bool = False) -> list:
    """Megatron non-interleaved 1F1B compute order of one stage (context index 0)."""
    _check_stage(P, stage)
    spec = ContextSpec("model", num_microbatches, forward_only)
    return _stream(P, stage, _items([spec]), forward_only)


def time_shared_schedule(P: int, stage: int, contexts: Sequence[ContextSpec]) -> list:
    """Time-shared order of one stage: 1F1B over the concatenated microbatches."""
    _check_stage(P, stage)
    fo = _check_contexts(contexts)
    return _stream(P, stage, _items(contexts), fo)


def sequential_schedule(P: int, stage: int, contexts: Sequence[ContextSpec]) -> list:
    """Baseline (Figure 5(a)): each context's own 1F1B, one after another."""
    _check_stage(P, stage)
    _check_contexts(contexts)
    out = []
    for k, c in enumerate(contexts):
        out += _stream(P, stage, [(k, m) for m in range(c.num_microbatches)], c.forward_only)
    return out


def p2p_ops(P: int, stage: int, action: Action) -> tuple:
    """(receives before, sends after) the compute ``action`` needs on ``stage``."""
    _check_stage(P, stage)
    first, last = stage == 0, stage == P - 1
    k, m = action.context, action.microbatch
    if action.kind == "F":
        recv = () if first else (P2POp("recv", "prev", "act", k, m),)
        send = () if last else (P2POp("send", "next", "act", k, m),)
    elif action.kind == "B":
        recv = () if last else (P2POp("recv", "next", "grad", k, m),)
        send = () if first else (P2POp("send", "prev", "grad", k, m),)
    else:
        raise ValueError(f"unknown action kind {action.kind!r}")
    return recv, send


def _program(P: int, stage: int, actions: list, forward_only: bool) -> list:
    """Interleave one 1F1B stream's compute actions with megatron's P2P calls."""
    def comm(call, *ops):
        return CommStep(call, tuple(o for o in ops if o is not None))

    def rf(a):  # recv forward input
        return p2p_ops(P, stage, a)[0][0] if stage > 0 else None

    def sf(a):  # send forward output
        return p2p_ops(P, stage, a)[1][0] if stage < P - 1 else None

    def rb(a):  # recv output grad
        return p2p_ops(P, stage, a)[0][0] if stage < P - 1 else None

    def sb(a):  # send input grad
        return p2p_ops(P, stage, a)[1][0] if stage > 0 else None

    F = [a for a in actions if a.kind == "F"]
    B = [a for a in actions if a.kind == "B"]
    n = len(F)
    prog = []
    if forward_only:
        for a in F:
            prog += [comm("recv_forward", rf(a)), a, comm("send_forward", sf(a))]
        return prog
    w = min(P - stage - 1, n)
    for a in F[:w]:
        prog += [comm("recv_forward", rf(a)), a, comm("send_forward", sf(a))]
    if n > w:
        prog.append(comm("recv_forward", rf(F[w])))
    for i in range(n - w):
        prog += [F[w + i], comm("send_forward_recv_backward", sf(F[w + i]), rb(B[i])), B[i]]
        if i == n - w - 1:
            prog.append(comm("send_backward", sb(B[i])))
        else:
            prog.append(comm("send_backward_recv_forward", sb(B[i]), rf(F[w + i + 1])))
    for b in B[n - w:]:
        prog += [comm("recv_backward", rb(b)), b, comm("send_backward", sb(b))]
    return prog


def executor_program(P: int, stage: int, contexts: Sequence[ContextSpec],
                     time_shared: bool = True) -> list:
    """The stage's full program: ``Action`` (run forward_step/backward_step) and
    ``CommStep`` (call ``P2PCommunicator.<call>``) items in execution order.
    ``time_shared=False`` gives the sequential baseline (one megatron call per context)."""
    _check_stage(P, stage)
    fo = _check_contexts(contexts)
    if time_shared:
        return _program(P, stage, time_shared_schedule(P, stage, contexts), fo)
    prog = []
    for k, c in enumerate(contexts):
        acts = _stream(P, stage, [(k, m) for m in range(c.num_microbatches)], fo)
        prog += _program(P, stage, acts, fo)
    return prog


# --------------------------------------------------------------------------- simulator

def _per_stage(times, P: int, n_ctx: int, what: str) -> list:
    """Normalise per-context durations (scalar or length-P list) to [ctx][stage]."""
    if len(times) != n_ctx:
        raise ValueError(f"{what}: need one entry per context ({n_ctx}), got {len(times)}")
    out = []
    for t in times:
        row = [t] * P if isinstance(t, (int, float)) else list(t)
        if len(row) != P or any(x < 0 for x in row):
            raise ValueError(f"{what}: each entry must be a number or {P} non-negative numbers")
        out.append(row)
    return out


def _microbatch_scale(scale, contexts: Sequence[ContextSpec]) -> list:
    if scale is None:
        return [[1.0] * c.num_microbatches for c in contexts]
    if len(scale) != len(contexts) or any(len(x) != c.num_microbatches for x, c in zip(scale, contexts)):
        raise ValueError("microbatch_scale: need one list of num_microbatches numbers per context")
    if any(v < 0 for x in scale for v in x):
        raise ValueError("microbatch_scale: costs must be non-negative")
    return [list(x) for x in scale]


def simulate(P: int, contexts: Sequence[ContextSpec], fwd_times, bwd_times=None,
             time_shared: bool = True, microbatch_scale=None) -> Timeline:
    """Run every stage's :func:`executor_program` with blocking P2P semantics.

    ``fwd_times[k]`` / ``bwd_times[k]``: duration of a forward / backward of context
    ``k`` (a number, or one number per stage).  Communication takes zero time but a
    combined call completes only when each of its sends/recvs is matched (in FIFO
    order per link and direction) by the neighbour's posted op.  Raises
    :class:`DeadlockError` if the stages get stuck and ``RuntimeError`` if a matched
    send/recv pair disagrees on (payload, context, microbatch).
    ``microbatch_scale[k][m]`` (optional): micro-batch ``m`` of context ``k`` costs that multiple
    of the context's durations (token-budget micro-batches of unequal tokens).
    """
    _check_stage(P, 0)
    fo = _check_contexts(contexts)
    fwd = _per_stage(fwd_times, P, len(contexts), "fwd_times")
    bwd = (_per_stage(bwd_times, P, len(contexts), "bwd_times") if bwd_times is not None
           else [[0.0] * P for _ in contexts])
    if not fo and bwd_times is None:
        raise ValueError("bwd_times is required for training contexts")
    scale = _microbatch_scale(microbatch_scale, contexts)
    progs = [executor_program(P, s, contexts, time_shared) for s in range(P)]
    pc, clock = [0] * P, [0.0] * P
    posted = [None] * P  # per stage: list of (link key, seq) of the current comm call
    counts: dict = {}    # (link, side) -> number of ops posted so far
    board: dict = {}     # (link, side, seq) -> (post time, (payload, ctx, mb))
    timeline = [[] for _ in range(P)]

    def link(s, o):  # FIFO channel: ('act', i) is i -> i+1, ('grad', i) is i+1 -> i
        lo = s if o.peer == "next" else s - 1
        return (o.payload, lo)

    progress = True
    while progress:
        progress = False
        for s in range(P):
            while pc[s] < len(progs[s]):
                step = progs[s][pc[s]]
                if isinstance(step, Action):
                    t = (fwd if step.kind == "F" else bwd)[step.context][s] * scale[step.context][step.microbatch]
                    timeline[s].append((clock[s], clock[s] + t, step))
                    clock[s] += t
                    pc[s] += 1
                    progress = True
                    continue
                if posted[s] is None:  # post every op of the combined call at once
                    posted[s] = []
                    for o in step.ops:
                        key = (link(s, o), o.op)
                        seq = counts.get(key, 0)
                        counts[key] = seq + 1
                        board[key + (seq,)] = (clock[s], (o.payload, o.context, o.microbatch))
                        posted[s].append((link(s, o), o.op, seq))
                    progress = True
                done = clock[s]
                for lk, side, seq in posted[s]:
                    other = board.get((lk, "recv" if side == "send" else "send", seq))
                    if other is None:
                        break
                    mine = board[(lk, side, seq)][1]
                    if other[1] != mine:
                        raise RuntimeError(f"stage {s}: P2P mismatch on link {lk} #{seq}: "
                                           f"{side} {mine} vs peer {other[1]}")
                    done = max(done, other[0])
                else:
                    clock[s] = done
                    posted[s] = None
                    pc[s] += 1
                    progress = True
                    continue
                break
    stuck = {s: progs[s][pc[s]] for s in range(P) if pc[s] < len(progs[s])}
    if stuck:
        raise DeadlockError(f"pipeline deadlock; blocked calls per stage: {stuck}")
    return Timeline(timeline, max((e for st in timeline for _, e, _ in st), default=0.0))


# --------------------------------------------------------------------------- analytics

def _analytic_args(P, num_microbatches, fwd_times, bwd_times) -> list:
    _check_stage(P, 0)
    K = len(fwd_times)
    if K < 1 or len(bwd_times) != K:
        raise ValueError("fwd_times and bwd_times must be non-empty and equally long")
    ns = [num_microbatches] * K if isinstance(num_microbatches, int) else list(num_microbatches)
    if len(ns) != K or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in ns):
        raise ValueError(f"num_microbatches must be an int >= 1 or {K} of them, got {num_microbatches!r}")
    if any(t < 0 for t in list(fwd_times) + list(bwd_times)) or sum(fwd_times) + sum(bwd_times) <= 0:
        raise ValueError("durations must be non-negative and not all zero")
    return ns


def eq1_makespans(P: int, num_microbatches, fwd_times: Sequence[Number],
                  bwd_times: Sequence[Number]) -> tuple:
    """(sequential, time-shared) makespans of the Eq. (1) model.

    ``num_microbatches``: one int for all contexts (the paper's N_B) or one per context.
    sequential = sum_k (N_k+P-1) T_k; time-shared = sum_k N_k T_k + (P-1) max_k T_k.
    """
    ns = _analytic_args(P, num_microbatches, fwd_times, bwd_times)
    T = [f + b for f, b in zip(fwd_times, bwd_times)]
    seq = sum((n + P - 1) * t for n, t in zip(ns, T))
    shared = sum(n * t for n, t in zip(ns, T)) + (P - 1) * max(T)
    return seq, shared


def stream_makespan(P: int, num_microbatches, fwd_times: Sequence[Number],
                    bwd_times: Sequence[Number]) -> float:
    """Makespan of the time-shared stream in context order (uniform stage times):
    ``sum_k N_k T_k + (P-1)(U(T^f) + U(T^b))``; exact if all N_k >= P, else an upper bound."""
    ns = _analytic_args(P, num_microbatches, fwd_times, bwd_times)

    def up(x):
        return x[0] + sum(max(0, b - a) for a, b in zip(x, x[1:]))

    work = sum(n * (f + b) for n, f, b in zip(ns, fwd_times, bwd_times))
    return work + (P - 1) * (up(list(fwd_times)) + up(list(bwd_times)))


def theoretical_speedup(P: int, num_microbatches, fwd_times: Sequence[Number],
                        bwd_times: Sequence[Number]) -> float:
    """Eq. (1): sequential / time-shared makespan (generalised to per-context N_k)."""
    seq, shared = eq1_makespans(P, num_microbatches, fwd_times, bwd_times)
    return seq / shared


def unequal_makespans(P: int, microbatch_costs: Sequence[Sequence[Number]], fwd_times: Sequence[Number],
                      bwd_times: Sequence[Number] | None = None) -> tuple:
    """(sequential, time-shared) makespans of contexts whose micro-batches differ in cost
    (token-budget or packed micro-batches): micro-batch ``m`` of context ``k`` takes
    ``microbatch_costs[k][m]`` times ``fwd_times[k]`` forward and ``bwd_times[k]`` backward on
    every stage (e.g. its tokens over a reference micro-batch's; no ``bwd_times``: forward only).
    Eq. (1) has no closed form here -- with blocking P2P even forward-only pipelines deviate from
    the flow shop's ``sum + (P-1) max`` by up to ~30 % on random costs -- so both programs are
    simulated (:func:`simulate`); with all costs 1 this is Eq. (1)'s setting."""
    fo = bwd_times is None
    contexts = [ContextSpec(str(k), len(c), fo) for k, c in enumerate(microbatch_costs)]
    if any(not c for c in microbatch_costs):
        raise ValueError("microbatch_costs: every context needs at least one micro-batch")
    return tuple(simulate(P, contexts, fwd_times, bwd_times, shared, microbatch_scale=microbatch_costs).makespan
                 for shared in (False, True))


def peak_in_flight(actions: Sequence[Action], weights: Mapping[int, Number] | None = None):
    """Max (weighted) number of forwards whose backward has not run yet.

    ``weights[context]`` = activation size of one microbatch (default 1).  Forwards of
    contexts that have no backward in ``actions`` (forward-only) hold activations only
    while running, so they count during their own step but are not retained.
    """
    trained = {a.context for a in actions if a.kind == "B"}
    live, peak, open_ = 0, 0, set()
    for a in actions:
        w = 1 if weights is None else weights[a.context]
        key = (a.context, a.microbatch)
        if a.kind == "F":
            if key in open_:
                raise ValueError(f"forward {a!r} run twice without backward")
            if a.context in trained:
                open_.add(key)
                live += w
                peak = max(peak, live)
            else:
                peak = max(peak, live + w)
        elif a.kind == "B":
            if key not in open_:
                raise ValueError(f"backward {a!r} without a pending forward")
            open_.remove(key)
            live -= w
        else:
            raise ValueError(f"unknown action kind {a.kind!r}")
    return peak
