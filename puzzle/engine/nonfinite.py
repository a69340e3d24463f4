"""Non-finite losses and gradients: found on any rank, agreed by all, named, skipped or fatal.

After the backward passes of an optimizer step (gradients reduced), every rank reports, for each
trainable model, whether its loss sums (last pipeline stage) or its gradient buffers hold NaN/inf,
tagged with its pipeline stage; one all-reduce makes the verdict the same on every rank. The
trainer then skips that model's optimizer step (``--skip-nonfinite-iterations N``, counted) or
raises ``NonFiniteError`` naming the model, the PPO stage, the pipeline stage(s) and the iteration.
"""

from __future__ import annotations

import math
from typing import Dict, List, Sequence

import torch

KINDS = ("loss", "gradient norm")


class NonFiniteError(RuntimeError):
    """A NaN/inf loss, gradient norm or score; the message names model, stage and iteration."""


def inject_for_test(role: str, engine, iteration: int, faults) -> None:
    """Poison one gradient of ``role`` when ``faults`` (config.FaultInjection) lists (role, iteration)."""
    if engine.member and (role, iteration) in faults.nonfinite_grads:
        engine.model.buffers[0].grad_data[0] = float("nan")


def _loss_nonfinite(outputs: Sequence[dict], keys: Sequence[str]) -> bool:
    return any(not math.isfinite(float(o[k])) for o in outputs for k in keys)


def find(checks: Sequence[tuple]) -> Dict[str, Dict[str, List[int]]]:
    """Collective. ``checks``: (role, engine, last-stage outputs, loss keys) per trainable model.
    Returns {role: {kind: [pipeline stages where found]}} for the models with a non-finite value,
    the same on every rank."""
    from puzzle.parallel.device import runtime

    pmax = max(eng.layout.plan.P for _, eng, _, _ in checks)
    flags = torch.zeros(len(checks), len(KINDS), pmax, dtype=torch.float64)  # host side, then one reduce
    for i, (role, eng, outputs, keys) in enumerate(checks):
        if not eng.member:
            continue
        if outputs and _loss_nonfinite(outputs, keys):
            flags[i, 0, eng.layout.p] = 1
        if not eng.grads_finite():
            flags[i, 1, eng.layout.p] = 1
    flags = torch.tensor(runtime().all_reduce(flags.flatten().tolist()), dtype=torch.float64).view_as(flags)
    found = {}
    for i, (role, *_rest) in enumerate(checks):
        kinds = {KINDS[k]: [p for p in range(pmax) if flags[i, k, p] > 0] for k in range(len(KINDS))}
        kinds = {k: v for k, v in kinds.items() if v}
        if kinds:
            found[role] = kinds
    return found


def describe(role: str, kinds: Dict[str, List[int]], iteration: int, where: str) -> str:
    what = " and ".join(f"{k} (pipeline stage {', '.join(map(str, st))})" for k, st in kinds.items())
    return f"non-finite {what} of the {role} model at iteration {iteration} ({where})"


def check_scores(fields: dict, mask: torch.Tensor, iteration: int, sources: Dict[str, str]) -> None:
    """Scoring outputs (identical on every rank, no collective): raise on the first non-finite one."""
    for key, role in sources.items():
        x = fields[key]
        bad = ~torch.isfinite(x[mask.bool()] if x.dim() == 2 else x)
        if bad.any():
            raise NonFiniteError(f"non-finite {key.replace('_', ' ')} of the {role} model at iteration "
                                 f"{iteration} (scoring stage; {int(bad.sum())} values)")


class SkipPolicy:
    """``--skip-nonfinite-iterations N``: after the backward passes of an optimizer step, the
    models with a NaN/inf loss or gradient skip that step (their gradients zeroed), up to N times
    in the run (the count is checkpointed); past the allowance NonFiniteError on every rank."""

    def __init__(self, allowed: int, rank: int, faults):
        self.allowed, self.rank, self.faults = allowed, rank, faults
        self.skipped = 0

    def roles_to_skip(self, trained: List[tuple], iteration: int, where: str) -> set:
        """Collective. ``trained``: (role, engine, its last-stage micro-batch outputs, loss keys)
        per trained model (outputs [] off the owning rank). Returns the roles whose optimizer
        step is skipped, the same on every rank."""
        for role, eng, _, _ in trained:
            inject_for_test(role, eng, iteration, self.faults)
        found = find(trained)
        engines = {role: eng for role, eng, _, _ in trained}
        for role, kinds in found.items():
            msg = describe(role, kinds, iteration, where)
            if self.skipped >= self.allowed:
                raise NonFiniteError(msg + (f"; {self.skipped} step(s) skipped already, "
                                            f"--skip-nonfinite-iterations {self.allowed}" if self.allowed else
                                            "; --skip-nonfinite-iterations N skips up to N such steps"))
            self.skipped += 1
            if self.rank == 0:
                print(f"warning: {msg}: optimizer step skipped ({self.skipped}/{self.allowed}, "
                      f"--skip-nonfinite-iterations)", flush=True)
            if engines[role].member:
                engines[role].zero_grad()
        return set(found)
