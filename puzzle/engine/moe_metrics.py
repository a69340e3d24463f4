"""The MoE load-balancing loss of a training stage, read from megatron-core's aux-loss tracker.

megatron-core's TopKRouter adds ``coeff * aux_loss`` to the gradient (MoEAuxLossAutoScaler) and
records the unscaled ``aux_loss`` of every training forward pass in a process-wide tracker
(``moe_utils.get_moe_layer_wise_logging_tracker``): per loss name, a tensor summed over the
forward passes, one entry per layer. ``moe_aux_loss_metrics`` turns it into the mean loss per MoE
layer and training micro-batch over every rank and trained MoE model (the micro-batches each rank
ran, counted by the stage: with --use-dynamic-bsz the DP ranks may run different numbers), then
clears the tracker.
At T > 1 each tensor-parallel rank routes its share of the sequence
(megatron_patches.moe_tensor_parallel_without_sp) and records its part of the loss: the T parts
sum to the micro-batch's loss, counted once per tensor-parallel group.
"""

from __future__ import annotations

from typing import Dict, Sequence

import torch
import torch.distributed as dist

#: the tracker's names of the load-balancing losses -> the metric logged
_NAMES = {"load_balancing_loss": "moe_aux_loss", "seq_load_balancing_loss": "moe_aux_loss"}


def moe_aux_loss_metrics(engines: Sequence, micro_batches_run: Sequence[int], device) -> Dict[str, float]:
    """{"moe_aux_loss": mean per MoE layer and micro-batch} when a trained model has MoE layers
    with a load-balancing loss (coefficient > 0), else {}. Collective over the world.
    ``micro_batches_run[i]``: the training micro-batches ``engines[i]`` ran on this rank since the
    tracker was cleared (its DP rank's count: with --use-dynamic-bsz DP ranks may run different
    numbers)."""
    runs = {id(e): n for e, n in zip(engines, micro_batches_run)}
    engines = [e for e in engines if e is not None and e.arch.is_moe]
    if not engines or all(e.arch.moe_aux_loss_coeff == 0 or e.arch.moe_router_load_balancing_type == "none"
                          for e in engines):
        return {}
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker

    total = sum(float(entry["values"].sum()) for name, entry in get_moe_layer_wise_logging_tracker().items()
                if name in _NAMES)
    calls = 0
    for e in engines:
        if e.member and e.layout.t == 0:  # a micro-batch's loss: the sum of its T ranks' parts
            layers = [i for i in range(e.arch.num_layers) if e.arch.is_moe_layer(i)]
            on_stage = sum(1 for i in layers if _stage_of(i, e) == e.layout.p)
            calls += on_stage * runs[id(e)]
    sums = torch.tensor([total, float(calls)], dtype=torch.float64, device=device)
    dist.all_reduce(sums)
    clear_aux_losses_tracker()
    return {"moe_aux_loss": float(sums[0] / sums[1])} if sums[1] > 0 else {}


def _stage_of(layer: int, engine) -> int:
    from puzzle.models.param_layout import resolve_layers_per_stage, stage_of_layer

    return stage_of_layer(layer, resolve_layers_per_stage(engine.arch.num_layers, engine.layout.plan.P))
