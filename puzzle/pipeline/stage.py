"""Running the models of one PPO stage under a placement (PUZZLE §4.3 hybrid placement).

Models are grouped by the ranks they occupy (their layout's rank range). Groups on disjoint
ranks run concurrently: a rank only runs the models it holds. Within a group:

``sequential``   models one after another, each through megatron's own schedule (MBM);
``disjoint``     the same execution as sequential; the placement asks (and validation checks,
                 puzzle.arguments) that the stage's models form at least two groups on disjoint
                 ranks (SMDD), which then run concurrently;
``time-sharing`` the models of a group (equal P; puzzle.parallel.streams) run as ONE
                 interleaved 1F1B stream (puzzle.pipeline.time_sharing_executor).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch

PLACEMENTS = ("sequential", "disjoint", "time-sharing")


@dataclass
class StageContext:
    """One model's share of a stage: what megatron's forward_backward_func would be given."""

    engine: Any  # puzzle.engine.model_engine.ModelEngine
    forward_step_func: Callable
    data_iterator: Iterator
    num_microbatches: int
    seq_length: int
    micro_batch_size: int
    rows: Optional[Any] = None  # token-budget micro-batches: the batch rows of the outputs, in order


def _by_rank_range(plans: List[Any]) -> Dict[Tuple[int, int], List[int]]:
    """Indices of ``plans`` grouped by the rank range (first, last) each plan occupies."""
    groups: Dict[Tuple[int, int], List[int]] = {}
    for i, plan in enumerate(plans):
        groups.setdefault((plan.ranks[0], plan.ranks[-1]), []).append(i)
    return groups


def rank_groups(contexts: List[StageContext]) -> Dict[Tuple[int, int], List[int]]:
    """Context indices grouped by the rank range (first, last) their layout occupies."""
    return _by_rank_range([ctx.engine.layout.plan for ctx in contexts])


def one_program_roles(plans: Dict[str, Any], placement: str) -> List[str]:
    """The roles (of a stage whose models have ``plans``) in a time-shared stream whose pipelines
    must all run the same program (puzzle.parallel.streams.needs_one_program): their micro-batch
    counts must be the same on every DP rank."""
    if placement != "time-sharing":
        return []
    from puzzle.parallel.streams import needs_one_program

    roles = list(plans)
    groups = [[roles[i] for i in g] for g in _by_rank_range([plans[r] for r in roles]).values()]
    return [r for g in groups if needs_one_program([plans[r] for r in g]) for r in g]


def run_stage(contexts: List[StageContext], *, forward_only: bool, placement: str = "sequential"
              ) -> List[List[Any]]:
    """Forward(-backward) every context; returns each context's last-stage outputs ([] elsewhere).

    Training contexts only accumulate gradients: the caller zeroes grads before and steps each
    engine's optimizer after. A forward-only stage runs without autograd: a trainable model's
    forward would otherwise keep every layer's saved activations of a micro-batch alive (on an
    H100 the 1.1B scoring peak was above the training one).
    """
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {', '.join(PLACEMENTS)} (got {placement!r})")
    if forward_only:
        with torch.no_grad():
            return _run_groups(contexts, forward_only=True, placement=placement)
    return _run_groups(contexts, forward_only=False, placement=placement)


def _run_groups(contexts: List[StageContext], *, forward_only: bool, placement: str) -> List[List[Any]]:
    outputs: List[List[Any]] = [[] for _ in contexts]
    for indices in rank_groups(contexts).values():
        group = [contexts[i] for i in indices]
        if not group[0].engine.member:
            continue  # another device group's models: they run concurrently there
        if placement == "time-sharing":
            from puzzle.pipeline.time_sharing_executor import run_time_shared

            results = run_time_shared(group, forward_only=forward_only)
        else:
            results = [ctx.engine.forward_backward(ctx.forward_step_func, ctx.data_iterator,
                                                   ctx.num_microbatches, ctx.seq_length,
                                                   ctx.micro_batch_size, forward_only=forward_only)
                       for ctx in group]
        for i, out in zip(indices, results):
            outputs[i] = out
    return outputs
