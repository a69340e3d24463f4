"""LoRA adapters on megatron-core's parallel linears, sharded like the base weights over T.

Each adapted linear keeps its own parameters and names (init, HF mapping, the switch and checkpoints
see the base model unchanged) and gains a submodule ``adapter`` with ``linear_in`` (A, global
[dim, in]) and ``linear_out`` (B, global [out, dim]) as Megatron-Bridge names them; a forward hook
adds ``(alpha / dim) * B A dropout(x)`` to the linear's output.

- Column-parallel linears (linear_qkv, linear_fc1; input replicated, output split over T): A is
  replicated, B split along its output rows exactly like the base weight (the query groups of QKV,
  the gate and up halves of a SwiGLU fc1). The rank-dim activation ``A x`` is the same on every TP
  rank; its gradient is summed over the TP group (megatron's copy-to-region), so A's gradient is
  the whole one on every rank.
- Row-parallel linears (linear_proj, linear_fc2; input split over T): A is split along its input
  columns like the base weight, the partial products ``A_t x_t`` are all-reduced over the TP group
  (megatron's reduce-from-region), and B (replicated) maps the sum to the output, which is then the
  same on every TP rank, like the base linear's all-reduced output.

- The experts of a MoE layer (SequentialMLP's ``local_experts.<e>.linear_fc1/linear_fc2``; Bridge's
  meaning: the same target names adapt every expert, each with adapters of its own) are held by the
  ranks holding the expert and split over the expert-tensor-parallel ranks (ETP) like its weights.
  megatron's expert linears communicate nothing (``explicit_expert_comm``: the token dispatcher
  gathers the tokens over ETP before them and sums the partial fc2 outputs after them), and so do
  their adapters: fc1's ``B_t (A x)`` gives this rank's rows, fc2's ``B (A_t x_t)`` a partial output
  the dispatcher sums. The replicated factor (fc1's A, fc2's B) then has a partial gradient on each
  ETP rank, summed over the expert-TP group in the backward (megatron's copy-to-region applied to
  the weight). ``--moe-grouped-gemm`` experts (puzzle/models/moe_experts.py) add the same adapters
  as two more grouped products per projection (:func:`grouped_adapter_output`).

The base weights are frozen (``requires_grad`` False): megatron's DDP gives them no gradient buffer
and its optimizer no state. Adapters start layout-independent (puzzle/models/init.py's rule: each
whole tensor drawn from a generator seeded by its global name, each rank keeps its shard): A
Xavier-normal, B zero (Bridge's defaults), so a fresh adapter changes no output bit.
"""

from __future__ import annotations

import contextlib
import math
from typing import Dict, Iterator, Optional, Tuple

import torch

from puzzle.lora_config import COLUMN_TARGETS, LoRAConfig
from puzzle.models.init import _seed_for, dp_replica, layout_spec_name, local_shard, tp_split
from puzzle.models.param_layout import ParamSpec, resolve_layers_per_stage

ADAPTER_MARK = ".adapter."


def is_adapter_param(name: str) -> bool:
    """Whether a (local or global) parameter name is a LoRA adapter's."""
    return ADAPTER_MARK in name


class LoRAAdapter(torch.nn.Module):
    """The A and B shards of one linear on this rank, and how their product meets the TP group."""

    def __init__(self, target: str, dim: int, local_in: int, local_out: int, scale: float, dropout: float,
                 tp_group, dtype: torch.dtype, device, expert_comm: bool = False):
        """``expert_comm``: the adapted linear is an expert's with megatron's explicit expert
        communication (no collective in the linear; ``tp_group`` is then the expert-TP group)."""
        super().__init__()
        self.column = target in COLUMN_TARGETS
        self.scale, self.tp_group, self.expert_comm = scale, tp_group, expert_comm
        self.enabled = True  # False inside adapters_disabled: the linear is the base's
        self.dropout = torch.nn.Dropout(dropout) if dropout else None
        self.linear_in = torch.nn.Linear(local_in, dim, bias=False, dtype=dtype, device=device)
        self.linear_out = torch.nn.Linear(dim, local_out, bias=False, dtype=dtype, device=device)
        # megatron's TP attributes: grad norms count a split parameter on every TP rank, a replicated
        # one once; the split parameter is B of a column-parallel linear, A of a row-parallel one
        split, dim_of_split = (self.linear_out.weight, 0) if self.column else (self.linear_in.weight, 1)
        split.tensor_model_parallel, split.partition_dim, split.partition_stride = True, dim_of_split, 1

    def factors(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """(A, B) as the forward uses them: an expert's replicated factor (A of fc1, B of fc2)
        through megatron's copy-to-region over the expert-TP group, so that its partial gradients
        are summed there (identity in the forward)."""
        from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

        a, b = self.linear_in.weight, self.linear_out.weight
        if self.expert_comm:
            if self.column:
                a = copy_to_tensor_model_parallel_region(a, group=self.tp_group)
            else:
                b = copy_to_tensor_model_parallel_region(b, group=self.tp_group)
        return a, b

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import (copy_to_tensor_model_parallel_region,
                                                   reduce_from_tensor_model_parallel_region)

        if self.dropout is not None:
            x = self.dropout(x)
        if self.expert_comm:  # no collective: the dispatcher gathers the input and sums the output
            a, b = self.factors()
            return torch.nn.functional.linear(torch.nn.functional.linear(x, a), b) * self.scale
        low = torch.nn.functional.linear(x, self.linear_in.weight)
        if self.column:  # replicated A x: its gradient is the sum over the B shards of the TP group
            low = copy_to_tensor_model_parallel_region(low, group=self.tp_group)
        else:            # A_t x_t of each TP rank: summed before B
            low = reduce_from_tensor_model_parallel_region(low, group=self.tp_group)
        return torch.nn.functional.linear(low, self.linear_out.weight) * self.scale


def _add_adapter_output(linear, args, output):
    """Forward hook of an adapted linear: megatron's linears return (output, bias)."""
    if not linear.adapter.enabled:
        return output
    out, bias = output
    return out + linear.adapter(args[0]).to(out.dtype), bias


@contextlib.contextmanager
def adapters_disabled(module: torch.nn.Module):
    """Within: ``module`` (a model shard, wrapped or not) computes its base model, every adapter
    skipped -- a LoRA actor's reference (no model of its own: the same weights, adapters off)."""
    adapters = [m for m in module.modules() if isinstance(m, LoRAAdapter)]
    was = [a.enabled for a in adapters]
    for a in adapters:
        a.enabled = False
    try:
        yield
    finally:
        for a, on in zip(adapters, was):
            a.enabled = on


def target_linears(module: torch.nn.Module, lora: LoRAConfig) -> Iterator[Tuple[str, str, torch.nn.Module]]:
    """(local module name, target name, linear) of every linear ``lora`` adapts in ``module``."""
    for name, sub in module.named_modules():
        target = name.rsplit(".", 1)[-1]
        if target in lora.target_modules:  # an expert's linear_fc1 / linear_fc2 too
            yield name, target, sub


def local_adapter_specs(module: torch.nn.Module, arch, role: str, lora: LoRAConfig, specs: Dict[str, ParamSpec]):
    """(local module name, target name, linear, A's global spec, B's) of every linear ``lora``
    adapts in ``module`` (``specs``: the model's ParamSpecs by global name)."""
    layout = module.puzzle_layout
    lps = resolve_layers_per_stage(arch.num_layers, layout.plan.P)
    for local, target, linear in target_linears(module, lora):
        glob = layout_spec_name(local + ".weight", role, arch, layout, lps)[:-len(".weight")]
        yield (local, target, linear, *adapter_specs(arch, lora, glob, target, specs[glob + ".weight"]))


def grouped_adapter_output(x: torch.Tensor, offs: torch.Tensor, linears) -> Optional[torch.Tensor]:
    """The adapters' output of one projection of grouped experts (``linears``: each local expert's
    linear, ``x`` their tokens grouped by expert, ``offs`` the groups' end offsets): two grouped
    products, ``scale * B_e (A_e x)`` for the rows of expert e; None without enabled adapters."""
    from puzzle.models.grouped_gemm import grouped_linear

    adapters = [getattr(linear, "adapter", None) for linear in linears]
    if not adapters or not all(isinstance(a, LoRAAdapter) and a.enabled for a in adapters):
        return None
    if adapters[0].dropout is not None:
        x = adapters[0].dropout(x)
    factors = [a.factors() for a in adapters]
    low = grouped_linear(x, offs, [a for a, _ in factors])
    return grouped_linear(low, offs, [b for _, b in factors]) * adapters[0].scale


def adapter_specs(arch, lora: LoRAConfig, global_linear: str, target: str, base_spec: ParamSpec):
    """The ParamSpecs of A and B of one linear (global names and shapes, and their TP split; an
    expert's: its expert index too, split over ETP like the expert's weight)."""
    out, inp = base_spec.global_shape
    held = dict(layer=base_spec.layer, expert=base_spec.expert, num_experts=base_spec.num_experts)
    where = dict(held, split_units=base_spec.split_units, split_label=base_spec.split_label)
    a_name, b_name = f"{global_linear}.adapter.linear_in.weight", f"{global_linear}.adapter.linear_out.weight"
    if target in COLUMN_TARGETS:
        return (ParamSpec(a_name, (lora.dim, inp), "replicated", **held),
                ParamSpec(b_name, (out, lora.dim), base_spec.kind, **where))
    return (ParamSpec(a_name, (lora.dim, inp), "row", **where),
            ParamSpec(b_name, (out, lora.dim), "replicated", **held))


def adapter_init_value(spec: ParamSpec, seed: int, b_std: float = 0.0) -> torch.Tensor:
    """The whole initial value of A (Xavier-normal) or B (zero; N(0, b_std) where a test asks)."""
    if spec.name.endswith("linear_out.weight") and not b_std:
        return torch.zeros(spec.global_shape)
    fan_out, fan_in = spec.global_shape
    std = b_std if spec.name.endswith("linear_out.weight") else math.sqrt(2.0 / (fan_in + fan_out))
    gen = torch.Generator().manual_seed(_seed_for(seed, spec.name))
    return torch.randn(spec.global_shape, generator=gen) * std


def apply_lora(module: torch.nn.Module, arch, role: str, lora: LoRAConfig, seed: int, b_std: float = 0.0) -> dict:
    """Freeze ``module`` (one rank's shard of a GPTModel built by build_role_model) and give each
    target linear its adapter, initialised layout-independently; returns {local parameter name:
    global ParamSpec} of this rank's trained parameters: A and B of each linear, and a critic's
    (or reward model's) scalar head, which stays trainable whole (a fresh head on a frozen base
    could not learn values otherwise; [1, hidden]: nothing to save by adapting it)."""
    from puzzle.models.init import param_specs
    from puzzle.models.param_names import HEAD_SPEC_NAME, is_scalar_head

    layout = module.puzzle_layout
    specs = {s.name: s for s in param_specs(arch, role)}
    placed = {}
    for name, param in module.named_parameters():
        head = is_scalar_head(name, role)
        param.requires_grad_(head)
        if head:
            placed[name] = specs[HEAD_SPEC_NAME]
    for local, target, linear, a_spec, b_spec in local_adapter_specs(module, arch, role, lora, specs):
        ways = tp_split(a_spec.name, layout)  # an expert's: (ETP, etp), else (T, t)
        a = local_shard(a_spec, adapter_init_value(a_spec, seed, b_std), *ways)
        b = local_shard(b_spec, adapter_init_value(b_spec, seed, b_std), *ways)
        weight = linear.weight
        expert_comm = bool(getattr(linear, "explicit_expert_comm", False))
        # an expert's linear: its own (expert-TP) group, whole experts at T > 1 included (ETP = 1)
        group = linear.tp_group if getattr(linear, "is_expert", False) else layout.tp_group
        linear.adapter = LoRAAdapter(target, lora.dim, a.shape[1], b.shape[0], lora.scale, lora.dropout,
                                     group, weight.dtype, weight.device, expert_comm=expert_comm)
        with torch.no_grad():
            linear.adapter.linear_in.weight.copy_(a)
            linear.adapter.linear_out.weight.copy_(b)
        linear.register_forward_hook(_add_adapter_output)
        placed[f"{local}.adapter.linear_in.weight"] = a_spec
        placed[f"{local}.adapter.linear_out.weight"] = b_spec
    return placed


# ---- checkpoints: the adapters alone, resharded on load ------------------------------------------
def adapter_sharded_state_dict(module: torch.nn.Module, specs: dict) -> dict:
    """megatron dist_checkpointing's view of this rank's adapters (``specs``: apply_lora's {local
    name: global ParamSpec}): one ShardedTensor per adapter under its global name, split over T as
    the spec says (A of a row-parallel linear along its input, B of a column-parallel one along its
    output rows; a SwiGLU fc1's B as its gate and up halves), replicated ones written by TP rank 0
    of DP rank 0 (an expert's: split over ETP, written by expert-DP rank 0). Saved at one layout,
    loaded at any other (P, D, T, E)."""
    from megatron.core.dist_checkpointing import ShardedTensor

    layout = module.puzzle_layout
    params = dict(module.named_parameters())
    out = {}
    for local, spec in specs.items():
        p = params[local]
        T, t = tp_split(spec.name, layout)
        d = dp_replica(spec.name, layout)
        if spec.split_dim is None or T == 1:
            out[spec.name] = ShardedTensor.from_rank_offsets(spec.name, p, replica_id=(0, t, d))
        elif spec.kind == "swiglu_fc1":
            out[spec.name] = _halves_factory(spec.name, p, t, T, d)
        else:
            out[spec.name] = ShardedTensor.from_rank_offsets(spec.name, p, (spec.split_dim, t, T), replica_id=(0, 0, d))
    return out


def _halves_factory(key: str, param: torch.Tensor, t: int, T: int, d: int):
    """B of a SwiGLU fc1: TP rank t holds rows [gate_t; up_t] of the global [gate; up] -- two
    pieces, saved as fragments t and T + t of 2T along the rows, concatenated again on load."""
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    def build(key, data, replica_id, flattened_range):
        gate, up = torch.chunk(data, 2, dim=0)
        return [ShardedTensor.from_rank_offsets(key, gate, (0, t, 2 * T), replica_id=replica_id),
                ShardedTensor.from_rank_offsets(key, up, (0, T + t, 2 * T), replica_id=replica_id)]

    def merge(pieces):
        return torch.cat(pieces, dim=0)

    return ShardedTensorFactory(key, param, build, merge, replica_id=(0, 0, d))


@torch.no_grad()
def load_adapter_state(module: torch.nn.Module, specs: dict, state: dict) -> None:
    """Copy the loaded adapter shards (``state``: {global name: this rank's shard}) into ``module``."""
    params = dict(module.named_parameters())
    for local, spec in specs.items():
        value = state[spec.name]
        if tuple(value.shape) != tuple(params[local].shape):
            raise ValueError(f"adapter {spec.name}: loaded shard {tuple(value.shape)} != {tuple(params[local].shape)}")
        params[local].copy_(value)


def base_parameters(module: torch.nn.Module):
    """(name, parameter) of the base model only (the adapters left out)."""
    return [(n, p) for n, p in module.named_parameters() if not is_adapter_param(n)]


# ---- export: the adapters whole, or merged into the base --------------------------------------------
def gather_adapters(module, specs: dict, dst: int = 0):
    """Collective over the default group: {global name: whole tensor} of every adapter on rank
    ``dst`` (None elsewhere), from the shards of DP replica 0 (an expert's: of expert-DP replica 0;
    ``module`` None: a rank outside the model)."""
    import torch.distributed as dist

    from puzzle.models.param_layout import shard_slices

    mine = []
    if module is not None:
        lay, params = module.puzzle_layout, dict(module.named_parameters())
        for n, spec in specs.items():
            if dp_replica(spec.name, lay) == 0:
                mine.append((spec, *tp_split(spec.name, lay), params[n].detach().cpu().clone()))
    got = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        got = [None] * dist.get_world_size() if dist.get_rank() == dst else None
        dist.gather_object(mine, got, dst=dst)
        if dist.get_rank() != dst:
            return None
    whole = {}
    for spec, T, t, shard in (x for part in got for x in part):
        out = whole.setdefault(spec.name, torch.zeros(spec.global_shape, dtype=shard.dtype))
        k, off = spec.split_dim or 0, 0
        for box in shard_slices(spec, T, t):
            n = box[k][1] - box[k][0]
            out[tuple(slice(a, b) for a, b in box)] = shard.narrow(k, off, n)
            off += n
    return whole


@torch.no_grad()
def merge_adapters(module: torch.nn.Module) -> None:
    """W += (alpha / dim) B A on every adapted linear of ``module``, shard by shard (exact at any T:
    a column-parallel linear's rows are B's rows with the whole A, a row-parallel one's columns A's
    columns with the whole B); the adapters then stay disabled, so the model computes the same."""
    for sub in module.modules():
        adapter = getattr(sub, "adapter", None)
        if isinstance(adapter, LoRAAdapter):
            delta = adapter.linear_out.weight.float() @ adapter.linear_in.weight.float() * adapter.scale
            sub.weight.add_(delta.to(sub.weight.dtype))
            adapter.enabled = False
