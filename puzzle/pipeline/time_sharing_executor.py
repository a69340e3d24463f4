"""Executor of PUZZLE intra-stage time-sharing (ATC'24 §4.2) on megatron-core.

``run_time_shared(contexts, forward_only)`` runs the models (``StageContext``) of one stage that
share the same devices and pipeline degree as ONE 1F1B stream over their concatenated
microbatches: the program of this rank's stage is
:func:`puzzle.pipeline.time_sharing_schedule.executor_program` and every step of it is executed with megatron's own pieces:

* ``Action`` F/B  -> ``megatron.core.pipeline_parallel.schedules.forward_step`` / ``backward_step``
  with the context's own model, config, forward_step_func, data iterator and
  ``num_microbatches=N_k`` (so loss scaling and per-token accounting are per context);
* ``CommStep``    -> the named ``P2PCommunicator`` method of the context whose tensor is received
  (its receive shape ``[seq, mbs, hidden_k]`` from megatron's ``get_tensor_shapes``);
* gradient sync as megatron's non-interleaved schedule does it: each trainable context's
  ``no_sync`` is entered at the start and left right before the context's last backward;
  at the end ``config.finalize_model_grads_func([model], total_num_tokens_k, pg_collection=...)``
  runs per context, in context order (the same order on every rank).

Backwards run in the forward order, so megatron's FIFO of (input, output) tensors is kept across
contexts.  P=1 runs each context through megatron's no-pipelining schedule, one after another.

Memory: the executor counts the forwards whose backward has not run yet (``ExecStats``).  The stream
never holds more than ``P - stage`` of them, i.e. what sequential 1F1B holds, except when every
``N_k < P - stage``; with ``memory_guard=True`` (default) the executor checks this for every stage
beforehand (weighted by each context's activation size) and then falls back to the sequential
program, so the peak is never above sequential 1F1B's. Where the stream's pipelines are tied
together (models of different (D, T), or split experts: puzzle.parallel.streams.needs_one_program)
the ranks agree: the stream runs time-shared only if the guard allows it on every rank.
"""

from __future__ import annotations

import contextlib
from collections import deque
from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence

import torch

from puzzle.parallel.streams import needs_one_program
from puzzle.pipeline.time_sharing_schedule import (Action, CommStep, ContextSpec, executor_program,
                                      peak_in_flight, sequential_schedule, time_shared_schedule)

__all__ = ["ExecStats", "run_time_shared", "validate_stream", "sequential_peak"]


@dataclass
class ExecStats:
    """What one ``run_time_shared`` call did on this rank."""

    P: int = 1
    stage: int = 0
    mode: str = "time-shared"          # 'time-shared' | 'sequential' (memory-guard fallback / asked)
    in_flight: int = 0                 # forwards held (no backward yet) right now
    peak_in_flight: int = 0            # max of ``in_flight`` over the call
    peak_in_flight_weighted: int = 0   # same, weighted by activation elements per microbatch
    expected_peak: int = 0             # schedule.peak_in_flight of the executed program
    sequential_peak: int = 0           # what sequential 1F1B holds on this stage
    order: List[str] = field(default_factory=list)  # executed compute actions, e.g. 'F0.1'


# ----------------------------------------------------------------------------- validation

def _describe(contexts) -> str:
    return ", ".join(f"{c.engine.role}: {c.engine.layout.plan}" for c in contexts)


def validate_stream(contexts: Sequence[Any]) -> None:
    """Raise ValueError unless the contexts can run as one stream: the same devices, equal P, and
    one plan where a model's experts are split (puzzle.parallel.streams.stream_problem). Pure
    check of the plans, so every rank raises alike.

    Equal P on the same ranks gives every model the same pipeline groups whatever D and T are;
    models of different (D, T) then tie pipelines together through their TP/DP collectives, and
    those pipelines must run the same program (a blocking-P2P simulation of coupled pipelines
    whose programs differ deadlocks: tests/unit/test_time_sharing_schedule.py,
    test_coupled_pipelines_need_the_same_program). The trainer's micro-batching gives such a
    stream the same micro-batch counts on every DP rank, and ``run_time_shared`` checks them and
    agrees on the memory-guard decision over the stream's ranks (``_agree_on_program``)."""
    if not contexts:
        raise ValueError("time-sharing needs at least one context")
    from puzzle.parallel.streams import stream_problem

    plans = [c.engine.layout.plan for c in contexts]
    if len({p.P for p in plans}) != 1:
        raise ValueError("time-sharing requires equal P for the contexts in a stream; got "
                         + _describe(contexts))
    if len({tuple(p.ranks) for p in plans}) != 1:
        raise ValueError("time-sharing requires the contexts in a stream to share the same devices; "
                         "got " + ", ".join(f"{c.engine.role}: {p} on ranks {p.ranks[0]}..{p.ranks[-1]}"
                                            for c, p in zip(contexts, plans)))
    problem = stream_problem(plans)
    if problem is not None:
        raise ValueError(f"time-sharing: {problem} in a stream; got " + _describe(contexts))
    for c in contexts:
        if c.num_microbatches < 1:
            raise ValueError(f"{c.engine.role}: num_microbatches must be >= 1")


def _agree_on_program(contexts, guard_ok: bool) -> bool:
    """Collective over the stream's ranks (a stream that needs one program on every rank): raise
    ValueError on every rank alike unless each context has the same number of micro-batches on
    every rank; return the memory-guard decision of them all (time-shared only where every rank's
    guard allows it), so every pipeline runs the same program."""
    import torch.distributed as dist

    eng = contexts[0].engine
    counts = [c.num_microbatches for c in contexts]
    t = torch.tensor(counts + [-n for n in counts] + [0 if guard_ok else 1], dtype=torch.int64,
                     device=eng.module.puzzle_device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=eng.layout.pg_collection.intra_dist_opt)
    k = len(counts)
    most, least = t[:k].tolist(), [-v for v in t[k:2 * k].tolist()]
    uneven = [f"{c.engine.role}: {lo}..{hi}" for c, lo, hi in zip(contexts, least, most) if lo != hi]
    if uneven:
        raise ValueError("time-sharing models of different plans (" + _describe(contexts) + ") needs the "
                         "same number of micro-batches on every rank of the stream; got " + ", ".join(uneven))
    return int(t[-1]) == 0


def _weights(contexts) -> dict:
    """Activation elements of one microbatch on one stage, per context (memory-guard weights)."""
    out = {}
    for k, c in enumerate(contexts):
        a = c.engine.arch
        out[k] = c.seq_length * c.micro_batch_size * a.hidden_size * max(1, a.num_layers // c.engine.layout.plan.P)
    return out


def sequential_peak(P: int, stage: int, num_microbatches: Sequence[int], weights=None) -> int:
    """In-flight peak of running the contexts one after another with megatron's 1F1B."""
    specs = [ContextSpec(str(k), n) for k, n in enumerate(num_microbatches)]
    return peak_in_flight(sequential_schedule(P, stage, specs), weights)


def _guard_ok(P: int, specs, weights) -> bool:
    """Time-shared weighted peak <= sequential weighted peak on every stage."""
    for s in range(P):
        if (peak_in_flight(time_shared_schedule(P, s, specs), weights)
                > peak_in_flight(sequential_schedule(P, s, specs), weights)):
            return False
    return True


# ----------------------------------------------------------------------------- executor

class _Ctx:
    """Per-context megatron state during one stream."""

    def __init__(self, sc, forward_only: bool):
        from megatron.core.pipeline_parallel.schedules import get_tensor_shapes
        from megatron.core.utils import get_model_config, get_model_type

        self.sc = sc
        eng = sc.engine
        self.engine = eng
        self.model = eng.model
        self.config = get_model_config(self.model)
        self.model_type = get_model_type(self.model)
        self.pgc = eng.layout.pg_collection
        self.p2p = eng.p2p
        self.N = sc.num_microbatches
        self.store: List[Any] = []
        self.total_num_tokens = torch.zeros([], dtype=torch.int, device=eng.module.puzzle_device)
        self.shapes = get_tensor_shapes(seq_length=sc.seq_length, micro_batch_size=sc.micro_batch_size,
                                        decoder_seq_length=None, config=self.config,
                                        tp_group=self.pgc.tp, cp_group=self.pgc.cp)
        self.trains = not forward_only
        self._no_sync = None
        self.embedding_module = None

    def disable_grad_sync(self):
        if self._no_sync is None:
            fn = self.config.no_sync_func or contextlib.nullcontext
            self._no_sync = fn()
            self._no_sync.__enter__()

    def enable_grad_sync(self):
        if self._no_sync is not None:
            self._no_sync.__exit__(None, None, None)
            self._no_sync = None


def run_time_shared(contexts: Sequence[Any], forward_only: bool, *, time_shared: bool = True,
                    memory_guard: bool = True, stats: Optional[ExecStats] = None) -> List[List[Any]]:
    """Run ``contexts`` (``StageContext``) as one interleaved 1F1B stream on this rank.

    Returns each context's ``forward_data_store`` (the loss_func reports on the last stage, [] on
    other stages), like megatron's forward_backward_func.  Trainable contexts only accumulate and
    finalize gradients; zero them before and step the optimizers after.  ``time_shared=False`` runs
    the sequential baseline program through the same executor.  ``stats`` receives the in-flight
    counters.
    """
    validate_stream(contexts)
    st = stats if stats is not None else ExecStats()
    if not contexts[0].engine.member:
        return [[] for _ in contexts]
    for c in contexts:
        if not forward_only and not c.engine.trainable:
            raise ValueError(f"{c.engine.role} is frozen: it can only run forward_only")
        if forward_only:
            c.engine.model.eval()
        else:
            c.engine.model.train()
    P = contexts[0].engine.layout.plan.P
    st.P = P
    if P == 1:
        return _run_no_pipelining(contexts, forward_only, st)
    return _Stream(contexts, forward_only, time_shared, memory_guard, st).run()


class _Stream:
    """One rank's execution of a stream's program (P > 1): the FIFO of forwards awaiting their
    backward, the tensors in transit between the program's compute and P2P steps, the counters."""

    def __init__(self, contexts, forward_only: bool, time_shared: bool, memory_guard: bool,
                 st: ExecStats):
        self.ctxs = [_Ctx(c, forward_only) for c in contexts]
        self.forward_only = forward_only
        self.st = st
        P = st.P
        self.stage = self.ctxs[0].p2p.pp_group.rank()
        self.first, self.last = self.stage == 0, self.stage == P - 1
        st.stage = self.stage
        specs = [ContextSpec(f"{k}:{c.engine.role}", c.num_microbatches, forward_only)
                 for k, c in enumerate(contexts)]
        self.weights = _weights(contexts)
        guarded = time_shared and memory_guard and not forward_only
        ok = _guard_ok(P, specs, self.weights) if guarded else True
        if needs_one_program([c.engine.layout.plan for c in contexts]):
            ok = _agree_on_program(contexts, ok)  # the decision of every rank, not this one's
        if guarded and not ok:
            time_shared = False
        st.mode = "time-shared" if time_shared else "sequential"
        self.program = executor_program(P, self.stage, specs, time_shared=time_shared)
        st.expected_peak = peak_in_flight([a for a in self.program if isinstance(a, Action)])
        st.sequential_peak = peak_in_flight(sequential_schedule(P, self.stage, specs))
        self.fifo: deque = deque()   # (context, microbatch, input_tensor, output_tensor), forward order
        self.pending_input = None    # received input of the next forward
        self.pending_grad = None     # received output grad of the next backward
        self.last_output = None      # output of the latest forward (to send)
        self.last_input_grad = None  # input grad of the latest backward (to send)
        self.weighted = 0

    def run(self) -> List[List[Any]]:
        from megatron.core.pipeline_parallel.schedules import clear_embedding_activation_buffer

        if not self.forward_only:
            for c in self.ctxs:
                if c.config.finalize_model_grads_func is not None:
                    c.embedding_module = clear_embedding_activation_buffer(c.config, c.model, self.last)
                c.disable_grad_sync()
        try:
            for step in self.program:
                if isinstance(step, Action):
                    self.st.order.append(repr(step))
                    (self._forward if step.kind == "F" else self._backward)(step)
                else:
                    self._communicate(step)
            if self.fifo:
                raise RuntimeError(f"executor: {len(self.fifo)} forwards left without backward")
        finally:
            for c in self.ctxs:  # never leave a DDP in no_sync (also on errors)
                if c._no_sync is not None:
                    c.enable_grad_sync()
                    if c.config.grad_sync_func is not None and not self.forward_only:
                        c.config.grad_sync_func(c.model.parameters())
        if not self.forward_only:
            self._finalize_grads()
        return [c.store for c in self.ctxs]

    def _forward(self, step: Action) -> None:
        from megatron.core.pipeline_parallel.schedules import deallocate_output_tensor, forward_step

        c, st = self.ctxs[step.context], self.st
        out, ntok = forward_step(
            c.sc.forward_step_func, c.sc.data_iterator, c.model, c.N, self.pending_input,
            c.store, c.config, cp_group_size=c.pgc.cp.size(),
            collect_non_loss_data=False, checkpoint_activations_microbatch=None,
            is_first_microbatch=step.microbatch == 0,
            current_microbatch=step.microbatch, is_last_stage=self.last)
        c.total_num_tokens += ntok
        self.last_output = out
        if not self.forward_only:
            self.fifo.append((step.context, step.microbatch, self.pending_input, out))
            deallocate_output_tensor(out[0], c.config.deallocate_pipeline_outputs)
            st.in_flight += 1
            self.weighted += self.weights[step.context]
            st.peak_in_flight = max(st.peak_in_flight, st.in_flight)
            st.peak_in_flight_weighted = max(st.peak_in_flight_weighted, self.weighted)
        else:
            st.peak_in_flight = max(st.peak_in_flight, 1)
            st.peak_in_flight_weighted = max(st.peak_in_flight_weighted, self.weights[step.context])
        self.pending_input = None

    def _backward(self, step: Action) -> None:
        from megatron.core.pipeline_parallel.schedules import backward_step

        c = self.ctxs[step.context]
        k, m, inp, out = self.fifo.popleft()
        if (k, m) != (step.context, step.microbatch):
            raise RuntimeError(f"executor: backward {step!r} but FIFO head is {k}.{m}")
        if m == c.N - 1 and (c.config.grad_sync_func is None or self.stage == 0):
            c.enable_grad_sync()
        self.last_input_grad = backward_step(inp, out, self.pending_grad, c.model_type, c.config)
        self.pending_grad = None
        self.st.in_flight -= 1
        self.weighted -= self.weights[k]

    def _communicate(self, step: CommStep) -> None:
        if not step.ops:  # the first/last-stage half megatron turns into a no-op
            return
        k = step.recv_context if step.recv_context is not None else step.ops[0].context
        c = self.ctxs[k]
        p2p, call, first, last = c.p2p, step.call, self.first, self.last
        if call == "recv_forward":
            self.pending_input = p2p.recv_forward(c.shapes, first)
        elif call == "send_forward":
            p2p.send_forward(self.last_output, last)
        elif call == "send_forward_recv_backward":
            self.pending_grad = p2p.send_forward_recv_backward(self.last_output, c.shapes, last)
        elif call == "send_backward_recv_forward":
            self.pending_input = p2p.send_backward_recv_forward(self.last_input_grad, c.shapes, first)
        elif call == "send_backward":
            p2p.send_backward(self.last_input_grad, first)
        elif call == "recv_backward":
            self.pending_grad = p2p.recv_backward(c.shapes, last)
        else:  # pragma: no cover - schedule.py only emits the calls above
            raise RuntimeError(f"unknown P2P call {call!r}")

    def _finalize_grads(self) -> None:
        from megatron.core.pipeline_parallel.schedules import finish_embedding_wgrad_compute

        for c in self.ctxs:  # same order on every rank: finalize has collectives
            if c.config.finalize_model_grads_func is None:
                continue
            finish_embedding_wgrad_compute(c.config, c.embedding_module, self.last, c.pgc.tp)
            c.config.finalize_model_grads_func(
                [c.model], c.total_num_tokens if c.config.calculate_per_token_loss else None,
                pg_collection=c.pgc, force_all_reduce=False)


def _run_no_pipelining(contexts, forward_only: bool, st: ExecStats) -> List[List[Any]]:
    """P=1: nothing to overlap; megatron's no-pipelining schedule per context (F then B)."""
    st.mode = "sequential"
    st.stage = 0
    st.expected_peak = st.sequential_peak = st.peak_in_flight = 1
    st.peak_in_flight_weighted = max(_weights(contexts).values())
    outs = []
    for c in contexts:
        outs.append(c.engine.forward_backward(c.forward_step_func, c.data_iterator,
                                              c.num_microbatches, c.seq_length,
                                              c.micro_batch_size, forward_only=forward_only))
        st.order += [f"{a}{contexts.index(c)}.{m}" for m in range(c.num_microbatches)
                     for a in (("F",) if forward_only else ("F", "B"))]
    return outs
