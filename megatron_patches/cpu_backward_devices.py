"""Patch: megatron-core's tensor-parallel communication functions allocate on the CPU inside
backward passes too.

Target: ``megatron.core.tensor_parallel.mappings`` (``_gather_along_last_dim``,
``_gather_along_first_dim``, ``_reduce_scatter_along_first_dim``, ``_AllToAll.forward``),
checked on megatron-core 0.16.0 and 0.16.1. Applied only with the CPU backend.

Reason: these functions allocate their outputs with ``device=torch.cuda.current_device()``. In a
forward pass the CPU backend's process-wide TorchFunctionMode (cpu_backend.py, step 1) maps that
device to the CPU, but the autograd engine runs backward functions without the Python
TorchFunctionMode stack, so the backward of the MoE token dispatchers (all-gather / reduce-
scatter over the expert groups, all-to-all) raised "Cannot access accelerator device when none
is available". The patch runs these four functions under a CudaToCpuMode of their own; the
arithmetic and the collectives are megatron's, unchanged.

Remove when: megatron-core allocates these outputs on the input's device.
"""

from __future__ import annotations

import functools

_applied = False


def _on_cpu(fn):
    from megatron_patches.cpu_backend import CudaToCpuMode

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with CudaToCpuMode():
            return fn(*args, **kwargs)

    return wrapper


def apply() -> None:
    global _applied
    if _applied:
        return
    from megatron.core.tensor_parallel import mappings

    for name in ("_gather_along_last_dim", "_gather_along_first_dim", "_reduce_scatter_along_first_dim"):
        setattr(mappings, name, _on_cpu(getattr(mappings, name)))
    mappings._AllToAll.forward = staticmethod(_on_cpu(mappings._AllToAll.forward))
    _applied = True
