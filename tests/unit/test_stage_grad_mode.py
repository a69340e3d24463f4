"""A forward-only stage (scoring, evaluation) runs without autograd; a training stage with it."""

from types import SimpleNamespace

import torch

from puzzle.pipeline.stage import StageContext, run_stage


def _context(seen):
    plan = SimpleNamespace(ranks=[0])

    def forward_backward(*args, forward_only):
        seen.append((forward_only, torch.is_grad_enabled()))
        return ["out"]
    engine = SimpleNamespace(layout=SimpleNamespace(plan=plan), member=True, forward_backward=forward_backward)
    return StageContext(engine, None, iter(()), 1, 8, 1)


def test_forward_only_stage_runs_without_autograd():
    seen = []
    assert run_stage([_context(seen)], forward_only=True) == [["out"]]
    assert run_stage([_context(seen)], forward_only=False) == [["out"]]
    assert seen == [(True, False), (False, True)]
    assert torch.is_grad_enabled()
