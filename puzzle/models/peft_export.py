"""A LoRA actor's adapters as a PEFT adapter directory (``adapter_config.json`` +
``adapter_model.safetensors``) that ``peft.PeftModel.from_pretrained`` puts on the HF base model.

PEFT adapts each HF projection on its own; our adapters sit on megatron's fused linears. A fused
linear's LoRA splits exactly: y = W x + s B A x with W = [W_q; W_k; W_v] (rows) is, per projection,
y_q = W_q x + s B_q A x -- the same A for every part, and each part's rows of B (for linear_qkv the
query-group-major rows of q, k and v, as the base weight's: puzzle.models.hf_mapping; for a SwiGLU
linear_fc1 the gate and up halves). linear_proj and linear_fc2 are o_proj and down_proj as they are.
PEFT's scaling is lora_alpha / r, ours alpha / dim: the same numbers.

The experts of a MoE layer (Qwen3-MoE, Mixtral) are written under the per-expert projection names
of transformers v4 (``mlp.experts.<e>.{gate,up,down}_proj`` / ``block_sparse_moe.experts.<e>.{w1,w3,w2}``,
puzzle.models.hf_moe), each expert's A and B as a dense linear's: PEFT (>= 0.18) converts them onto
transformers v5's fused expert tensors when it loads them (A of gate and up concatenated along the
rank, B block-diagonal, rank and alpha doubled: the same update). That conversion moves every
target named gate_proj / up_proj / down_proj onto the experts, so the dense MLPs of a Qwen3-MoE
model's dense layers (``mlp_only_layers``) would lose their adapters: they are listed as PEFT
``target_parameters`` (``model.layers.<i>.mlp.<proj>.weight``; PEFT's keys stay the same). PEFT
adapts parameters (the fused experts, those dense weights) without dropout and refuses a non-zero
``lora_dropout`` for them: such a directory records 0 (dropout only matters when training on).
"""

from __future__ import annotations

import json
import os
from typing import Dict, Optional

import torch

from puzzle.models.hf_mapping import HFEntry, hf_entries, ours_to_hf

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
#: PEFT's key prefix of the adapted model's parameters (PeftModel -> LlamaForCausalLM -> LlamaModel)
PEFT_PREFIX = "base_model.model."


def peft_tensors(arch, whole: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Our whole adapters ({global name: tensor}, lora.gather_adapters) -> PEFT's tensors by key."""
    entries = {e.ours: e for e in hf_entries(arch, "actor")}
    out = {}
    for name, tensor in whole.items():
        linear, part = name.split(".adapter.")
        base = entries[linear + ".weight"]
        projections = [hf[:-len(".weight")] for hf in base.hf]  # model.layers.i.self_attn.q_proj ...
        if part == "linear_in.weight":  # A: the same for every projection of a fused linear
            for proj in projections:
                out[f"{PEFT_PREFIX}{proj}.lora_A.weight"] = tensor.clone()
        else:  # B: each projection's rows, as the base weight's rows split
            rows = ours_to_hf(HFEntry(name, base.hf, base.kind, tuple(tensor.shape)), tensor, arch)
            for hf_name, piece in rows.items():
                out[f"{PEFT_PREFIX}{hf_name[:-len('.weight')]}.lora_B.weight"] = piece.contiguous()
    return out


def dense_mlp_parameters_of_moe(arch, tensors: Dict[str, torch.Tensor]) -> list:
    """The dense MLP weights of a MoE model's dense layers that have adapters (PEFT's
    ``target_parameters``: see the module docstring); [] for a dense model."""
    if not arch.is_moe:
        return []
    out = set()
    for key in tensors:
        if ".experts." not in key and ".mlp." in key:
            module = key[len(PEFT_PREFIX):].split(".lora_")[0]  # model.layers.i.mlp.gate_proj
            out.add(module + ".weight")
    return sorted(out)


def peft_config(lora, target_projections, base_model: Optional[str], target_parameters=()) -> dict:
    """adapter_config.json: PEFT's LoRA fields."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
            "r": lora.dim, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout,
            "target_modules": sorted(target_projections), "bias": "none", "fan_in_fan_out": False,
            "use_rslora": False, "use_dora": False, "init_lora_weights": True, "inference_mode": True,
            "modules_to_save": None, "layers_to_transform": None, "target_parameters": list(target_parameters) or None}


def write_peft_adapter(arch, lora, whole: Dict[str, torch.Tensor], out_dir: str, *,
                       base_model: Optional[str] = None, dtype: Optional[torch.dtype] = None) -> list:
    """Write the PEFT adapter directory of ``whole`` (rank 0's gather_adapters); returns its files."""
    from safetensors.torch import save_file

    tensors = peft_tensors(arch, whole)
    if dtype is not None:
        tensors = {k: v.to(dtype) for k, v in tensors.items()}
    projections = {k[len(PEFT_PREFIX):].split(".")[-3] for k in tensors}
    if arch.is_moe and any(".experts." in k for k in tensors):  # PEFT adapts the fused experts without dropout
        from dataclasses import replace

        lora = replace(lora, dropout=0.0)
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, ADAPTER_WEIGHTS), metadata={"format": "pt"})
    with open(os.path.join(out_dir, ADAPTER_CONFIG), "w") as f:
        json.dump(peft_config(lora, projections, base_model, dense_mlp_parameters_of_moe(arch, tensors)), f, indent=2)
    return [ADAPTER_CONFIG, ADAPTER_WEIGHTS]
