"""A static-shape decode step of megatron-core's MoELayer, for the CUDA-graph decode.

megatron's MoE forward routes each token to its top-k experts and runs every expert on the
tokens routed to it: the token dispatchers read the per-expert token counts on the host
(``tokens_per_expert.tolist()`` / ``.cpu()``) and permute the tokens into data-dependent shapes,
which a CUDA graph cannot capture. At a decode step (one token per row, a few rows) every
expert's weights are read anyway once rows * top-k reaches the number of experts, so
``moe_decode_mlp`` runs every local expert on every row instead and weights its output by the
router's probability, which is 0 for the experts a row was not routed to: the same memory
traffic, static shapes, no host synchronisation.

It mirrors megatron's arithmetic operation for operation (SequentialMLP experts, either token
dispatcher, experts whole on the rank):

- the router is megatron's own module (eval: no load-balancing or z-loss, no expert-bias
  update), called on the layer input [1, n, h] as ``MoELayer.route`` calls it;
- each expert is ``MLP.forward`` with ``per_token_scale``: fc1 product (plus bias), activation
  (gated or not), times the row's probability in the probabilities' dtype, cast back, fc2
  product (plus bias times the probability);
- the expert outputs are summed as the dispatchers' unpermute does (a scatter-add in expert
  order into zeros of the experts' dtype): row i gets 0 + y_e1 + y_e2 + ... over its experts in
  index order, and the unselected experts add an exact 0, which leaves a float sum unchanged.

So in fp32 the step equals megatron's MoE forward up to how the matrix-product kernels round a
row at another number of rows (megatron multiplies only the rows routed to an expert).

``moe_step_problem`` names what a layer has that the step does not reproduce (None: covered):
shared experts, experts with LoRA adapters, megatron's grouped-GEMM or transformer-engine experts (puzzle's GroupedGemmExperts
have SequentialMLP's experts and are covered), experts split over ranks (expert
parallelism E > 1 or expert tensor parallelism ETP > 1), token dropping, input jitter,
fused kernels, fp8.
"""

from __future__ import annotations

from typing import Optional

import torch

from puzzle.models.grouped_gemm import expert_activation


def moe_step_problem(mlp) -> Optional[str]:
    """What in ``mlp`` (a TransformerLayer's mlp) the static MoE step does not reproduce, or
    None when it reproduces megatron's MoELayer forward."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.router import TopKRouter

    from puzzle.models.moe_experts import GroupedGemmExperts

    if not isinstance(mlp, MoELayer):
        return f"the layer's MLP is {type(mlp).__name__}, not megatron's MoELayer"
    cfg = mlp.config
    if mlp.shared_experts is not None or cfg.moe_shared_expert_intermediate_size is not None:
        return "shared experts"
    if type(mlp.experts) not in (SequentialMLP, GroupedGemmExperts):  # the same experts and parameters
        return f"{type(mlp.experts).__name__} experts (only SequentialMLP)"
    if type(mlp.router) is not TopKRouter or mlp.router.routing_type == "sinkhorn":
        return f"router {type(mlp.router).__name__} ({getattr(mlp.router, 'routing_type', '?')})"
    if mlp.num_local_experts != cfg.num_moe_experts:
        return (f"experts split over E={cfg.num_moe_experts // mlp.num_local_experts} expert-parallel ranks "
                f"({mlp.num_local_experts} of {cfg.num_moe_experts} on this rank)")
    for expert in mlp.experts.local_experts:
        if type(expert) is not MLP or type(expert.linear_fc1) is not ColumnParallelLinear \
                or type(expert.linear_fc2) is not RowParallelLinear:
            return f"expert modules {type(expert).__name__} (only megatron's local MLP)"
        if _size(expert.linear_fc1.tp_group) > 1 or _size(expert.linear_fc2.tp_group) > 1:
            return f"experts split over ETP={_size(expert.linear_fc1.tp_group)} expert-tensor-parallel ranks"
        if any(linear._forward_hooks or hasattr(linear, "adapter") for linear in (expert.linear_fc1, expert.linear_fc2)):
            return "expert linears with LoRA adapters (merged into the generation copy's weights, they are not)"
    unsupported = {
        "moe_latent_size": getattr(cfg, "moe_latent_size", None),
        "moe_expert_capacity_factor": cfg.moe_expert_capacity_factor,
        "moe_input_jitter_eps": cfg.moe_input_jitter_eps,
        "moe_apply_probs_on_input": getattr(cfg, "moe_apply_probs_on_input", False),
        "moe_router_fusion": getattr(cfg, "moe_router_fusion", False),
        "moe_permute_fusion": cfg.moe_permute_fusion,
        "moe_router_force_load_balancing": getattr(cfg, "moe_router_force_load_balancing", False),
        "router_replay": getattr(mlp.router, "router_replay", None),
        "bias_activation_fusion": cfg.bias_activation_fusion,
        "use_te_activation_func": getattr(cfg, "use_te_activation_func", False),
        "activation_func_clamp_value": getattr(cfg, "activation_func_clamp_value", None),
        "fp8": cfg.fp8, "fp4": getattr(cfg, "fp4", None),
    }
    given = [f"{k}={v!r}" for k, v in unsupported.items() if v not in (None, False)]
    return ", ".join(given) or None


def moe_decode_mlp(mlp, x: torch.Tensor) -> torch.Tensor:
    """MoELayer.forward(x)[0] at eval with every local expert run on every row: x [1, n, h]
    (the pre-MLP norm's output) -> [1, n, h]. Static in shape, no host synchronisation."""
    probs, _ = mlp.router(x)  # [n, E]: the top-k probabilities, 0 elsewhere
    rows = x.reshape(-1, x.shape[-1])
    out = None
    for e, expert in enumerate(mlp.experts.local_experts):
        y = _expert_forward(expert, rows, probs[:, e])
        if out is None:  # the unpermute's accumulator: zeros of the experts' output dtype
            out = torch.zeros(rows.shape, dtype=y.dtype, device=y.device)
        out.add_(y)
    return out.to(x.dtype).view(x.shape)


def _expert_forward(expert, rows: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """megatron's MLP.forward(rows, per_token_scale=scale) without fused kernels, one expert."""
    fc1, fc2 = expert.linear_fc1, expert.linear_fc2
    inter = torch.matmul(rows, fc1.weight.t())
    if fc1.bias is not None:
        inter = inter + fc1.bias
    out = torch.matmul(expert_activation(expert, inter, scale), fc2.weight.t())
    if fc2.bias is not None:
        out += fc2.bias.unsqueeze(0) * scale.unsqueeze(-1)
    return out


def _size(group) -> int:
    return 1 if group is None else group.size()
