"""Patch: CUDA tensors over gloo process groups (several ranks sharing one GPU).

Several ranks can share one GPU only over gloo (NCCL refuses two ranks on a device;
``--distributed-backend gloo``). gloo's plain collectives stage CUDA tensors through pinned host
buffers themselves; two paths do not, and are patched here. Checked on torch 2.11 (GPU) with
megatron-core 0.16.1. Applied on CUDA machines only; NCCL groups and CPU tensors take the original
code.

1. Target: ``torch.distributed``'s ``send``, ``recv``, ``isend`` and ``irecv`` (the package's
   names and ``distributed_c10d``'s, which ``P2POp`` and ``batch_isend_irecv`` check and call), as
   used by megatron-core's pipeline schedules (``P2PCommunicator``), its resharding copy service
   and puzzle's own pipelines and switch. Reason: gloo's ``send``/``recv`` hand the tensor's raw
   pointer to the transport, which reads device memory as if it were host memory. A CUDA tensor on
   a gloo group is copied to the host before a send; a receive lands in a host buffer that is
   copied into the CUDA tensor when the work is waited on (``recv``: at once).
2. Target: ``megatron.core.distributed.param_and_grad_buffer._coalescing_manager`` (DDP's gradient
   reduction and parameter gathers). Reason: at its exit, torch's coalescing manager calls gloo's
   ``allreduce_coalesced``, which refuses CUDA tensors ("unsupported device type cuda"). On a gloo
   group the bucket collectives run one by one instead (synchronously: puzzle never overlaps
   them, and an asynchronous request is refused).

Remove when: gloo sends, receives and coalesces CUDA tensors itself.
"""

from __future__ import annotations

import contextlib

import torch

_applied = False
_NAMES = ("send", "recv", "isend", "irecv")


def _staged(tensor, group) -> bool:
    """Whether a message of ``tensor`` on ``group`` must go through host memory."""
    return torch.is_tensor(tensor) and tensor.is_cuda and _on_gloo(group)


def _fill(target: torch.Tensor, host: torch.Tensor) -> None:
    """The received values into ``target`` (pipeline schedules receive into leaf tensors that
    require grad: the copy is not part of any graph)."""
    with torch.no_grad():
        target.copy_(host)


class _HostReceive:
    """The work of a staged receive: waiting copies the host buffer into the CUDA tensor."""

    def __init__(self, work, host: torch.Tensor, target: torch.Tensor):
        self._work, self._host, self._target = work, host, target
        self._copied = False

    def wait(self, *args, **kwargs) -> bool:
        done = self._work.wait(*args, **kwargs)
        if not self._copied:
            _fill(self._target, self._host)
            self._copied = True
        return done

    def is_completed(self) -> bool:
        return self._copied

    def is_success(self) -> bool:
        return self._work.is_success()

    def source_rank(self) -> int:
        return self._work._source_rank()


def _wrap_send(original):
    def send(tensor, *args, **kwargs):
        group = _group_of(args, kwargs)
        if _staged(tensor, group):
            tensor = tensor.cpu()  # waits for the kernels that wrote it
        return original(tensor, *args, **kwargs)
    send.__doc__ = original.__doc__
    return send


def _wrap_receive(original, blocking: bool):
    def receive(tensor, *args, **kwargs):
        group = _group_of(args, kwargs)
        if not _staged(tensor, group):
            return original(tensor, *args, **kwargs)
        host = torch.empty(tensor.shape, dtype=tensor.dtype)
        result = original(host, *args, **kwargs)
        if blocking:  # recv returns the sender's rank
            _fill(tensor, host)
            return result
        return _HostReceive(result, host, tensor)
    receive.__doc__ = original.__doc__
    return receive


def _group_of(args, kwargs):
    """The ``group`` argument of send/recv/isend/irecv(tensor, peer, group, tag, ...)."""
    if "group" in kwargs:
        return kwargs["group"]
    return args[1] if len(args) > 1 else None


def _on_gloo(group) -> bool:
    """Whether ``group`` (None: the world) runs on gloo."""
    import torch.distributed as dist

    return dist.get_backend(group) == dist.Backend.GLOO


def _wrap_coalescing(original):
    @contextlib.contextmanager
    def coalescing_manager(group=None, device=None, async_ops=False):
        if not _on_gloo(group):
            with original(group, device, async_ops) as cm:
                yield cm
            return
        if async_ops:
            raise NotImplementedError("overlapped gradient reduction or parameter gathers over gloo "
                                      "(ranks sharing a GPU): use NCCL, one rank per GPU")
        yield None  # each collective inside runs at once, synchronously
    return coalescing_manager


def apply() -> None:
    global _applied
    if _applied:
        return
    import torch.distributed as dist
    from megatron.core.distributed import param_and_grad_buffer
    from torch.distributed import distributed_c10d as c10d

    for name in _NAMES:
        original = getattr(c10d, name)
        wrapped = _wrap_send(original) if "send" in name else _wrap_receive(original, blocking=name == "recv")
        setattr(c10d, name, wrapped)
        setattr(dist, name, wrapped)
    param_and_grad_buffer._coalescing_manager = _wrap_coalescing(param_and_grad_buffer._coalescing_manager)
    _applied = True
