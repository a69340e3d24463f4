"""Which models of one stage, on the same ranks, may run as ONE time-shared stream (pure).

PUZZLE's Eq. (1) needs equal P: the models' pipeline micro-batches interleave in one stream. Equal P
on the same ranks gives every model the same pipeline groups whatever its (D, T) are (rank =
offset + p*D*T + d*T + t), so such models time-share as well, on one condition: a model whose
tensor-, data- or expert-parallel groups span several pipelines ties those pipelines together, and
they must then run the same program (the same interleaving of the same micro-batch counts) or the
collectives meet out of order and deadlock. ``needs_one_program`` says when that holds; the
trainer's micro-batching then gives every data-parallel rank of each model as many micro-batches
and the executor agrees on its memory-guard decision over the stream's ranks.

The validate_args check, the executor's check and the plan search's pricing share this rule.
"""

from __future__ import annotations

from typing import Optional, Sequence

from puzzle.parallel.plan import ParallelPlan


def stream_problem(plans: Sequence[ParallelPlan]) -> Optional[str]:
    """Why models with these plans (on the same ranks) cannot run as one stream; None if they can:
    equal P, and, where a model's experts are split (E > 1 or ETP != T), one plan for all."""
    if len({p.P for p in plans}) > 1:
        return "unequal P"
    if len(set(plans)) > 1 and any(p.has_experts_split for p in plans):
        return "experts split over other ranks (E > 1 or ETP != T) need the same plan (P, D, T, E, ETP)"
    return None


def needs_one_program(plans: Sequence[ParallelPlan]) -> bool:
    """Whether every pipeline of a stream (P > 1) of these plans must run the same program: the
    plans differ (one model's TP or DP groups join pipelines that are another model's different
    DP ranks), or a model's expert groups span its DP ranks. With one dense plan, the pipelines a
    collective joins share a DP rank of every model, hence their data and their program."""
    plans = list(plans)
    if not plans or plans[0].P == 1:
        return False
    return len(set(plans)) > 1 or any(p.has_experts_split for p in plans)
