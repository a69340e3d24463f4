"""The shadow generation model: the actor in its generation layout, alive only during generation.

PUZZLE §5.1: the actor trains in one layout and generates in another on the SAME ranks. The
training model (with its gradients and optimizer state) stays where it is; for generation a
second, weights-only GPTModel in the destination layout is allocated (:func:`build_shadow`),
filled by the switch (:func:`switch_to_generation`: routing table -> executor, moving only the
bytes each rank lacks) and freed after generation (:meth:`ShadowModel.release`).

The shadow is built with megatron's own (cheap, per-shard) initialisation
(``layout_independent_init=False``): every value is overwritten by the switch, so drawing the
layout-independent initial weights would be wasted work.
"""

from __future__ import annotations

import time
from typing import Dict, Optional

import torch

from puzzle.config import ModelArch
from puzzle.lora_config import LoRAConfig
from puzzle.models.init import param_specs
from puzzle.models.param_names import table_params
from puzzle.parallel.plan import ParallelPlan, PlanError
from puzzle.switch.lora_merge import MergedAdapters, adapter_param_specs
from puzzle.switch.overlap import step_and_switch
from puzzle.switch.routing import RoutingTable, build_routing_table
from puzzle.switch.routing_executor import fast_dispatch

_TABLES: Dict[tuple, RoutingTable] = {}


def process_rss_bytes() -> int:
    """Resident set size of this process (psutil), in bytes."""
    import psutil

    return int(psutil.Process().memory_info().rss)


def param_bytes(module: Optional[torch.nn.Module]) -> int:
    if module is None:
        return 0
    return sum(p.numel() * p.element_size() for p in module.parameters())


def routing_table_for(arch: ModelArch, role: str, src: ParallelPlan, dst: ParallelPlan,
                      dtype_bytes: int = 4, ranks_per_node: Optional[int] = None, *,
                      lora: Optional[LoRAConfig] = None, adapters_only: bool = False) -> RoutingTable:
    """The (cached) routing table of role ``role`` of shape ``arch`` from ``src`` to ``dst``; with
    ``lora`` the adapters' too (after the base), or ``adapters_only``. Raises PlanError when the plans
    do not cover the same ranks or the model does not split."""
    if adapters_only and lora is None:
        raise ValueError("adapters_only needs the LoRA config")
    key = (arch, role, src, dst, dtype_bytes, ranks_per_node, lora, adapters_only)
    if key not in _TABLES:
        for what, plan in (("source", src), ("destination", dst)):
            if not isinstance(plan, ParallelPlan):
                raise PlanError(f"{what} plan must be a ParallelPlan, got {type(plan).__name__}")
        if src.size != dst.size or src.offset != dst.offset:
            raise PlanError(f"cannot switch {role} between plans on different ranks: source {src} uses "
                            f"ranks {src.offset}..{src.offset + src.size - 1}, destination {dst} uses "
                            f"{dst.offset}..{dst.offset + dst.size - 1}")
        from puzzle.models.builders import check_layout

        check_layout(arch, src, f"{role} (switch source)")
        check_layout(arch, dst, f"{role} (switch destination)")
        specs = [] if adapters_only else param_specs(arch, role)
        if lora is not None:
            specs = specs + adapter_param_specs(arch, role, lora)
        _TABLES[key] = build_routing_table(specs, src, dst, dtype_bytes=dtype_bytes, ranks_per_node=ranks_per_node)
    return _TABLES[key]


class ShadowModel:
    """A weights-only model of ``role`` in ``plan``'s layout on this rank (``module`` None off-plan).

    With ``lora`` it also holds the adapters' shards in this layout (``adapters``, written by the
    switch), merged into the target weights for generation (:meth:`merge_adapters`).
    ``memory`` records RSS and parameter bytes at build and release."""

    def __init__(self, arch: ModelArch, role: str, plan: ParallelPlan, *, bf16: bool = False,
                 fp16: bool = False, seed: int = 0, transformer_impl: str = "local",
                 lora: Optional[LoRAConfig] = None):
        from puzzle.models.builders import build_role_model
        from puzzle.parallel.groups import layout_for

        self.arch, self.role, self.plan = arch, role, plan
        self.layout = layout_for(plan)  # collective (cached)
        rss0 = process_rss_bytes()
        t0 = time.perf_counter()
        # every weight is written by the switch: megatron's own (cheap) per-shard init only, for
        # the tensor-parallel attributes it sets; not the layout-independent one
        self.module = build_role_model(role, arch, self.layout, bf16=bf16, fp16=fp16, head_seed=seed,
                                       layout_independent_init=False,
                                       transformer_impl=transformer_impl)
        if self.module is not None:
            for p in self.module.parameters():
                p.requires_grad_(False)
            self.module.eval()
        self.adapters = MergedAdapters(self.module, arch, role, lora) if lora is not None and self.member else None
        self.memory = {"rss_before_build": rss0, "rss_after_build": process_rss_bytes(),
                       "param_bytes": param_bytes(self.module), "build_s": time.perf_counter() - t0}

    @property
    def member(self) -> bool:
        return self.module is not None

    def params(self) -> Dict[str, torch.Tensor]:
        """Parameters under the routing table's local names (see :func:`table_params`), the
        adapters' too (LoRA). The switch writes them: not while the adapters are merged."""
        if self.adapters is None:
            return table_params(self.module, self.role)
        if self.adapters.merged:
            raise RuntimeError("the shadow's adapters are merged: unmerge them before a switch")
        return {**table_params(self.module, self.role), **self.adapters.tensors}

    def merge_adapters(self) -> None:
        """LoRA: the target weights become base + adapter for generation (no-op without LoRA)."""
        if self.adapters is not None:
            self.adapters.merge()

    def unmerge_adapters(self) -> None:
        """LoRA: the base weights back; CUDA graphs captured on the merged weights are dropped."""
        if self.adapters is not None and self.adapters.merged:
            self.adapters.unmerge()
            if hasattr(self.module, "_puzzle_decode_graphs"):
                del self.module._puzzle_decode_graphs

    def param_bytes(self) -> int:
        return param_bytes(self.module)

    def release(self) -> dict:
        """Free the shadow model; returns the memory report (param bytes go to 0).

        Its tensors are freed by reference counting right here (the module holds no reference
        cycles; tests/distributed/worlds/switch.py checks with weak references). A full
        gc.collect() would cost ~0.2 s per iteration in a megatron process for nothing."""
        before = process_rss_bytes()
        self.module = self.adapters = None
        self.memory.update(rss_before_release=before, rss_after_release=process_rss_bytes(),
                           param_bytes_after_release=0)
        return dict(self.memory)

    def __call__(self, *args, **kwargs):
        if self.module is None:
            raise RuntimeError("shadow model released or not on this rank")
        return self.module(*args, **kwargs)


def build_shadow(engine_arch: ModelArch, role: str, dst_plan: ParallelPlan, **kw) -> ShadowModel:
    """Allocate the generation-layout model of ``role`` (collective: builds ``dst_plan``'s groups)."""
    return ShadowModel(engine_arch, role, dst_plan, **kw)


def _dtype_flags(engine) -> dict:
    """The shadow is built like the training model: same dtype and layer implementation."""
    dt = engine.config.params_dtype if engine.config is not None else torch.float32
    return {"bf16": dt == torch.bfloat16, "fp16": dt == torch.float16,
            "transformer_impl": getattr(engine, "transformer_impl", "local")}


def switch_to_generation(train_engine, dst_plan: ParallelPlan, segments: int = 1, *,
                         shadow: Optional[ShadowModel] = None, optimizer_step: bool = False,
                         group=None, bucket_bytes: Optional[int] = None,
                         ranks_per_node: Optional[int] = None, adapters_only: bool = False):
    """Switch ``train_engine`` (a ModelEngine) to ``dst_plan``: returns the ShadowModel whose
    parameters are the destination-layout slices of the training weights (collective).

    With ``optimizer_step`` the engine's optimizer step runs first, overlapped with the transfer
    in ``segments`` segments (:func:`puzzle.switch.overlap.step_and_switch`); the step's result
    is in ``shadow.step_result``. Without it the current weights are moved. ``shadow.switch_stats``
    holds this rank's :class:`~puzzle.switch.routing_executor.SwitchStats`. All plan checks run (and
    raise PlanError) before anything is allocated or sent.

    A LoRA actor (``train_engine.lora``) moves its adapters too, into the shadow's adapter shards;
    ``adapters_only``: only them, into ``shadow`` whose (frozen) base an earlier switch laid out."""
    src_plan = train_engine.layout.plan
    dtype = train_engine.config.params_dtype if train_engine.config is not None else torch.float32
    lora = getattr(train_engine, "lora", None)
    table = routing_table_for(train_engine.arch, train_engine.role, src_plan, dst_plan,
                              dtype_bytes=torch.tensor([], dtype=dtype).element_size(),
                              ranks_per_node=ranks_per_node, lora=lora, adapters_only=adapters_only)
    if shadow is None:
        if adapters_only:
            raise ValueError("adapters_only: the shadow holding the base is needed")
        shadow = build_shadow(train_engine.arch, train_engine.role, dst_plan, lora=lora, **_dtype_flags(train_engine))
    elif shadow.module is None and shadow.layout.member:
        raise RuntimeError("shadow model was released; build a new one")
    kw = {} if bucket_bytes is None else {"bucket_bytes": bucket_bytes}
    with fast_dispatch():
        dst_params = shadow.params()
    if optimizer_step:
        result, stats = step_and_switch(train_engine, table, dst_params, segments=segments, group=group, **kw)
        shadow.step_result = result
    else:
        from puzzle.switch.routing_executor import execute_routing

        with fast_dispatch():
            src_params = table_params(train_engine.module, train_engine.role)
        stats = execute_routing(table, src_params, dst_params, group=group, num_segments=segments, **kw)
        shadow.step_result = None
    shadow.switch_stats = stats
    shadow.table = table
    return shadow
