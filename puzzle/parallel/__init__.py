"""Layouts: (P, D, T) plans and the process groups that realise them."""

from puzzle.parallel.plan import ParallelPlan, PlanError

__all__ = ["ParallelPlan", "PlanError"]
