"""The device contract: which ``torch.device`` this rank computes on, and how values cross ranks.

One ``Runtime`` per process, made by ``init_distributed`` (puzzle/parallel/groups.py):

- ``device``: ``cuda:LOCAL_RANK`` on a CUDA machine (``LOCAL_RANK`` modulo the device count when
  several ranks share a device over gloo), ``cpu`` where megatron runs on the CPU backend
  (megatron_patches.cpu_backend). Every tensor that meets a model, a schedule, a sampler or
  a collective lives there: models are built there, rollout batches are assembled there, and the
  pipeline and generation buffers are allocated there.
- tensor collectives run on the world group or on the models' own groups (NCCL on GPUs, gloo on
  CPU), always with tensors on ``device``;
- ``object_group``: one gloo group over the whole world for Python objects (reward values,
  checkpoint metadata, flags), so no object ever travels through NCCL.

This is the only module that names the CUDA device type.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any, Iterable, List, Optional

import torch
import torch.distributed as dist

from puzzle.parallel import launcher


def accelerator_available() -> bool:
    """Whether models run on CUDA here (CUDA present and the CPU backend not forced)."""
    import megatron_patches

    return torch.cuda.is_available() and not megatron_patches.on_cpu()


def local_device() -> torch.device:
    """This process's compute device, from torchrun's LOCAL_RANK: ranks beyond the node's device
    count share devices (only gloo allows that; see ``device_sharing_problem``)."""
    if accelerator_available():
        return torch.device("cuda", launcher.local_rank() % torch.cuda.device_count())
    return torch.device("cpu")


def default_backend() -> str:
    """--distributed-backend's default: nccl on GPUs, gloo on the CPU."""
    return "nccl" if accelerator_available() else "gloo"


def device_sharing_problem(backend: str):
    """Why ``backend`` cannot run this node's ranks on its devices (None when it can): NCCL needs
    GPUs and refuses two ranks on one GPU, so more ranks than GPUs on a node need gloo."""
    if backend != "nccl":
        return None
    if not accelerator_available():
        return "--distributed-backend nccl: NCCL needs GPUs, and this run is on the CPU; use gloo"
    ranks, devices = launcher.local_world_size(), torch.cuda.device_count()
    if ranks <= devices:
        return None
    return (f"--distributed-backend nccl: {ranks} ranks on this node share {devices} GPU(s), and NCCL "
            "refuses two ranks on one device; start one rank per GPU, or pass --distributed-backend gloo "
            "to let ranks share a GPU (slower: collectives are staged through host memory)")


#: --distributed-timeout-minutes (Megatron-LM's default 10)
DEFAULT_TIMEOUT_MINUTES = 10.0


@dataclass
class Runtime:
    device: torch.device
    object_group: Optional[Any] = None  # gloo group over the world (None: world of one / no dist)
    # every process group's collective timeout (--distributed-timeout-minutes)
    timeout: datetime.timedelta = datetime.timedelta(minutes=DEFAULT_TIMEOUT_MINUTES)

    @property
    def on_accelerator(self) -> bool:
        return self.device.type != "cpu"

    def tensor(self, values, dtype=torch.float64) -> torch.Tensor:
        return torch.as_tensor(values, dtype=dtype, device=self.device)

    def all_reduce(self, values: Iterable[float], op: str = "sum") -> List[float]:
        """Reduce a short list of floats over the world (float64, on this rank's device)."""
        from puzzle.parallel.scope import scope_group, scope_size

        t = self.tensor(list(values))
        if dist.is_initialized() and scope_size() > 1:  # the world, or one pool of --rl-desired-lag
            dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
                                   "min": dist.ReduceOp.MIN}[op], group=scope_group())
        return t.tolist()

    def broadcast_object(self, obj, src: int = 0):
        """``obj`` of rank ``src`` on every rank, over the gloo object group."""
        from puzzle.parallel.scope import scope_object_group, scope_size

        if not dist.is_initialized() or scope_size() == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=scope_object_group(self.object_group))
        return box[0]

    def synchronize(self) -> None:
        if self.on_accelerator:
            torch.cuda.synchronize(self.device)

    def reset_peak_memory(self) -> None:
        if self.on_accelerator:
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak_memory_bytes(self) -> int:
        """Peak bytes allocated on this rank's accelerator since the last reset (0 on CPU)."""
        return int(torch.cuda.max_memory_allocated(self.device)) if self.on_accelerator else 0


_RUNTIME: Optional[Runtime] = None  # the one Runtime of this process (see the module doc)


def make_runtime(timeout: Optional[datetime.timedelta] = None) -> Runtime:
    """Create this process's Runtime (called once by init_distributed, collectively); ``timeout``
    (--distributed-timeout-minutes) bounds the collectives of the object group and of every group
    made later (puzzle.parallel.groups)."""
    global _RUNTIME
    device = local_device()
    if device.type != "cpu":
        torch.cuda.set_device(device)
    group = None
    if dist.is_initialized() and dist.get_world_size() > 1:
        group = dist.group.WORLD if dist.get_backend() == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    _RUNTIME = Runtime(device=device, object_group=group)
    if timeout is not None:
        _RUNTIME.timeout = timeout
    return _RUNTIME


def runtime() -> Runtime:
    """This process's Runtime (a CPU one before init_distributed, e.g. in pure unit tests)."""
    return _RUNTIME if _RUNTIME is not None else Runtime(device=local_device())


def check_on_device(what: str, device: torch.device, tensors: dict) -> None:
    """Raise naming the tensor when an input of a model call is not on the model's device."""
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor) and t.device != device:
            raise RuntimeError(f"{what}: input {name!r} is on {t.device}, the model on {device}")
