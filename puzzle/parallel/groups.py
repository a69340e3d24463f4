"""Process groups of any (P, D, T) plan over the same world, as megatron ProcessGroupCollections.

Every model of the job gets its own groups; nothing here touches megatron's global
``parallel_state`` model-parallel groups. ``torch.distributed.new_group`` must be called by every
rank of the world in the same order, even for groups it is not in, so ``layout_for(plan)``
is collective: every rank must build the same plans in the same order. Groups are cached by
their rank list, so two plans (or two group kinds) with the same ranks share one group.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from puzzle.parallel import launcher
from puzzle.parallel.device import (DEFAULT_TIMEOUT_MINUTES, default_backend, device_sharing_problem,
                                    local_device, make_runtime, runtime)
from puzzle.parallel.plan import ParallelPlan, PlanError

# the groups and layouts of this process (process groups live as long as torch.distributed's world)
_GROUPS: Dict[Tuple[int, ...], Optional[dist.ProcessGroup]] = {}
_LAYOUTS: Dict[ParallelPlan, "Layout"] = {}


def _group(ranks: List[int]) -> Optional[dist.ProcessGroup]:
    """The group of exactly these ranks (created once, collectively); None if this rank is not in it."""
    key = tuple(ranks)
    if key not in _GROUPS:
        pg = dist.new_group(ranks=list(key), timeout=runtime().timeout)
        _GROUPS[key] = pg if dist.get_rank() in key else None
    return _GROUPS[key]


def _my_group(all_groups: List[List[int]]) -> Optional[dist.ProcessGroup]:
    """Create every group of a kind (collectively) and return the one holding this rank."""
    mine = None
    me = dist.get_rank()
    for ranks in all_groups:
        g = _group(ranks)
        if me in ranks:
            mine = g
    return mine


@dataclass
class Layout:
    """This rank's view of a plan: its coordinates, its groups and its P2P neighbours."""

    plan: ParallelPlan
    rank: int
    pg_collection: Optional[object]  # megatron ProcessGroupCollection, None off-plan
    p: int = -1
    d: int = -1
    t: int = -1
    ep: int = 0     # expert-parallel rank (expert layers)
    edp: int = -1   # expert-data-parallel rank (expert layers)
    etp: int = -1   # expert-tensor-parallel rank (expert layers)

    @property
    def member(self) -> bool:
        """Whether this rank holds a part of the model in this layout."""
        return self.pg_collection is not None

    @property
    def is_first_stage(self) -> bool:
        return self.p == 0

    @property
    def is_last_stage(self) -> bool:
        return self.p == self.plan.P - 1

    def p2p_communicator(self, config):
        """megatron P2PCommunicator over this layout's pipeline group (config: TransformerConfig)."""
        from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

        if not self.member:
            raise PlanError(f"rank {self.rank} is not in plan {self.plan}")
        return P2PCommunicator(pp_group=self.pg_collection.pp, config=config)

    def generation_share(self):
        """(share, shares, first): the part of a batch this rank generates, the number of parts,
        and whether it is the first DP rank of its part. The DP ranks of one expert-parallel
        group generate the same part, so their MoE layers' collectives run in step (with E = 1
        and ETP = T: (d, D, True))."""
        share, shares = self.plan.generation_share(self.rank)
        return share, shares, self.d == share * (self.plan.D // shares)

    # convenience accessors -------------------------------------------------------------
    @property
    def tp_group(self):
        return self.pg_collection.tp

    @property
    def pp_group(self):
        return self.pg_collection.pp


def layout_for(plan: ParallelPlan) -> Layout:
    """Build (collectively, once per plan) and return this rank's Layout of ``plan``."""
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed must be initialised before building layouts")
    plan.check_world(dist.get_world_size())
    if plan in _LAYOUTS:
        return _LAYOUTS[plan]
    from megatron.core.process_groups_config import ProcessGroupCollection

    me = dist.get_rank()
    singletons = [[r] for r in plan.ranks]
    groups = {
        "tp": _my_group(plan.tp_groups()),
        "pp": _my_group(plan.pp_groups()),
        "dp": _my_group(plan.dp_groups()),
        "mp": _my_group(plan.mp_groups()),
        "embd": _my_group(plan.embedding_groups()),
        "pos_embd": _my_group(plan.position_embedding_groups()),
        "cp": _my_group(singletons),
        "all": _my_group([plan.ranks]),
        "tp_dp": _my_group([plan.ranks[i:i + plan.D * plan.T]
                            for i in range(0, plan.size, plan.D * plan.T)]),
        # expert layers (E, ETP; the same groups as tp / dp / mp when E = 1 and ETP = T)
        "ep": _my_group(plan.ep_groups()),
        "expt_tp": _my_group(plan.expt_tp_groups()),
        "expt_dp": _my_group(plan.expt_dp_groups()),
        "tp_ep": _my_group(plan.tp_ep_groups()),
        "tp_ep_pp": _my_group(plan.tp_ep_pp_groups()),
    }
    if not plan.contains(me):
        layout = Layout(plan=plan, rank=me, pg_collection=None)
    else:
        p, d, t = plan.coords(me)
        _, edp, ep, etp = plan.expert_coords(me)
        # No context parallelism: its groups collapse onto the ones above.
        pgc = ProcessGroupCollection(
            tp=groups["tp"], pp=groups["pp"], mp=groups["mp"], embd=groups["embd"],
            pos_embd=groups["pos_embd"], cp=groups["cp"], tp_cp=groups["tp"],
            hcp=None, ep=groups["ep"], expt_tp=groups["expt_tp"], tp_ep=groups["tp_ep"],
            tp_ep_pp=groups["tp_ep_pp"], tp_dp_cp=groups["tp_dp"], dp=groups["dp"],
            dp_cp=groups["dp"], expt_dp=groups["expt_dp"], intra_dp_cp=groups["dp"],
            intra_expt_dp=groups["expt_dp"], inter_dist_opt=None,
            # the whole optimizer instance (all ranks of the model), not the DP group:
            # megatron's grad-norm reduction runs over it
            intra_dist_opt=groups["all"],
        )
        layout = Layout(plan=plan, rank=me, pg_collection=pgc, p=p, d=d, t=t, ep=ep, edp=edp, etp=etp)
    _LAYOUTS[plan] = layout
    return layout


def destroy_layouts() -> None:
    """Forget cached layouts and groups (call before destroy_process_group)."""
    _LAYOUTS.clear()
    _GROUPS.clear()


class DeviceSharingError(ValueError):
    """The chosen backend cannot run this node's ranks on its devices (raised before any group)."""


def init_distributed(backend: Optional[str] = None,
                     timeout_minutes: float = DEFAULT_TIMEOUT_MINUTES) -> Tuple[int, int]:
    """Initialise torch.distributed from torchrun's environment (``backend``, --distributed-backend:
    default gloo on CPU, nccl on GPU; DeviceSharingError when NCCL would put two ranks on a GPU).

    ``timeout_minutes`` (--distributed-timeout-minutes) bounds every collective of the world
    group and of every group built here later, so a stuck rank ends the job instead of hanging it.
    Also performs the per-process megatron set-up that does not depend on a model layout.
    """
    timeout = datetime.timedelta(minutes=timeout_minutes)
    if not dist.is_initialized():
        backend = backend or default_backend()
        problem = device_sharing_problem(backend)
        if problem:
            raise DeviceSharingError(problem)
        if not launcher.launched():  # plain `python script.py`: a world of one
            launcher.default_to_world_of_one(_free_port())
        if backend == "nccl":
            torch.cuda.set_device(local_device())
        dist.init_process_group(backend=backend, timeout=timeout)
    make_runtime(timeout=timeout)
    from megatron.core import parallel_state

    # megatron's shared scratch buffer, used by its tensor-parallel layers
    if getattr(parallel_state, "_GLOBAL_MEMORY_BUFFER", None) is None:
        parallel_state._set_global_memory_buffer()
    return dist.get_rank(), dist.get_world_size()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
