"""The ONE mapping between HF LLaMA-family tensors (Llama-2/3.x, Mistral, Qwen2/2.5, Qwen3, and the
mixture-of-experts Qwen3-MoE and Mixtral: puzzle/models/hf_moe.py) and our global ParamSpec names (pure).

==========================================================  =============================================
ours (global ParamSpec name)                                HF LLaMA
==========================================================  =============================================
embedding.word_embeddings.weight  [Vpad, h]                 model.embed_tokens.weight [V, h] (rows >= V: 0)
decoder.layers.i.input_layernorm.weight                     model.layers.i.input_layernorm.weight
decoder.layers.i.self_attention.linear_qkv.weight           model.layers.i.self_attn.{q,k,v}_proj.weight
    group-major: for group g: q heads g*r..(g+1)*r-1, k_g, v_g   (r = heads / kv_heads)
decoder.layers.i.self_attention.linear_qkv.bias             model.layers.i.self_attn.{q,k,v}_proj.bias (Qwen2)
decoder.layers.i.self_attention.q_layernorm.weight          model.layers.i.self_attn.q_norm.weight (Qwen3)
decoder.layers.i.self_attention.k_layernorm.weight          model.layers.i.self_attn.k_norm.weight (Qwen3)
decoder.layers.i.self_attention.linear_proj.weight          model.layers.i.self_attn.o_proj.weight
decoder.layers.i.pre_mlp_layernorm.weight                   model.layers.i.post_attention_layernorm.weight
decoder.layers.i.mlp.linear_fc1.weight  [gate; up]          model.layers.i.mlp.{gate,up}_proj.weight
decoder.layers.i.mlp.linear_fc2.weight                      model.layers.i.mlp.down_proj.weight
decoder.final_layernorm.weight                              model.norm.weight
output_layer.weight [Vpad, h]  (actor/ref, untied)          lm_head.weight [V, h] (absent when tied)
value_head.weight [1, h]       (critic/reward)              score.weight (LlamaForSequenceClassification,
                                                            num_labels=1) or v_head.weight (TRL)
==========================================================  =============================================

RoPE needs no permutation: HF LLaMA checkpoints use rotate_half (the two halves of each head
are rotated against each other), which is megatron's ``rotary_interleaved=False`` default.
GQA: HF query head j uses kv head j // r (``repeat_kv``), megatron's group g holds query heads
g*r .. g*r + r - 1 — the same assignment, so the fused rows are a pure re-ordering.

Every entry is described by *pieces*: a global box of our tensor (any box, e.g. one TP shard's)
maps to an ordered list of (HF tensor, HF box) reads concatenated along dim 0 (or zero rows for
the vocabulary padding). The same description serves whole-tensor conversion in both directions
and sharded loading (each rank reads only the HF rows/columns its shard needs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from puzzle.models.hf_moe import DENSE_REFUSED, MOE_FAMILIES, moe_arch_fields, moe_hf_config, moe_layer_names

Box = Tuple[Tuple[int, int], ...]

HEAD_NAMES = ("score.weight", "v_head.weight")  # accepted HF names of the value/score head


@dataclass(frozen=True)
class HFEntry:
    """One of our parameters and the HF tensors it is made of.

    kind: 'copy' (same tensor), 'vocab' (HF rows + zero padding rows up to the padded vocab),
    'qkv' (hf = (q, k, v), group-major fusion), 'gate_up' (hf = (gate, up), stacked).
    """

    ours: str
    hf: Tuple[str, ...]
    kind: str
    global_shape: Tuple[int, ...]


@dataclass(frozen=True)
class Piece:
    """``rows`` rows of our box come from ``hf_box`` of HF tensor ``hf`` (None: zero padding)."""

    hf: Optional[str]
    hf_box: Optional[Box]
    rows: int


def hf_entries(arch, role: str = "actor", *, prefix: str = "model.", head_name: str = "score.weight"
               ) -> List[HFEntry]:
    """The mapping for one role model of shape ``arch`` (a puzzle.config.ModelArch)."""
    from puzzle.config import ROLES
    from puzzle.models.init import param_specs

    if arch.normalization != "RMSNorm" or not arch.swiglu or arch.add_bias_linear \
            or arch.position_embedding_type != "rope":
        raise ValueError("HF LLaMA-family mapping needs RMSNorm, SwiGLU, no linear biases but q/k/v and RoPE "
                         f"(arch: {arch})")
    if head_name not in HEAD_NAMES:
        raise ValueError(f"head_name must be one of {HEAD_NAMES}, got {head_name!r}")
    m = prefix
    per_layer = {
        "input_layernorm.weight": ("copy", ("input_layernorm.weight",)),
        "self_attention.linear_qkv.weight": ("qkv", ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                                     "self_attn.v_proj.weight")),
        "self_attention.linear_qkv.bias": ("qkv", ("self_attn.q_proj.bias", "self_attn.k_proj.bias",
                                                   "self_attn.v_proj.bias")),
        "self_attention.q_layernorm.weight": ("copy", ("self_attn.q_norm.weight",)),
        "self_attention.k_layernorm.weight": ("copy", ("self_attn.k_norm.weight",)),
        "self_attention.linear_proj.weight": ("copy", ("self_attn.o_proj.weight",)),
        "pre_mlp_layernorm.weight": ("copy", ("post_attention_layernorm.weight",)),
        "mlp.linear_fc1.weight": ("gate_up", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
        "mlp.linear_fc2.weight": ("copy", ("mlp.down_proj.weight",)),
    }
    fixed = {
        "embedding.word_embeddings.weight": ("vocab", (f"{m}embed_tokens.weight",)),
        "decoder.final_layernorm.weight": ("copy", (f"{m}norm.weight",)),
        "output_layer.weight": ("vocab", ("lm_head.weight",)),
        "value_head.weight": ("copy", (head_name,)),
    }
    out = []
    for spec in param_specs(arch, role):
        if spec.name in fixed:
            kind, hf = fixed[spec.name]
        else:
            parts = spec.name.split(".", 3)  # decoder, layers, i, rest
            found = per_layer.get(parts[3]) if parts[:2] == ["decoder", "layers"] else None
            found = found or moe_layer_names(arch.hf_model_type, parts[3])
            if found is None:
                raise KeyError(f"no HF LLaMA name for {spec.name}")
            kind, names = found
            hf = tuple(f"{m}layers.{parts[2]}.{n}" for n in names)
        out.append(HFEntry(spec.name, hf, kind, spec.global_shape))
    assert ROLES[role].lm_head or out[-1].ours == "value_head.weight"
    return out


def _rows(box: Box) -> Tuple[int, int]:
    return box[0]


def _with_rows(box: Box, a: int, b: int) -> Box:
    return ((a, b),) + tuple(box[1:])


def pieces(entry: HFEntry, box: Box, arch) -> List[Piece]:
    """The HF reads that make up ``box`` (a global box of our tensor), in dim-0 order."""
    a, b = _rows(box)
    if entry.kind == "copy":
        return [Piece(entry.hf[0], box, b - a)]
    if entry.kind == "vocab":
        V = arch.vocab_size
        out = []
        if a < V:
            out.append(Piece(entry.hf[0], _with_rows(box, a, min(b, V)), min(b, V) - a))
        if b > V:
            out.append(Piece(None, None, b - max(a, V)))
        return out
    if entry.kind == "gate_up":
        F = entry.global_shape[0] // 2
        out = []
        if a < F:
            out.append(Piece(entry.hf[0], _with_rows(box, a, min(b, F)), min(b, F) - a))
        if b > F:
            s = max(a, F)
            out.append(Piece(entry.hf[1], _with_rows(box, s - F, b - F), b - s))
        return out
    if entry.kind == "qkv":
        hd, nq, ng = arch.kv_channels, arch.num_attention_heads, arch.num_query_groups
        r = nq // ng
        block = (r + 2) * hd
        out = []
        for g in range(a // block, -(-b // block)):
            base = g * block
            # (HF tensor, its first row for this group, rows) for q, k, v of group g
            for offset, (name, start, n) in zip(
                    (0, r * hd, (r + 1) * hd),
                    ((entry.hf[0], g * r * hd, r * hd), (entry.hf[1], g * hd, hd), (entry.hf[2], g * hd, hd))):
                lo, hi = max(a, base + offset), min(b, base + offset + n)
                if lo < hi:
                    s = start + lo - base - offset
                    out.append(Piece(name, _with_rows(box, s, s + hi - lo), hi - lo))
        return out
    raise ValueError(f"unknown HF entry kind {entry.kind!r}")


def full_box(shape: Sequence[int]) -> Box:
    return tuple((0, int(s)) for s in shape)


def assemble(entry: HFEntry, box: Box, arch, read: Callable[[str, Box], torch.Tensor],
             dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Our tensor's ``box``, built from HF reads ``read(hf_name, hf_box)``."""
    cols = tuple(b - a for a, b in box[1:])
    parts = []
    for p in pieces(entry, box, arch):
        if p.hf is None:
            parts.append(torch.zeros((p.rows,) + cols, dtype=dtype))
        else:
            t = read(p.hf, p.hf_box)
            expect = tuple(b - a for a, b in p.hf_box)
            if tuple(t.shape) != expect:
                raise ValueError(f"HF tensor {p.hf}: read {tuple(t.shape)} for box {p.hf_box}, expected {expect}")
            parts.append(t.to(dtype))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


def hf_shapes(entry: HFEntry, arch) -> Dict[str, Tuple[int, ...]]:
    """Shapes of the HF tensors of ``entry``."""
    shapes: Dict[str, Tuple[int, ...]] = {}
    for p in pieces(entry, full_box(entry.global_shape), arch):
        if p.hf is None:
            continue
        end = tuple(b for _, b in p.hf_box)
        old = shapes.get(p.hf, tuple(0 for _ in end))
        shapes[p.hf] = tuple(max(x, y) for x, y in zip(old, end))
    return shapes


def hf_to_ours(entry: HFEntry, hf: Dict[str, torch.Tensor], arch) -> torch.Tensor:
    """The whole tensor of our parameter from whole HF tensors."""
    return assemble(entry, full_box(entry.global_shape), arch,
                    lambda name, box: hf[name][tuple(slice(a, b) for a, b in box)],
                    dtype=next(iter(hf[n] for n in entry.hf if n in hf)).dtype)


def ours_to_hf(entry: HFEntry, full: torch.Tensor, arch) -> Dict[str, torch.Tensor]:
    """Whole HF tensors from the whole tensor of our parameter (vocab padding rows dropped)."""
    out = {name: torch.empty(shape, dtype=full.dtype) for name, shape in hf_shapes(entry, arch).items()}
    row = 0
    for p in pieces(entry, full_box(entry.global_shape), arch):
        if p.hf is not None:
            out[p.hf][tuple(slice(a, b) for a, b in p.hf_box)] = full[row:row + p.rows]
        row += p.rows
    return out


# ---- HF config -> ModelArch ----------------------------------------------------------------------
class UnsupportedHFModel(ValueError):
    """An HF config this importer cannot represent (the message names the file and the field)."""


# model_type -> (causal-LM class, sequence-classification class); every family is a LLaMA
# decoder (RMSNorm, SwiGLU, rotate_half RoPE) plus its own attention details.
FAMILIES = {
    "llama": ("LlamaForCausalLM", "LlamaForSequenceClassification"),
    "mistral": ("MistralForCausalLM", "MistralForSequenceClassification"),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2ForSequenceClassification"),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3ForSequenceClassification"),
    **MOE_FAMILIES,
}


def _rope_fields(config: dict, problems: list):
    """(rope_theta, llama3 scaling dict or None) of an HF config (transformers 5 ``rope_parameters``
    or the older ``rope_theta`` + ``rope_scaling``)."""
    rope = dict(config.get("rope_parameters") or {})
    rope.update(config.get("rope_scaling") or {})  # the older field, when given, names the scaling
    rope_type = rope.get("rope_type", rope.get("type")) or "default"
    theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        problems.append(f"rope_parameters.rope_type={rope_type!r} (supported: 'default', 'llama3')")
        return theta, None
    need = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [k for k in need if rope.get(k) is None]
    if missing:
        problems.append(f"rope_parameters (llama3) lacks {', '.join(missing)}")
        return theta, None
    return theta, {k: rope[k] for k in need}


def arch_from_hf_config(config: dict, source: str = "config.json", **overrides):
    """ModelArch of an HF ``config.json`` dict (Llama-2/3.x, Mistral, Qwen2/2.5, Qwen3);
    ``overrides`` (ModelArch fields) win.

    Defaults: ``seq_length`` = ``max_position_embeddings``, ``make_vocab_size_divisible_by``
    = 128 (Megatron's); the precision is the run's (RunConfig.precision), not the checkpoint's.
    Anything else (another model_type, MoE, other RoPE scalings, biases beyond q/k/v) raises
    UnsupportedHFModel naming ``source`` and the field, before anything is allocated.
    """
    from puzzle.config import ModelArch

    problems = []
    mt = config.get("model_type")
    if mt not in FAMILIES:
        problems.append(f"model_type={mt!r} (supported: {', '.join(sorted(FAMILIES))})")
    moe = {}
    if mt in MOE_FAMILIES:
        moe = moe_arch_fields(config, mt, problems)
    for f in DENSE_REFUSED if mt not in MOE_FAMILIES else ():
        if config.get(f):
            problems.append(f"{f}={config[f]} (mixture-of-experts {mt} models are not supported; "
                            f"supported: {', '.join(sorted(MOE_FAMILIES))})")
    theta, llama3 = _rope_fields(config, problems)
    if config.get("mlp_bias"):
        problems.append("mlp_bias=true (MLP biases are not supported)")
    if mt in ("llama", "qwen3", "qwen3_moe", "mixtral") and config.get("attention_bias"):
        problems.append("attention_bias=true (an o_proj bias is not supported)")
    act = config.get("hidden_act", "silu")
    if act != "silu":
        problems.append(f"hidden_act={act!r} (SwiGLU needs silu)")
    for f in ("partial_rotary_factor",):
        if config.get(f) not in (None, 1, 1.0):
            problems.append(f"{f}={config[f]} (only full rotary)")
    window = None
    if mt in ("mistral", "mixtral") and config.get("sliding_window"):
        window = int(config["sliding_window"])
    if mt in ("qwen2", "qwen3", "qwen3_moe") and config.get("use_sliding_window") and config.get("sliding_window"):
        window = int(config["sliding_window"])
    h, nh = config.get("hidden_size"), config.get("num_attention_heads")
    hd = config.get("head_dim") if mt != "qwen2" else None  # Qwen2 always uses hidden / heads
    if problems:
        raise UnsupportedHFModel(f"{source}: unsupported HF model: " + "; ".join(problems))
    missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                           "vocab_size") if k not in config]
    if missing:
        raise UnsupportedHFModel(f"{source}: missing {', '.join(missing)}")
    theta = int(theta) if float(theta).is_integer() else float(theta)
    maxpos = int(config.get("max_position_embeddings", 2048))
    kw = dict(
        num_layers=config["num_hidden_layers"], hidden_size=h, ffn_hidden_size=config["intermediate_size"],
        num_attention_heads=nh, num_query_groups=config.get("num_key_value_heads") or nh,
        kv_channels=int(hd) if hd else None,
        vocab_size=config["vocab_size"], make_vocab_size_divisible_by=128, seq_length=maxpos,
        max_position_embeddings=maxpos, normalization="RMSNorm",
        norm_epsilon=float(config.get("rms_norm_eps", 1e-6)), swiglu=True, position_embedding_type="rope",
        rotary_base=theta, untie_embeddings_and_output_weights=not config.get("tie_word_embeddings", False),
        add_bias_linear=False, add_qkv_bias=mt == "qwen2" or bool(mt == "mistral" and config.get("attention_bias")),
        qk_layernorm=mt in ("qwen3", "qwen3_moe"), sliding_window=window, hf_model_type=mt,
        attention_dropout=0.0, hidden_dropout=0.0,
        init_method_std=float(config.get("initializer_range", 0.02)),
    )
    if llama3:
        kw.update(use_rope_scaling=True, rope_scaling_factor=float(llama3["factor"]),
                  rope_low_freq_factor=float(llama3["low_freq_factor"]),
                  rope_high_freq_factor=float(llama3["high_freq_factor"]),
                  rope_original_max_position_embeddings=int(llama3["original_max_position_embeddings"]))
    kw.update(moe)
    kw.update(overrides)
    try:
        return ModelArch(**kw)
    except ValueError as e:
        raise UnsupportedHFModel(f"{source}: {e}") from e


def hf_config_from_arch(arch, role: str = "actor", dtype: str = "float32", **extra) -> dict:
    """An HF ``config.json`` dict for ``arch`` in its family (``arch.hf_model_type``): the
    causal-LM class, or the sequence-classification class with num_labels=1 for critic/reward."""
    from puzzle.config import ROLES

    mt = arch.hf_model_type
    if mt not in FAMILIES:
        raise ValueError(f"cannot export model_type {mt!r} (supported: {', '.join(sorted(FAMILIES))})")
    lm = ROLES[role].lm_head
    rope = {"rope_theta": float(arch.rotary_base), "rope_type": "default"}
    if arch.use_rope_scaling:
        rope.update(rope_type="llama3", factor=arch.rope_scaling_factor,
                    low_freq_factor=arch.rope_low_freq_factor, high_freq_factor=arch.rope_high_freq_factor,
                    original_max_position_embeddings=arch.rope_original_max_position_embeddings)
    cfg = {
        "architectures": [FAMILIES[mt][0 if lm else 1]],
        "model_type": mt,
        "hidden_size": arch.hidden_size,
        "intermediate_size": arch.ffn_hidden_size,
        "num_hidden_layers": arch.num_layers,
        "num_attention_heads": arch.num_attention_heads,
        "num_key_value_heads": arch.num_query_groups,
        "head_dim": arch.kv_channels,
        "vocab_size": arch.vocab_size,
        "max_position_embeddings": arch.max_position_embeddings,
        "rms_norm_eps": arch.norm_epsilon,
        "rope_theta": float(arch.rotary_base),
        "rope_parameters": rope,
        "tie_word_embeddings": bool(lm and not arch.untie_embeddings_and_output_weights),
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "initializer_range": arch.init_method_std,
        "use_cache": True,
        "dtype": dtype,
    }
    if mt == "llama":
        cfg.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    elif mt in ("mistral", "mixtral"):
        cfg.update(sliding_window=arch.sliding_window)
    else:  # qwen2 / qwen3 / qwen3_moe
        cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=arch.num_layers,
                   layer_types=["full_attention"] * arch.num_layers)
        if mt == "qwen2":
            if arch.kv_channels * arch.num_attention_heads != arch.hidden_size:
                raise ValueError(f"qwen2 cannot express kv_channels={arch.kv_channels} != hidden / heads")
            del cfg["head_dim"]  # Qwen2 derives it from hidden / heads
        else:
            cfg.update(attention_bias=False)
    if arch.is_moe:
        if mt not in MOE_FAMILIES:
            raise ValueError(f"model_type {mt!r} has no experts; a MoE model exports as one of "
                             f"{', '.join(sorted(MOE_FAMILIES))}")
        cfg.update(moe_hf_config(arch))
    elif mt in MOE_FAMILIES:
        raise ValueError(f"model_type {mt!r} needs experts (--num-experts)")
    if not lm:
        cfg.update({"num_labels": 1, "id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}})
    cfg.update(extra)
    return cfg
