"""The collective scope: the ranks that the "world-wide" collectives of the dataflow span.

By default that is the whole torchrun world. With --rl-desired-lag >= 1 the world is split into a
generation pool and a training pool that work at the same time (puzzle/dataflow/overlap_stage.py):
each pool's own work runs inside ``collective_scope(pool)``, so that the batch assembly
(``batch.world_rows``), the runtime's reductions and broadcasts, and the reward scoring gather only
within the pool. Models' own groups (TP, PP, DP) are untouched: they lie inside one pool already.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, List, Optional

import torch.distributed as dist


@dataclass(frozen=True)
class Scope:
    ranks: tuple               # global ranks, ascending
    group: Any = None          # their process group (None: the world)
    object_group: Any = None   # their gloo group for Python objects (None: the runtime's)


_SCOPE: Optional[Scope] = None


@contextlib.contextmanager
def collective_scope(scope: Optional[Scope]):
    """Run the body with the dataflow's collectives over ``scope`` (None: the world)."""
    global _SCOPE
    before, _SCOPE = _SCOPE, scope
    try:
        yield
    finally:
        _SCOPE = before


def scope_group():
    """The process group of the scope (None: the default world group)."""
    return _SCOPE.group if _SCOPE is not None else None


def scope_object_group(default):
    return _SCOPE.object_group if _SCOPE is not None else default


def scope_ranks() -> List[int]:
    """The scope's global ranks (the world's when unscoped)."""
    if _SCOPE is not None:
        return list(_SCOPE.ranks)
    return list(range(dist.get_world_size() if dist.is_initialized() else 1))


def scope_size() -> int:
    return len(scope_ranks())


def scope_rank() -> int:
    """This rank's index in the scope (its global rank when unscoped)."""
    me = dist.get_rank() if dist.is_initialized() else 0
    return scope_ranks().index(me) if _SCOPE is not None else me
