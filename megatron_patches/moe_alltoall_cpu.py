"""Patch: megatron-core's all-to-all MoE token dispatcher on CPU tensors (gloo).

Target: ``megatron.core.transformer.moe.token_dispatcher.MoEAlltoAllTokenDispatcher`` through the
``maybe_move_tensor_to_cpu`` it imports from ``moe_utils``, checked on megatron-core 0.16.0 and
0.16.1. Applied only with the CPU backend.

Reason: the dispatcher computes its all-to-all split sizes as device tensors and turns them into
host numpy arrays with ``maybe_move_tensor_to_cpu(..., as_numpy=True)``, which converts only CUDA
tensors. On CPU the sizes stayed torch tensors, and ``torch.distributed.all_to_all_single``
rejects tensors as ``output_split_sizes`` / ``input_split_sizes`` (TypeError: incompatible
function arguments). The patch converts CPU tensors to numpy too when ``as_numpy`` is asked for,
exactly what the CUDA path returns; CUDA tensors take megatron's own code.

Remove when: megatron-core's ``maybe_move_tensor_to_cpu`` honours ``as_numpy`` for CPU tensors.
"""

from __future__ import annotations

import torch

_applied = False


def apply() -> None:
    global _applied
    if _applied:
        return
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    original = moe_utils.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    _applied = True
