"""The LoRA actor's generation copy: the frozen base laid out once, the adapters moved by every
switch and merged into the copy's weights for generation.

With LoRA the actor's base weights never change (puzzle/models/lora.py freezes them), so once the
switch has laid the base out on the generation ranks it stays there: the shadow model is kept
between iterations, and every later switch moves only the adapters (A and B of each target linear),
still exactly the adapter bytes each rank lacks (a routing table over the adapters' ParamSpecs:
column-parallel targets have A replicated and B split over T like the base weight, row-parallel
ones A split and B replicated).

Merged, not unmerged. For generation each adapted weight of the copy becomes
``W + (alpha / dim) B A`` (:meth:`MergedAdapters.merge`, computed in fp32, cast to the weight's
dtype) and the base comes back after generation (:meth:`MergedAdapters.unmerge`): the merged tensors
are new ones swapped in as the parameters' data, so the base is restored bit for bit (no
subtract-and-drift) and the merged copies live only as long as generation. Measured on the tiny
model (``python -m puzzle.bench.switch --only lora``, columns ``decode_*``): the merged copy
decodes through the lean decode step (and CUDA graphs on a GPU), which the adapters' forward hooks
rule out, and the merge costs about one decode step per switch; unmerged decoding would pay the
hooks, two more GEMMs per target linear and, at T > 1, one more all-reduce per row-parallel
target, on every decode step. The price: in bf16 a merged weight is rounded once more (the
adapter's update is rounded to the weight's precision), and the generation ranks hold the base in
the generation layout between iterations (the training ranks' frozen base is not in that layout).
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch

from puzzle.lora_config import LoRAConfig
from puzzle.models.init import param_specs, tp_split
from puzzle.models.lora import adapter_specs, local_adapter_specs
from puzzle.models.param_layout import ParamSpec, shard_slices


def adapter_param_specs(arch, role: str, lora: LoRAConfig) -> List[ParamSpec]:
    """The global ParamSpecs of every adapter (A, then B, of each target linear in the model's
    parameter order: every expert's too), split over T (an expert's over ETP, held by its
    expert-parallel rank) as puzzle/models/lora.py shards them."""
    out = []
    for spec in param_specs(arch, role):
        linear, _, last = spec.name.rpartition(".")
        target = linear.rsplit(".", 1)[-1]
        if last == "weight" and target in lora.target_modules:
            out.extend(adapter_specs(arch, lora, linear, target, spec))
    return out


def adapter_bytes(arch, role: str, lora: LoRAConfig, dtype_bytes: int) -> int:
    """Bytes of all adapters (each distinct tensor once)."""
    return sum(s.numel for s in adapter_param_specs(arch, role, lora)) * dtype_bytes


def _shard_shape(spec: ParamSpec, T: int, t: int) -> Tuple[int, ...]:
    k = spec.split_dim
    if k is None:
        return spec.global_shape
    shape = list(spec.global_shape)
    shape[k] = sum(b[k][1] - b[k][0] for b in shard_slices(spec, T, t))
    return tuple(shape)


class MergedAdapters:
    """This rank's adapter shards in the generation layout of ``module`` (written by the switch)
    and the merge of them into the module's target linears."""

    def __init__(self, module: torch.nn.Module, arch, role: str, lora: LoRAConfig):
        layout = module.puzzle_layout
        specs = {s.name: s for s in param_specs(arch, role)}
        self.scale = lora.scale
        self.tensors: Dict[str, torch.Tensor] = {}
        self.linears: List[Tuple[torch.nn.Module, str, str]] = []  # (linear, A's local name, B's)
        for local, _, linear, *adapter in local_adapter_specs(module, arch, role, lora, specs):
            names = (f"{local}.adapter.linear_in.weight", f"{local}.adapter.linear_out.weight")
            for name, spec in zip(names, adapter):
                self.tensors[name] = torch.empty(_shard_shape(spec, *tp_split(spec.name, layout)),
                                                 dtype=linear.weight.dtype,
                                                 device=linear.weight.device)
            self.linears.append((linear, *names))
        self._base: List[torch.Tensor] = []  # while merged: each linear's base weight

    @property
    def merged(self) -> bool:
        return bool(self._base)

    @torch.no_grad()
    def merge(self) -> None:
        """Each target weight becomes ``W + scale * B A`` (a new tensor; the base is kept)."""
        if self.merged:
            raise RuntimeError("the adapters are merged already")
        for linear, a, b in self.linears:
            base = linear.weight.data
            merged = torch.addmm(base.float(), self.tensors[b].float(), self.tensors[a].float(), alpha=self.scale)
            self._base.append(base)
            linear.weight.data = merged.to(base.dtype)

    def unmerge(self) -> None:
        """The base weights back (bit for bit); the merged copies are freed."""
        for (linear, _, _), base in zip(self.linears, self._base):
            linear.weight.data = base
        self._base = []
