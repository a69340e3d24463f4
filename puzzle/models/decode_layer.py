"""megatron-core's TransformerLayer with a lean forward for the KV-cache decode step.

``DecodeTransformerLayer`` is the ``module`` of the local layer spec (puzzle/models/
attention_backend.py). Its forward is megatron-core's own, unchanged, except in one case: a
decode step of generation (a StaticKVCache bound to the core attention and in decode mode, eval
mode, gradients off). There it runs the same arithmetic on the same modules and parameters
without megatron's per-layer Python plumbing (autograd-function wrappers of every linear layer,
tensor-parallel region copies that are identities in the forward, bias-dropout-add factories,
offload and recompute contexts, view checks), a sizeable share of a small decode step on a CPU
(docs/benchmarks.md "Generation"):

- ``input_layernorm``, ``q_layernorm`` / ``k_layernorm``, ``pre_mlp_layernorm`` and the core
  attention are called as modules (any norm, any KV-cache core attention);
- every linear layer is ``matmul(x, weight.t())`` plus its bias, as megatron's
  ``LinearWithFrozenWeight``; row-parallel outputs are all-reduced over the layer's TP group
  before their bias, as ``RowParallelLinear``;
- the query/key/value split, the gated linear unit and the residual additions follow
  ``Attention.get_query_key_value_tensors``, ``MLP.forward`` and ``_bias_dropout_add_func``
  (eval) operation for operation, so the step's outputs are bitwise those of the full forward.

``decode_forward`` runs a whole decode step of a GPTModel stage that way (embedding, lean layers,
final norm, output-layer product), without GPTModel's and TransformerBlock's per-call plumbing.

MoE layers (megatron's MoELayer with SequentialMLP experts whole on the rank) take the lean
step only when the cache has static shapes (``static_shapes``: the CUDA-graph decode's cache,
puzzle/rollout/cuda_graphs.py); their MLP is then puzzle/models/moe_decode.py's static step,
every expert on every row weighted by the router's probabilities. Elsewhere they run megatron's
forward, whose dispatchers compute only the routed rows.

Layers whose modules or options the lean step does not cover (transformer-engine modules, MoE
layers ``moe_step_problem`` names, attention output gates, fewer query groups than TP ranks,
fused bias-activation kernels, fp8, sequence parallelism, linears with forward hooks such as LoRA
adapters) always run megatron's forward. The
step is static in shape and free of host synchronisation, so CUDA graphs capture it like the
full forward.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from megatron.core.transformer.transformer_layer import TransformerLayer

from puzzle.models import batch_invariant
from puzzle.models.grouped_gemm import mlp_activation


class DecodeTransformerLayer(TransformerLayer):
    """TransformerLayer whose KV-cache decode step skips megatron's per-layer plumbing."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._lean: Optional[bool] = None  # whether the lean step covers this layer (decided once)
        self._tp_reduce = False            # row-parallel outputs are all-reduced (TP > 1)
        self._moe = False                  # the MLP is a MoELayer (lean on static-shape caches only)

    def forward(self, *args, **kwargs):
        if self._decodes():
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            return self._decode_step(hidden), kwargs.get("context")
        return super().forward(*args, **kwargs)

    def _decodes(self) -> bool:
        if self.training or torch.is_grad_enabled() or self.config.sequence_parallel:
            return False
        cache = getattr(self.self_attention, "core_attention", None)
        cache = getattr(cache, "kv_cache", None)
        if cache is None or cache.is_prefill:
            return False
        if self._lean is None:
            self._lean = lean_step_covers(self)
            self._tp_reduce = _size(self.self_attention.linear_proj.tp_group) > 1
            self._moe = self._lean and _is_moe(self.mlp)
        return self._lean and (not self._moe or getattr(cache, "static_shapes", False))

    def _decode_step(self, x: torch.Tensor) -> torch.Tensor:
        """x [1, n, h] -> [1, n, h]: megatron's layer forward at eval, one token per row."""
        attn, mlp = self.self_attention, self.mlp
        # attention (Attention.forward with the cache's core attention)
        qkv = _linear(self.input_layernorm(x), attn.linear_qkv)
        ng = attn.num_query_groups_per_partition
        hn = attn.hidden_size_per_attention_head
        per_group = attn.num_attention_heads_per_partition // ng
        qkv = qkv.view(*qkv.shape[:-1], ng, (per_group + 2) * hn)
        query, key, value = torch.split(qkv, [per_group * hn, hn, hn], dim=3)
        query = query.reshape(query.size(0), query.size(1), -1, hn)
        if attn.q_layernorm is not None:
            query = attn.q_layernorm(query)
        if attn.k_layernorm is not None:
            key = attn.k_layernorm(key)
        context = attn.core_attention(query, key, value, None, attn_mask_type=attn.attn_mask_type)
        x = _row_parallel_add(context, attn.linear_proj, x, self._tp_reduce)
        if self._moe:  # MoELayer.forward with static shapes, then the eval bias-dropout-add
            from puzzle.models.moe_decode import moe_decode_mlp

            return moe_decode_mlp(mlp, self.pre_mlp_layernorm(x)) + x
        # MLP (MLP.forward without fused kernels)
        inter = mlp_activation(mlp, _linear(self.pre_mlp_layernorm(x), mlp.linear_fc1))
        return _row_parallel_add(inter, mlp.linear_fc2, x, self._tp_reduce)


def _linear(x: torch.Tensor, linear, weight: Optional[torch.Tensor] = None) -> torch.Tensor:
    """ColumnParallelLinear without gathering: megatron's frozen-weight product plus the bias
    (added here whether or not the layer returns it separately, as the callers do)."""
    out = torch.matmul(x, (linear.weight if weight is None else weight).t())
    return out if linear.bias is None else out + linear.bias


def decode_forward(model, ids: torch.Tensor, positions: torch.Tensor,
                   hidden: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """GPTModel.forward of one KV-cache decode step on this pipeline stage, with every layer's
    lean step and without the model's and block's per-call plumbing: the embedding (first
    stage) and the final norm are megatron's modules, the output layer is its weight's product
    (the shared embedding weight when tied), not gathered. ``ids``/``positions`` [n, 1];
    ``hidden`` [1, n, h] from the previous stage (None on the first). Returns the logits [n, V/T]
    (last stage) or the hidden states [1, n, h]; None when a layer or the model has something
    the lean step does not cover (then the caller runs GPTModel.forward)."""
    block = model.decoder
    layers = list(block.layers)
    if (not layers or getattr(model, "mtp_process", False) or model.config.mtp_num_layers
            or not all(isinstance(l, DecodeTransformerLayer) and l._decodes() for l in layers)):
        return None
    x = model.embedding(input_ids=ids, position_ids=positions) if model.pre_process else hidden
    for layer in layers:  # module calls: forward hooks on the layers still see every step
        x = layer(x, attention_mask=None)[0]
    if block.final_layernorm is not None:
        x = block.final_layernorm(x)
    if not model.post_process:
        return x
    weight = model.shared_embedding_or_output_weight() \
        if model.share_embeddings_and_output_weights else None
    return _linear(x, model.output_layer, weight)[0]


def _row_parallel_add(x: torch.Tensor, linear, residual: torch.Tensor, reduce: bool) -> torch.Tensor:
    """RowParallelLinear (all-reduce over its TP group, then bias) and eval bias-dropout-add."""
    out = torch.matmul(x, linear.weight.t())
    if reduce and batch_invariant.active():
        batch_invariant.ordered_all_reduce(out, linear.tp_group)
    elif reduce:
        dist.all_reduce(out, group=linear.tp_group)
    if linear.bias is not None:
        out = out + linear.bias
    return out + residual


def lean_step_covers(layer: TransformerLayer) -> bool:
    """Whether ``layer``'s modules and options are the ones the lean decode step reproduces."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.mlp import MLP

    from puzzle.models.sdpa_attention import KVCacheMixin

    attn, mlp, cfg = layer.self_attention, layer.mlp, layer.config
    if _is_moe(mlp):
        from puzzle.models.moe_decode import moe_step_problem

        if moe_step_problem(mlp) is not None:
            return False
        mlp_ok = True
    else:
        mlp_ok = (type(mlp) is MLP and type(mlp.linear_fc1) is ColumnParallelLinear
                  and type(mlp.linear_fc2) is RowParallelLinear and not mlp.linear_fc1.gather_output
                  and mlp.linear_fc2.input_is_parallel and not mlp.linear_fc2.explicit_expert_comm
                  and _size(attn.linear_proj.tp_group) == _size(mlp.linear_fc2.tp_group))
    modules_ok = (
        mlp_ok and type(attn) is SelfAttention
        and type(attn.linear_qkv) is ColumnParallelLinear and type(attn.linear_proj) is RowParallelLinear
        and isinstance(attn.core_attention, KVCacheMixin)
        and isinstance(layer.pre_cross_attn_layernorm, IdentityOp)
        and isinstance(layer.cross_attention, IdentityOp)
    )
    if not modules_ok:
        return False
    linears = [attn.linear_qkv, attn.linear_proj] + ([] if _is_moe(mlp) else [mlp.linear_fc1, mlp.linear_fc2])
    if any(linear._forward_hooks or linear._forward_pre_hooks for linear in linears):
        return False  # e.g. LoRA adapters (puzzle/models/lora.py): the hook's output is not matmul(x, weight)
    options_ok = (
        not getattr(cfg, "attention_output_gate", False)
        and cfg.num_query_groups >= attn.world_size
        and not cfg.bias_activation_fusion
        and not getattr(cfg, "use_te_activation_func", False)
        and getattr(cfg, "activation_func_clamp_value", None) is None
        and not getattr(cfg, "inference_fuse_tp_communication", False)
        and not cfg.fp8 and not getattr(cfg, "fp4", None)
        and not cfg.test_mode
        and not attn.linear_qkv.gather_output and attn.linear_proj.input_is_parallel
        and not attn.linear_proj.explicit_expert_comm
    )
    return bool(options_ok)


def moe_static_problem(model) -> Optional[str]:
    """Why a MoE layer of ``model`` cannot take the static decode step (which a CUDA graph
    needs: megatron's MoE forward synchronises with the host), or None."""
    from puzzle.models.moe_decode import moe_step_problem

    for name, layer in model.named_modules():
        if isinstance(layer, TransformerLayer) and _is_moe(layer.mlp):
            problem = moe_step_problem(layer.mlp)
            if problem is None and not (isinstance(layer, DecodeTransformerLayer) and lean_step_covers(layer)):
                problem = f"{type(layer).__name__} with options the lean decode step does not cover"
            if problem is not None:
                return f"MoE layer {name}: {problem}"
    return None


def _is_moe(mlp) -> bool:
    from megatron.core.transformer.moe.moe_layer import MoELayer

    return isinstance(mlp, MoELayer)


def _size(group) -> int:
    return 1 if group is None else group.size()
