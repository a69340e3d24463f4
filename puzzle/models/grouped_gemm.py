"""The grouped products of ``--moe-grouped-gemm`` (pure torch; the experts module that uses them
is puzzle/models/moe_experts.py).

``grouped_linear`` multiplies each group of rows (the tokens routed to one expert, in expert
order) by its expert's weight, transposed, in one ``torch._grouped_mm`` call: CUTLASS's grouped
GEMM on CUDA (bf16, sm90), one product per group elsewhere. It stacks the experts' weights for
each call, forward and backward (a transient copy; nothing stacked is kept for the backward), and
returns each expert's weight gradient to its own parameter. ``mlp_activation`` is megatron's
``MLP.forward`` activation between its two products, and ``expert_activation`` the same times each
routed token's probability; ``grouped_gemm_problem`` names what the grouped experts do not
reproduce.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch


def grouped_gemm_problem(config) -> Optional[str]:
    """What in a TransformerConfig the grouped experts do not reproduce, or None."""
    unsupported = {
        "add_bias_linear": config.add_bias_linear,
        "bias_activation_fusion": config.bias_activation_fusion,
        "use_te_activation_func": getattr(config, "use_te_activation_func", False),
        "activation_func_clamp_value": getattr(config, "activation_func_clamp_value", None),
        "moe_latent_size": getattr(config, "moe_latent_size", None),
        "moe_apply_probs_on_input": getattr(config, "moe_apply_probs_on_input", False),
        "fp8": config.fp8, "fp4": getattr(config, "fp4", None),
    }
    given = [f"{k}={v!r}" for k, v in unsupported.items() if v not in (None, False)]
    return ", ".join(given) or None


class _GroupedLinear(torch.autograd.Function):
    """x [N, in] (rows grouped by expert, ``offs`` the groups' int32 end offsets), weights E x
    [out, in] -> [N, out]; row r of group e is x[r] @ weights[e].T."""

    @staticmethod
    def forward(ctx, x, offs, *weights):
        ctx.save_for_backward(x, offs, *weights)
        return torch._grouped_mm(x, torch.stack(weights).transpose(1, 2), offs=offs)

    @staticmethod
    def backward(ctx, grad):
        x, offs, *weights = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = torch._grouped_mm(grad, torch.stack(weights), offs=offs) if ctx.needs_input_grad[0] else None
        # [out, N] x [N, in] split along N: one [out, in] product per group; an empty group's is 0
        grad_w = torch._grouped_mm(grad.t(), x, offs=offs)
        counts = torch.diff(offs, prepend=offs.new_zeros(1))
        grad_w = grad_w.masked_fill((counts == 0).view(-1, 1, 1), 0)
        return (grad_x, None, *grad_w.unbind(0))


def grouped_linear(x: torch.Tensor, offs: torch.Tensor, weights: Sequence[torch.Tensor]) -> torch.Tensor:
    """Each group of rows of ``x`` times its expert's weight, transposed (see _GroupedLinear)."""
    return _GroupedLinear.apply(x, offs, *weights)


def mlp_activation(mlp, inter: torch.Tensor) -> torch.Tensor:
    """megatron's MLP.forward activation without fused kernels: gated (SwiGLU and the like:
    the first half through the activation times the second half) or not."""
    cfg = mlp.config
    if cfg.gated_linear_unit:
        x_glu, x_linear = torch.chunk(inter, 2, dim=-1)
        return cfg.activation_func(x_glu) * (x_linear + cfg.glu_linear_offset)
    return mlp.activation_func(inter)


def expert_activation(expert, inter: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """megatron's MLP.forward between its two products with ``per_token_scale`` (no fused
    kernels): the activation times each row's probability in the probabilities' dtype, cast back."""
    inter = mlp_activation(expert, inter)
    dtype = inter.dtype
    return (inter * scale.unsqueeze(-1)).to(dtype)
