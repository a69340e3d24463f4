"""Layout-independent weight initialisation.

megatron-core initialises each rank's shard from its own RNG stream, so the same seed gives
different weights at different (P, D, T). Four models in four layouts, moved between layouts by
the switch, need one model whatever the layout: every parameter is drawn whole from a generator
seeded by (seed, global parameter name), and each rank keeps its shard (puzzle.models.param_layout
describes the shards). Distributions follow megatron: N(0, std) for weights, N(0, std/sqrt(2L))
for the output projections of attention and MLP, ones for norm weights, zeros for biases.

Drawing whole tensors costs O(model size) per rank: fine for tests and small models; real runs
load checkpoints (HF import or dist-checkpoint) instead.
"""

from __future__ import annotations

import hashlib
import math
import re

import torch

from puzzle.config import ROLES, ModelArch
from puzzle.models.param_layout import global_name, gpt_param_specs, resolve_layers_per_stage, shard_slices
from puzzle.models.param_names import HEAD_LOCAL_NAME, HEAD_SPEC_NAME, canonical_param_name, is_scalar_head


def param_specs(arch: ModelArch, role: str):
    return gpt_param_specs(
        num_layers=arch.num_layers, hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size, num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_query_groups, padded_vocab_size=arch.padded_vocab_size,
        swiglu=arch.swiglu, add_bias_linear=arch.add_bias_linear,
        untie_embeddings=arch.untie_embeddings_and_output_weights,
        normalization=arch.normalization, head=ROLES[role].head, kv_channels=arch.kv_channels,
        position_embedding_type=arch.position_embedding_type,
        max_sequence_length=arch.max_position_embeddings,
        add_qkv_bias=arch.add_qkv_bias, qk_layernorm=arch.qk_layernorm,
        num_experts=arch.num_experts, moe_ffn_hidden_size=arch.moe_ffn_hidden_size,
        moe_layers=[arch.is_moe_layer(i) for i in range(arch.num_layers)] if arch.is_moe else None,
    )


_LOCAL_EXPERT = re.compile(r"(\.mlp\.experts\.local_experts\.)(\d+)\.")


def spec_name_of(local: str, role: str, arch: ModelArch, p: int, layers_per_stage, experts_offset: int = 0) -> str:
    """The global canonical spec name of a module parameter on stage ``p``, whichever layer
    spec (local or transformer_engine) built it. ``experts_offset``: the global index of the
    rank's first local expert (expert parallelism, :func:`experts_offset`)."""
    if is_scalar_head(local, role):
        return HEAD_SPEC_NAME
    if local == HEAD_LOCAL_NAME and not arch.untie_embeddings_and_output_weights:
        return "embedding.word_embeddings.weight"  # the last stage's copy of tied word embeddings
    name = global_name(canonical_param_name(local), p, layers_per_stage)
    if experts_offset:
        name = _LOCAL_EXPERT.sub(lambda m: f"{m.group(1)}{int(m.group(2)) + experts_offset}.", name)
    return name


def is_expert_param(name: str) -> bool:
    """Whether a (local or global) parameter name is an expert's (split by E and ETP, not T)."""
    return ".mlp.experts." in name


def experts_offset(arch: ModelArch, layout) -> int:
    """Global index of the first expert this rank holds (experts split in E contiguous blocks)."""
    return layout.ep * (arch.num_experts // layout.plan.E) if arch.is_moe else 0


def layout_spec_name(local: str, role: str, arch: ModelArch, layout, layers_per_stage) -> str:
    """spec_name_of for a rank of ``layout`` (its stage and its experts)."""
    return spec_name_of(local, role, arch, layout.p, layers_per_stage, experts_offset(arch, layout))


def tp_split(name: str, layout):
    """(ways, this rank's index) of the tensor-parallel split of parameter ``name``: the expert
    tensor-parallel split for experts, else the model's T."""
    if is_expert_param(name):
        return layout.plan.ETP, layout.etp
    return layout.plan.T, layout.t


def dp_replica(name: str, layout) -> int:
    """This rank's data-parallel replica index for parameter ``name``: the expert data-parallel
    one for experts (a copy is written once, by replica 0), else the model's."""
    return layout.edp if is_expert_param(name) else layout.d


def _seed_for(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def global_init_value(spec, arch: ModelArch, seed: int) -> torch.Tensor:
    """The whole (unsharded) initial value of one parameter, fp32."""
    base = spec.name.rsplit(".", 1)[-1]
    if "norm" in spec.name and base == "weight":
        return torch.ones(spec.global_shape)
    if base == "bias":
        return torch.zeros(spec.global_shape)
    std = arch.init_method_std
    if spec.name.endswith("linear_proj.weight") or spec.name.endswith("linear_fc2.weight"):
        std = std / math.sqrt(2.0 * arch.num_layers)
    gen = torch.Generator().manual_seed(_seed_for(seed, spec.name))
    return torch.randn(spec.global_shape, generator=gen) * std


def local_shard(spec, full: torch.Tensor, T: int, t: int) -> torch.Tensor:
    pieces = [full[tuple(slice(a, b) for a, b in box)] for box in shard_slices(spec, T, t)]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=spec.split_dim)


@torch.no_grad()
def init_layout_independent(module: torch.nn.Module, arch: ModelArch, role: str, seed: int) -> None:
    """Overwrite every parameter of ``module`` (one rank's shard) with its layout-independent value."""
    layout = module.puzzle_layout
    plan = layout.plan
    specs = {s.name: s for s in param_specs(arch, role)}
    lps = resolve_layers_per_stage(arch.num_layers, plan.P)
    for local, param in module.named_parameters():
        name = layout_spec_name(local, role, arch, layout, lps)
        if name not in specs:
            raise KeyError(f"{role}: parameter {local} (global {name}) has no layout description")
        spec = specs[name]
        value = local_shard(spec, global_init_value(spec, arch, seed), *tp_split(name, layout))
        if tuple(value.shape) != tuple(param.shape):
            raise RuntimeError(f"{role}: {local} local shape {tuple(param.shape)} != expected "
                               f"{tuple(value.shape)} at plan {plan}")
        param.copy_(value.to(param.dtype))
