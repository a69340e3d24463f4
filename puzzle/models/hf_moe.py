"""The mixture-of-experts part of the HF mapping (pure): Qwen3-MoE and Mixtral.

==========================================================  =============================================
ours (global ParamSpec name, layer i, expert e)             HF Qwen3-MoE / Mixtral
==========================================================  =============================================
decoder.layers.i.mlp.router.weight [E, h]                   model.layers.i.mlp.gate.weight /
                                                            model.layers.i.block_sparse_moe.gate.weight
decoder.layers.i.mlp.experts.local_experts.e.               mlp.experts.e.{gate,up}_proj.weight /
    linear_fc1.weight [gate; up]                            block_sparse_moe.experts.e.{w1,w3}.weight
decoder.layers.i.mlp.experts.local_experts.e.               mlp.experts.e.down_proj.weight /
    linear_fc2.weight                                       block_sparse_moe.experts.e.w2.weight
==========================================================  =============================================

Routing: HF takes the softmax over all experts, keeps the top k and (Mixtral always, Qwen3-MoE
with ``norm_topk_prob``) renormalises them: the same probabilities as megatron's TopKRouter
softmax over the top-k logits (``moe_router_pre_softmax=False``). Qwen3-MoE without
``norm_topk_prob`` keeps the unnormalised top-k of the full softmax: ``moe_router_pre_softmax``.
Qwen3-MoE layer i is sparse unless it is in ``mlp_only_layers`` or ``(i + 1) %
decoder_sparse_step != 0``; its dense layers have an MLP of ``intermediate_size``, its experts one
of ``moe_intermediate_size``. Mixtral's experts use ``intermediate_size`` and every layer is sparse.

Anything the MoE layer here does not represent (shared experts, multi-latent attention, other
routers or scoring functions, router jitter, per-expert biases) is refused naming the field.
"""

from __future__ import annotations

import re
from typing import Dict, List, Optional, Tuple

#: model_type -> (causal-LM class, sequence-classification class)
MOE_FAMILIES = {
    "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeForSequenceClassification"),
    "mixtral": ("MixtralForCausalLM", "MixtralForSequenceClassification"),
}
#: per-family (router, expert container, (gate, up, down) names)
_NAMES = {
    "qwen3_moe": ("mlp.gate.weight", "mlp.experts", ("gate_proj", "up_proj", "down_proj")),
    "mixtral": ("block_sparse_moe.gate.weight", "block_sparse_moe.experts", ("w1", "w3", "w2")),
}
#: config fields of MoE variants these families do not have: (field, what it would need)
_REFUSED = (
    ("shared_expert_intermediate_size", "shared experts"), ("n_shared_experts", "shared experts"),
    ("num_shared_experts", "shared experts"), ("q_lora_rank", "multi-latent attention"),
    ("kv_lora_rank", "multi-latent attention"), ("n_routed_experts", "DeepSeek-style routed experts"),
    ("topk_method", "another router"), ("n_group", "group-limited routing"), ("topk_group", "group-limited routing"),
    ("routed_scaling_factor", "scaled routing"), ("first_k_dense_replace", "DeepSeek-style dense layers"),
    ("router_jitter_noise", "router jitter"), ("moe_bias", "expert biases"),
)
#: a field dense families must not have (they would silently drop the experts)
DENSE_REFUSED = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")

_EXPERT_RE = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")


def moe_arch_fields(config: dict, mt: str, problems: List[str]) -> dict:
    """ModelArch fields (num_experts, moe_*, ffn_hidden_size) of a MoE family's config.json;
    unsupported fields are appended to ``problems``."""
    for field, what in _REFUSED:
        value = config.get(field)
        if value not in (None, 0, 0.0, False, "softmax") and not (field == "routed_scaling_factor" and value == 1):
            problems.append(f"{field}={value!r} ({what} is not supported)")
    score = config.get("scoring_func", "softmax")
    if score != "softmax":
        problems.append(f"scoring_func={score!r} (only the softmax router is supported)")
    experts = config.get("num_experts") or config.get("num_local_experts")
    topk = config.get("num_experts_per_tok")
    if not experts or not topk:
        problems.append(f"{mt} needs num_experts (or num_local_experts) and num_experts_per_tok")
        return {}
    layers = int(config.get("num_hidden_layers", 0))
    if mt == "mixtral":
        return dict(num_experts=int(experts), moe_router_topk=int(topk), moe_router_pre_softmax=False,
                    moe_ffn_hidden_size=int(config["intermediate_size"]), moe_layer_pattern=None)
    step = int(config.get("decoder_sparse_step", 1) or 1)
    dense = set(int(i) for i in config.get("mlp_only_layers") or ())
    pattern = tuple(0 if i in dense or (i + 1) % step else 1 for i in range(layers))
    if 1 not in pattern:
        problems.append(f"mlp_only_layers={sorted(dense)} / decoder_sparse_step={step} leave no MoE layer")
        return {}
    return dict(num_experts=int(experts), moe_router_topk=int(topk),
                moe_router_pre_softmax=not config.get("norm_topk_prob", False),
                moe_ffn_hidden_size=int(config.get("moe_intermediate_size") or config["intermediate_size"]),
                moe_layer_pattern=None if all(pattern) else pattern)


def moe_layer_names(mt: str, rest: str) -> Optional[Tuple[str, Tuple[str, ...]]]:
    """(kind, HF names under ``model.layers.i.``) of a MoE parameter of ours (``rest`` after
    ``decoder.layers.i.``), None when ``rest`` is not a MoE parameter."""
    if mt not in _NAMES:
        return None
    router, experts, (gate, up, down) = _NAMES[mt]
    if rest == "mlp.router.weight":
        return "copy", (router,)
    m = _EXPERT_RE.match(rest)
    if not m:
        return None
    e, which = m.groups()
    if which == "linear_fc1":
        return "gate_up", (f"{experts}.{e}.{gate}.weight", f"{experts}.{e}.{up}.weight")
    return "copy", (f"{experts}.{e}.{down}.weight",)


def moe_hf_config(arch) -> Dict[str, object]:
    """The config.json fields of a MoE ``arch`` in its family (``arch.hf_model_type``)."""
    mt = arch.hf_model_type
    dense = [i for i in range(arch.num_layers) if not arch.is_moe_layer(i)]
    if mt == "mixtral":
        if dense or arch.moe_router_pre_softmax or arch.moe_ffn_hidden_size != arch.ffn_hidden_size:
            raise ValueError("mixtral cannot express dense layers, --moe-router-pre-softmax or "
                             "--moe-ffn-hidden-size != --ffn-hidden-size")
        return {"num_local_experts": arch.num_experts, "num_experts_per_tok": arch.moe_router_topk,
                "intermediate_size": arch.moe_ffn_hidden_size, "router_jitter_noise": 0.0,
                "router_aux_loss_coef": arch.moe_aux_loss_coeff, "output_router_logits": False}
    return {"num_experts": arch.num_experts, "num_experts_per_tok": arch.moe_router_topk,
            "moe_intermediate_size": arch.moe_ffn_hidden_size, "norm_topk_prob": not arch.moe_router_pre_softmax,
            "decoder_sparse_step": 1, "mlp_only_layers": dense, "router_aux_loss_coef": arch.moe_aux_loss_coeff,
            "output_router_logits": False}
