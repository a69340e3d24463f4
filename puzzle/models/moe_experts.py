"""Grouped-GEMM experts for megatron-core's MoELayer (``--moe-grouped-gemm``).

megatron's SequentialMLP runs one MLP per local expert: it reads the per-expert token counts on
the host (``tokens_per_expert.tolist()``), splits the permuted tokens and makes two matrix
products per expert. ``GroupedGemmExperts`` keeps SequentialMLP's modules and parameters (the
same names, shapes and sharding: import/export, checkpoints, the switch and the optimizer see
no difference) and runs each projection of all local experts as one ``torch._grouped_mm`` call
over the permuted tokens, with the group offsets taken on the device from the counts: no host
synchronisation, one kernel per projection. On CUDA (bf16, sm90) that is CUTLASS's grouped GEMM;
elsewhere torch runs one product per group. LoRA adapters on the experts' linears (their forward
hooks never run here) add two more grouped products per projection.

megatron's own grouped experts (GroupedMLP, TEGroupedMLP) store every expert's weights in one
tensor and need the grouped_gemm package or transformer-engine; these need neither.

The arithmetic is megatron's ``MLP.forward`` with ``per_token_scale`` (no fused kernels), expert
by expert: fc1 product, activation (gated or not), times the token's probability in the
probabilities' dtype, cast back, fc2 product (puzzle/models/grouped_gemm.py). Experts with
biases and the fused, fp8 and latent paths are refused (``grouped_gemm_problem``); shapes the
kernel cannot take (strides not 16-byte multiples) are refused with the flags (puzzle.arguments).
"""

from __future__ import annotations

from typing import List

import torch
from megatron.core.transformer.moe.experts import SequentialMLP

from puzzle.models.grouped_gemm import expert_activation, grouped_gemm_problem, grouped_linear


class GroupedGemmExperts(SequentialMLP):
    """SequentialMLP's experts and parameters, each projection of all of them one grouped GEMM."""

    def __init__(self, num_local_experts, config, submodules, pg_collection=None):
        problem = grouped_gemm_problem(config)
        if problem is not None:
            raise ValueError(f"--moe-grouped-gemm does not support {problem}")
        super().__init__(num_local_experts, config, submodules, pg_collection=pg_collection)

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor):
        x = permuted_local_hidden_states
        offs = torch.cumsum(tokens_per_expert.to(device=x.device), 0).to(torch.int32)
        experts: List = list(self.local_experts)
        inter = _with_adapters(grouped_linear(x, offs, [e.linear_fc1.weight for e in experts]), x, offs,
                               [e.linear_fc1 for e in experts])
        inter = expert_activation(experts[0], inter, permuted_probs)
        out = grouped_linear(inter, offs, [e.linear_fc2.weight for e in experts])
        return _with_adapters(out, inter, offs, [e.linear_fc2 for e in experts]), None


def _with_adapters(out: torch.Tensor, x: torch.Tensor, offs: torch.Tensor, linears) -> torch.Tensor:
    """``out`` plus the LoRA adapters' output of the projection (puzzle/models/lora.py), if any."""
    from puzzle.models.lora import grouped_adapter_output

    delta = grouped_adapter_output(x, offs, linears)
    return out if delta is None else out + delta.to(out.dtype)
