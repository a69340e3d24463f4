"""A plan document (search_plan.py --save-plan, ``SearchResult.to_dict``, ``--plan auto``) read into
layouts that ``validate_args`` applies to the run configuration directly.

The trainer time-shares models with equal P on the same ranks (one plan where experts are split:
puzzle.parallel.streams.stream_problem), and the search prices Eq. (1) only for those, so a searched
plan keeps its placements; a hand-written document's 'time-sharing' stage whose co-located plans
cannot share a stream becomes 'sequential' (``strict``: an ArgumentError instead).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

from puzzle.config import PARALLEL_GROUP, PLACEMENTS
from puzzle.model_arch import ROLE_PREFIXED
from puzzle.config_flags import check_at_least, fail, flag
from puzzle.parallel.plan import ParallelPlan, PlanError
from puzzle.parallel.streams import stream_problem

#: stage of a plan document -> the flag its placement replaces
PLACEMENT_FLAGS = {"scoring": "--score-placement", "training": "--train-placement"}


_ROLES = ("actor",) + ROLE_PREFIXED
#: --actor-gen-...: the actor's generation layout (unset: its training layout)
GENERATION = "actor-gen"


@dataclass(frozen=True)
class LayoutFlags:
    """The layout flags of one role (``from_args(LayoutFlags, args, role=...)``): the unprefixed
    flags give every role's default, ``--<role>-...`` override them, the actor's generation layout
    (role ``actor-gen``) defaults to the actor's training layout. D = None: the ranks from the
    offset to the end / (P * T)."""

    tensor_model_parallel_size: int = flag(
        1, PARALLEL_GROUP, "Actor training T (default for every role).", roles=_ROLES + (GENERATION,),
        role_help={GENERATION: "Actor generation-layout T (default: its training layout)."})
    pipeline_model_parallel_size: int = flag(
        1, PARALLEL_GROUP, "Actor training P (default for every role).", roles=_ROLES + (GENERATION,),
        role_help={GENERATION: "Actor generation-layout P (default: its training layout)."})
    expert_model_parallel_size: int = flag(
        1, PARALLEL_GROUP, "Actor training E: ranks the experts of MoE layers are split over (default for "
        "every role).", roles=_ROLES + (GENERATION,),
        role_help={GENERATION: "Actor generation-layout E (default: its training layout)."})
    expert_tensor_parallel_size: Optional[int] = flag(
        None, PARALLEL_GROUP, "Actor training ETP: ranks each expert is split over (default T).", type=int,
        roles=_ROLES + (GENERATION,), role_help={GENERATION: "Actor generation-layout ETP (default: T)."})
    data_parallel_size: Optional[int] = flag(
        None, PARALLEL_GROUP, type=int, roles=_ROLES + (GENERATION,), role_only=True,
        role_help={**{r: f"{r}: D (default: the ranks from its offset to the end / (P*T))." for r in _ROLES},
                   GENERATION: "Actor generation-layout D (default: the ranks from its offset to the end / (P*T))."})
    # --actor-gen-rank-offset > 0: the generation pool of --rl-desired-lag (its ranks used by no
    # training role, which default to the ranks before it)
    rank_offset: int = flag(0, PARALLEL_GROUP, roles=_ROLES + (GENERATION,), role_only=True,
                            role_help={**{r: f"{r}: first rank of its layout (disjoint placement)." for r in _ROLES},
                                       GENERATION: "First rank of the actor's generation layout: > 0 makes it the "
                                       "generation pool of --rl-desired-lag, on ranks no training role uses (the "
                                       "training roles default to the ranks before it)."})

    def __post_init__(self):
        cls = LayoutFlags
        check_at_least(cls, self, 1, "tensor_model_parallel_size", "pipeline_model_parallel_size",
                       "expert_model_parallel_size")
        check_at_least(cls, self, 1, "expert_tensor_parallel_size", optional=True)
        check_at_least(cls, self, 1, "data_parallel_size", optional=True)
        check_at_least(cls, self, 0, "rank_offset")


@dataclass(frozen=True)
class PlanLayouts:
    """Per role the scoring/training layout, the actor's generation layout, per stage the placement."""

    homes: Dict[str, ParallelPlan] = field(default_factory=dict)
    actor_generation: Optional[ParallelPlan] = None
    placements: Dict[str, str] = field(default_factory=dict)  # "scoring"/"training" -> placement


def read_plan_document(doc: dict, strict: bool = False) -> PlanLayouts:
    """The layouts of ``doc``; errors name --plan-file."""
    try:
        plans = {m: {s: ParallelPlan.parse(p) for s, p in st.items()} for m, st in doc["plans"].items()}
    except (KeyError, AttributeError, PlanError) as e:
        fail("--plan-file", f"not a plan document ({e})")
    homes, gen = {}, None
    for role, stages in plans.items():
        home = stages.get("training") or stages.get("scoring")
        if home is None:
            continue
        homes[role] = home
        if role == "actor" and "generation" in stages:
            gen = stages["generation"]
            if (gen.offset, gen.size) != (home.offset, home.size):
                fail("--plan-file", f"the actor generates on {gen} but trains on {home}: the switch moves "
                                    "weights between layouts of the same ranks only")
    placements = {}
    for stage in PLACEMENT_FLAGS:
        placement = doc.get("placements", {}).get(stage)
        if placement not in PLACEMENTS:
            continue
        if placement == "time-sharing":
            items = [(r, st[stage]) for r, st in plans.items() if stage in st]
            clash = [(a, pa, b, pb) for i, (a, pa) in enumerate(items) for b, pb in items[i + 1:]
                     if set(pa.ranks) & set(pb.ranks) and stream_problem([pa, pb])]
            if clash and strict:
                a, pa, b, pb = clash[0]
                fail("--plan-file", f"{stage}: time-sharing of {a} {pa} and {b} {pb} on shared ranks: "
                                    f"{stream_problem([pa, pb])}")
            if clash:
                placement = "sequential"
        placements[stage] = placement
    return PlanLayouts(homes=homes, actor_generation=gen, placements=placements)


def layouts_as_flags(layouts: PlanLayouts, roles=None) -> List[str]:
    """The train_ppo.py flags that give the same layouts (printed at start; launching another run)
    to a run that builds ``roles`` (default: every role of the plan; a flag of a role the run does
    not build is refused)."""
    flags: List[str] = []
    for role, home in layouts.homes.items():
        if roles is not None and role not in roles:
            continue
        flags += [f"--{role}-tensor-model-parallel-size", str(home.T),
                  f"--{role}-pipeline-model-parallel-size", str(home.P),
                  f"--{role}-data-parallel-size", str(home.D), f"--{role}-rank-offset", str(home.offset)]
        if home.has_experts_split:
            flags += [f"--{role}-expert-model-parallel-size", str(home.E),
                      f"--{role}-expert-tensor-parallel-size", str(home.ETP)]
        if role == "actor" and layouts.actor_generation is not None:
            gen = layouts.actor_generation
            flags += ["--actor-gen-tensor-model-parallel-size", str(gen.T),
                      "--actor-gen-pipeline-model-parallel-size", str(gen.P)]
            if gen.has_experts_split:
                flags += ["--actor-gen-expert-model-parallel-size", str(gen.E),
                          "--actor-gen-expert-tensor-parallel-size", str(gen.ETP)]
    for stage, flag in PLACEMENT_FLAGS.items():
        if stage in layouts.placements:
            flags += [flag, layouts.placements[stage]]
    return flags
