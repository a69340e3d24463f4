"""Routing tables for switching parallel plans (PUZZLE §5), over the parameter layout of
puzzle.models.param_layout."""

from puzzle.switch.routing import RoutingTable, Transfer, box_to_slices, build_routing_table
from puzzle.switch.routing_executor import RoutingExecutor, SwitchStats, execute_routing, segment_of_params
from puzzle.switch.overlap import step_and_switch
from puzzle.switch.shadow import ShadowModel, build_shadow, routing_table_for, switch_to_generation

__all__ = [
    "Transfer", "RoutingTable", "build_routing_table", "box_to_slices",
    "RoutingExecutor", "SwitchStats", "execute_routing", "segment_of_params", "step_and_switch",
    "ShadowModel", "build_shadow", "routing_table_for", "switch_to_generation",
]
