"""Plan search for PPO on (P, D, T) layouts: profiles, cost and memory models, Eq. (2) search."""

from puzzle.model_shape import ModelShape
from puzzle.plan_search.cost_model import (LLAMA_SHAPES, CostModel, ModelRole, PPOWorkload, TaskCost,
                                    grouped_time, pipeline_time, plan_problems, ppo_roles, sequential_time,
                                    switch_bytes_max_rank, switch_bytes_per_rank, time_sharing_time)
from puzzle.plan_search.memory_model import MemoryFitError, MemoryModel, MemoryReport
from puzzle.plan_search.profile_data import (LayerTable, Profile, ProfileError, analytic_layer_table, load_profile,
                                      save_profile, validate_profile)
from puzzle.plan_search.search import (InfeasibleError, PPOJob, SearchResult, candidate_plans, exhaustive_search,
                                similarity_search)

__all__ = [
    "LLAMA_SHAPES", "CostModel", "ModelRole", "ModelShape", "PPOWorkload", "TaskCost", "grouped_time",
    "pipeline_time", "plan_problems", "ppo_roles", "sequential_time", "switch_bytes_max_rank",
    "switch_bytes_per_rank", "time_sharing_time", "MemoryFitError", "MemoryModel", "MemoryReport", "LayerTable",
    "Profile", "ProfileError", "analytic_layer_table", "load_profile", "save_profile", "validate_profile",
    "InfeasibleError", "PPOJob", "SearchResult", "candidate_plans", "exhaustive_search", "similarity_search",
]
