"""Patch: megatron-core's all-gather with split sizes over gloo groups.

Target: ``megatron.core.tensor_parallel.mappings._gather_along_first_dim`` when it is given
``output_split_sizes`` (``gather_from_sequence_parallel_region(..., output_split_sizes=...)``),
checked on megatron-core 0.16.0 and 0.16.1. CPU and GPU; only groups whose backend is gloo.

Reason: the all-to-all MoE token dispatcher at expert tensor parallelism ETP > 1 gathers the
tokens each ETP rank received for its experts, a different number per rank, with
``output_split_sizes``; megatron then calls ``torch.distributed.all_gather`` with tensors of
different sizes, which gloo refuses ("ProcessGroupGloo::allgather: invalid tensor size"), with
packed micro-batches as with padded ones. On gloo groups the patch pads each rank's tensor to the
largest split, all-gathers equal sizes and keeps each rank's rows: the same result. The backward
(a reduce-scatter with ``input_split_sizes``) is megatron's: gloo's reduce_scatter takes tensors
of different sizes. Equal splits, no splits and other backends run megatron's code unchanged.

Remove when: torch's gloo all-gather takes tensors of different sizes, or megatron-core pads them.
"""

from __future__ import annotations

import functools

_applied = False


def _on_gloo(group) -> bool:
    import torch.distributed as dist

    return dist.get_backend(group) == "gloo"


def _padded_gather(input_, group, output_split_sizes):
    """Rank r's ``output_split_sizes[r]`` rows of ``input_`` concatenated in rank order."""
    import torch
    import torch.distributed as dist

    most = max(output_split_sizes)
    padded = torch.cat([input_, input_.new_zeros((most - input_.shape[0],) + tuple(input_.shape[1:]))])
    out = input_.new_empty((most * len(output_split_sizes),) + tuple(input_.shape[1:]))
    dist.all_gather_into_tensor(out, padded.contiguous(), group=group)
    return torch.cat([chunk[:n] for chunk, n in zip(out.split(most), output_split_sizes)])


def _make_gather(original):
    @functools.wraps(original)
    def _gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        if (output_split_sizes is None or len(set(output_split_sizes)) <= 1 or group is None
                or group.size() == 1 or not _on_gloo(group)):
            return original(input_, group, output_split_sizes, use_global_buffer)
        return _padded_gather(input_, group, [int(n) for n in output_split_sizes])

    _gather_along_first_dim._moe_gloo_split_gather = True
    return _gather_along_first_dim


def apply() -> None:
    global _applied
    if _applied:
        return
    from megatron.core.tensor_parallel import mappings

    if not getattr(mappings._gather_along_first_dim, "_moe_gloo_split_gather", False):
        mappings._gather_along_first_dim = _make_gather(mappings._gather_along_first_dim)
    _applied = True
