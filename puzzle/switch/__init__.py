"""Parameter layout descriptions and routing tables for switching parallel plans (PUZZLE §5)."""

from puzzle.switch.param_layout import (KINDS, ParamSpec, global_name, gpt_param_specs, local_name, local_shape,
                                        num_layers_of, params_on_stage, resolve_layers_per_stage, shard_slices,
                                        stage_of_layer)
from puzzle.switch.routing import RoutingTable, Transfer, box_to_slices, build_routing_table
from puzzle.switch.executor import RoutingExecutor, SwitchStats, execute_routing, segment_of_params
from puzzle.switch.overlap import step_and_switch
from puzzle.switch.shadow import (ShadowModel, build_shadow, routing_table_for, switch_to_generation,
                                  table_params)

__all__ = [
    "KINDS", "ParamSpec", "gpt_param_specs", "shard_slices", "local_shape", "num_layers_of",
    "resolve_layers_per_stage", "stage_of_layer", "local_name", "global_name", "params_on_stage",
    "Transfer", "RoutingTable", "build_routing_table", "box_to_slices",
    "RoutingExecutor", "SwitchStats", "execute_routing", "segment_of_params", "step_and_switch",
    "ShadowModel", "build_shadow", "routing_table_for", "switch_to_generation", "table_params",
]
