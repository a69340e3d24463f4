"""Running the models of one PPO stage under a placement (PUZZLE §4.3 hybrid placement).

``sequential``   models one after another on their own layouts (the MBM baseline);
``disjoint``     models on disjoint device groups: each rank runs only the models it holds, so
                 the groups run concurrently (layouts with different rank offsets);
``time-sharing`` models sharing devices and pipeline degree run as ONE interleaved 1F1B stream.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, List

PLACEMENTS = ("sequential", "disjoint", "time-sharing")


@dataclass
class StageContext:
    """One model's share of a stage: what megatron's forward_backward_func would be given."""

    engine: Any  # puzzle.training.engine.ModelEngine
    forward_step_func: Callable
    data_iterator: Iterator
    num_microbatches: int
    seq_length: int
    micro_batch_size: int


def run_stage(contexts: List[StageContext], *, forward_only: bool, placement: str = "sequential"
              ) -> List[List[Any]]:
    """Forward(-backward) every context; returns each context's last-stage outputs ([] elsewhere).

    Training contexts only accumulate gradients: the caller zeroes grads before and steps each
    engine's optimizer after.
    """
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {', '.join(PLACEMENTS)} (got {placement!r})")
    if placement == "time-sharing":
        from puzzle.pipeline.executor import run_time_shared

        return run_time_shared(contexts, forward_only=forward_only)
    outputs = []
    for ctx in contexts:
        if not ctx.engine.member:
            outputs.append([])
            continue
        fb = ctx.engine.forward_backward(ctx.forward_step_func, ctx.data_iterator,
                                         ctx.num_microbatches, ctx.seq_length,
                                         ctx.micro_batch_size, forward_only=forward_only)
        outputs.append(fb)
    return outputs
