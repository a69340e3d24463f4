"""``--attention-backend``: which core attention a model's layers use (Megatron-LM's names).

- ``flash`` / ``fused`` / ``unfused``: transformer-engine's DotProductAttention with that kernel
  family (megatron-core sets TE's NVTE_* switches from ``TransformerConfig.attention_backend``).
  Without TE, ``unfused`` is megatron-core's own DotProductAttention in the local spec (the CPU
  path); ``flash`` and ``fused`` need TE.
- ``local``: the local spec with puzzle's SDPA core attention (puzzle/models/sdpa_attention.py).
- ``auto``: TE (its own kernel choice) when TE is present; otherwise SDPA on CUDA; otherwise, on
  CPU, megatron-core's unfused DotProductAttention (so CPU results stay what they were).

Every choice keeps the generation KV cache (see sdpa_attention.py). The local-spec layers are
megatron's TransformerLayer with a lean decode step (decode_layer.py).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

from puzzle.model_arch import ATTENTION_BACKENDS


def resolve_attention_backend(backend: str, *, te: bool, cuda: bool) -> Tuple[str, Optional[str]]:
    """(layer spec, TE attention backend): spec is ``te``, ``sdpa`` or ``unfused``; the second
    item is the AttnBackend name megatron-core gives TE (None without TE)."""
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"--attention-backend must be one of {', '.join(ATTENTION_BACKENDS)} "
                         f"(got {backend!r})")
    if backend == "local":
        return "sdpa", None
    if te:
        return "te", backend
    if backend in ("flash", "fused"):
        raise ValueError(f"--attention-backend {backend} needs transformer-engine on a CUDA device "
                         "(not available here); use local (SDPA) or unfused")
    if backend == "unfused" or not cuda:
        return "unfused", None
    return "sdpa", None


def attention_choice(backend: str, transformer_impl: str) -> Tuple[str, Optional[str]]:
    """resolve_attention_backend for a model built with ``transformer_impl`` on this machine."""
    from puzzle.parallel.device import accelerator_available

    return resolve_attention_backend(backend, te=transformer_impl == "transformer_engine",
                                     cuda=accelerator_available())


def te_attention_config(backend: str, transformer_impl: str) -> dict:
    """TransformerConfig arguments: TE's kernel family (megatron sets TE's switches from it)."""
    te = attention_choice(backend, transformer_impl)[1]
    if te is None:
        return {}
    from megatron.core.transformer.enums import AttnBackend

    return {"attention_backend": AttnBackend[te]}


def attention_layer_spec(normalization: str, backend: str, transformer_impl: str,
                         qk_layernorm: bool = False, num_experts=None, moe_grouped_gemm: bool = False):
    """megatron-core GPT layer spec whose core attention is the one ``backend`` names
    (``num_experts``: its MLP is megatron-core's MoELayer with SequentialMLP experts, or with
    ``moe_grouped_gemm`` puzzle/models/moe_experts.py's GroupedGemmExperts, the same parameters).

    (megatron-core 0.16's TE spec has no ``normalization`` argument: TE's fused layernorm-linear
    modules take the norm type from the TransformerConfig.)"""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    from puzzle.models import sdpa_attention as sa

    spec = attention_choice(backend, transformer_impl)[0]
    if spec == "te":
        if num_experts:
            raise ValueError("MoE models run megatron-core's local layer spec: use --transformer-impl local "
                             "(the transformer-engine MoE spec is not supported yet)")
        layer = specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm)
    else:
        layer = specs.get_gpt_layer_local_spec(normalization=normalization, qk_layernorm=qk_layernorm,
                                               num_experts=num_experts)
    attn = layer.submodules.self_attention
    core = attn.submodules.core_attention
    if spec == "te":
        core = sa.with_kv_cache(getattr(core, "module", core))
    else:
        core = sa.SDPACoreAttention if spec == "sdpa" else sa.UnfusedCoreAttention
    attn = dataclasses.replace(attn, submodules=dataclasses.replace(attn.submodules,
                                                                    core_attention=core))
    layer = dataclasses.replace(layer, submodules=dataclasses.replace(layer.submodules,
                                                                      self_attention=attn))
    if num_experts and moe_grouped_gemm:
        from puzzle.models.moe_experts import GroupedGemmExperts

        mlp = layer.submodules.mlp
        experts = dataclasses.replace(mlp.submodules.experts, module=GroupedGemmExperts)
        mlp = dataclasses.replace(mlp, submodules=dataclasses.replace(mlp.submodules, experts=experts))
        layer = dataclasses.replace(layer, submodules=dataclasses.replace(layer.submodules, mlp=mlp))
    if spec != "te":  # megatron's layer with a lean KV-cache decode step (decode_layer.py)
        from puzzle.models.decode_layer import DecodeTransformerLayer

        layer = dataclasses.replace(layer, module=DecodeTransformerLayer)
    return layer
