"""Offload between stages (Megatron-LM RL's --rl-offload-optimizer-during-inference).

During generation a trainable model's gradients and optimizer states are not needed, nor a frozen
model's weights (the reference and the reward model run only in the scoring stage). They leave
the device for the stages that do not use them and come back, bitwise, before the stage that
does:

  * before generation: trainable models free their gradient buffers (megatron DDP's
    ``offload_grad_buffers``: the storage is released and comes back zeroed, which is what the
    next training step starts from anyway) and copy their optimizer states (Adam moments, fp32
    main parameters) to host memory; frozen models copy their weights to host memory;
  * before scoring: frozen models' weights come back;
  * before training: optimizer states and gradient buffers come back.

A copy moves a tensor's whole storage to a (pinned, on a GPU) host buffer and resizes the device
storage to zero, so every view of it (``param.main_grad``, the optimizer's references) stays
valid and sees the same bytes after the copy back. Copies are issued without blocking the host
(on a GPU they run in stream order: nothing reuses the memory before the copy has read it).
"""

from __future__ import annotations

from typing import Dict, Iterable, List

import torch


def _byte_view(storage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),), (1,))


class HostCopy:
    """The storages of ``tensors`` (each once; empty ones and those in ``keep`` skipped), moved to
    host memory by :meth:`offload` and back by :meth:`reload`."""

    def __init__(self, tensors: Iterable[torch.Tensor], keep: Iterable[torch.Tensor] = ()):
        kept = {t.untyped_storage().data_ptr() for t in keep}
        self.storages: Dict[int, object] = {}
        for t in tensors:
            s = t.untyped_storage()
            if s.nbytes() and s.data_ptr() not in kept:
                self.storages.setdefault(s.data_ptr(), s)
        self.host: List[torch.Tensor] = []

    @property
    def nbytes(self) -> int:
        return sum(h.numel() for h in self.host) if self.host else sum(s.nbytes() for s in self.storages.values())

    @property
    def offloaded(self) -> bool:
        return bool(self.host)

    def offload(self) -> None:
        if self.host:
            return
        for s in self.storages.values():
            pin = s.device.type == "cuda"
            host = torch.empty(s.nbytes(), dtype=torch.uint8, pin_memory=pin)
            host.copy_(_byte_view(s), non_blocking=pin)
            self.host.append(host)
            s.resize_(0)

    def reload(self) -> None:
        if not self.host:
            return
        for s, host in zip(self.storages.values(), self.host):
            s.resize_(host.numel())
            _byte_view(s).copy_(host, non_blocking=s.device.type == "cuda")
        self.host = []


def _inner_optimizers(optimizer) -> list:
    """The torch optimizers inside a megatron (possibly chained) optimizer."""
    chained = getattr(optimizer, "chained_optimizers", None)
    return [o.optimizer for o in (chained if chained is not None else [optimizer])
            if getattr(o, "optimizer", None) is not None]


def optimizer_tensors(optimizer) -> List[torch.Tensor]:
    """Every tensor a megatron optimizer keeps: its states and its (main) parameters."""
    out = []
    for inner in _inner_optimizers(optimizer):
        for group in inner.param_groups:
            out += [p for p in group["params"] if isinstance(p, torch.Tensor)]
        for state in inner.state.values():
            out += [v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    return out


class StageOffload:
    """What leaves the device before each stage and comes back before the stage that needs it
    (see the module docstring). ``engines``: role -> ModelEngine; inactive unless ``enabled``."""

    def __init__(self, engines: Dict[str, object], enabled: bool):
        self.engines, self.enabled = engines, enabled
        self.copies: Dict[str, HostCopy] = {}

    def _copy(self, role: str) -> HostCopy:
        """Built when first needed (Adam's states exist only after the first step)."""
        eng = self.engines[role]
        copy = self.copies.get(role)
        if copy is None or (eng.trainable and not copy.offloaded):
            model_params = list(eng.module.parameters())
            if eng.trainable:  # main parameters that are the model's own (fp32) stay
                keep = model_params + [b.param_data for b in eng.model.buffers if b.param_data is not None]
                copy = HostCopy(optimizer_tensors(eng.optimizer), keep=keep)
            else:
                copy = HostCopy(model_params)
            self.copies[role] = copy
        return copy

    def before(self, stage: str) -> None:
        if not self.enabled:
            return
        members = [(role, eng) for role, eng in self.engines.items() if eng.member]
        if stage == "generation":
            for role, eng in members:
                if eng.trainable:
                    eng.model.offload_grad_buffers(synchronize=False, empty_cache=False)
                self._copy(role).offload()
        elif stage == "scoring":
            for role, eng in members:
                if not eng.trainable:
                    self._copy(role).reload()
        elif stage == "training":
            for role, eng in members:
                if eng.trainable:
                    self._copy(role).reload()
                    eng.model.restore_grad_buffers(synchronize=False)
        else:
            raise ValueError(f"unknown stage {stage!r}")
