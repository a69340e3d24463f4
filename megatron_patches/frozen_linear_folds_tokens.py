"""Patch: a frozen-weight linear computes its forward product exactly as a trainable one does.

Target: ``megatron.core.tensor_parallel.layers.LinearWithFrozenWeight.forward`` (what
``linear_with_frozen_weight`` runs for every Column/RowParallelLinear whose weight does not
require grad: a frozen reference, a reward model), checked on megatron-core 0.16.0 and 0.16.1.

Reason: megatron states that this op and ``LinearWithGradAccumulationAndAsyncCommunication`` (the
trainable linear) perform mathematically identical forwards; both call
``torch.matmul(input, weight.t())``, yet they do not compute the same bits. For a 3-d input
torch's matmul folds the tokens into one matrix product (``mm``) when the weight requires grad
and the input is contiguous, but for a weight without grad it folds only when the input's
strides are the canonical ones, size-1 dimensions included; otherwise it runs a batched product
(``bmm``), which sums in another order. megatron's embedding hands the first layer an
``[s, 1, h]`` tensor transposed from ``[1, s, h]`` (every packed THD micro-batch, every padded
micro-batch of one row): contiguous, but its size-1 dimension has stride ``s * h``. So a frozen
reference and the actor with the same weights, the same layout and the same input gave
log-probs ~1e-8 apart (the packed tiny PPO run's ``kl`` at iteration 1 was -1.2e-8 at T=2, not 0).
The patch folds the tokens whenever the trainable linear does (3-d or more, contiguous input:
one ``mm`` over ``[tokens, in]``, a view), and otherwise calls torch's matmul as megatron does;
the backward is megatron's, unchanged.

Remove when: megatron-core's frozen-weight linear folds its input into one matrix product as the
trainable one does, or torch's matmul stops choosing its kernel by the weight's requires_grad.
"""

from __future__ import annotations

_applied = False


def frozen_forward(ctx, input, weight, bias, allreduce_dgrad, tp_group):
    """megatron's ``LinearWithFrozenWeight.forward`` with the trainable linear's token folding."""
    import torch

    ctx.save_for_backward(weight)
    ctx.allreduce_dgrad = allreduce_dgrad
    ctx.tp_group = tp_group
    if input.dim() > 2 and input.is_contiguous():
        rows = input.reshape(-1, input.shape[-1])  # a view: contiguous up to size-1 strides
        output = torch.matmul(rows, weight.t()).view(*input.shape[:-1], weight.shape[0])
    else:
        output = torch.matmul(input, weight.t())
    if bias is not None:
        output = output + bias
    return output


def apply() -> None:
    global _applied
    if _applied:
        return
    from megatron.core.tensor_parallel import layers

    layers.LinearWithFrozenWeight.forward = staticmethod(layers.custom_fwd(frozen_forward))
    _applied = True
