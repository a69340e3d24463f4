"""Layout-independent description of a megatron-core GPTModel's parameters (pure Python).

A :class:`ParamSpec` names one parameter by its GLOBAL name (global layer index, e.g.
``decoder.layers.7.self_attention.linear_qkv.weight``), its global (unsharded) shape and
how tensor parallelism (TP) splits it (``kind``):

``replicated``  every TP rank holds the whole tensor (layernorms, row-parallel biases,
                the critic/reward ``value_head``).
``column``      dim 0 split into T contiguous chunks (ColumnParallelLinear).
``row``         dim 1 split into T contiguous chunks (RowParallelLinear weight).
``vocab``       dim 0 split into T contiguous chunks of the PADDED vocabulary
                (VocabParallelEmbedding, output_layer); ``global_shape`` is already padded.
``qkv``         megatron's fused QKV weight/bias ``[(nq + 2*ng) * hd, ...]``. Rows are laid
                out group-major: for each of the ng query groups, that group's nq/ng query
                heads, then its key head, then its value head (attention.py,
                SelfAttention.get_query_key_value_tensors: ``q1 q2 k1 v1 | q3 q4 k2 v2 | ...``
                viewed as ``[ng_per_partition, (nq/ng + 2) * hd]``). A TP split is therefore a
                contiguous dim-0 chunk of ng/T whole groups; it requires ng % T == 0.
``swiglu_fc1``  megatron's fused SwiGLU fc1 weight/bias ``[2*ffn, ...]``. The GLOBAL tensor is
                ``[gate; up]`` but TP rank t holds ``[gate_chunk_t; up_chunk_t]`` (mlp.py: MLP
                builds linear_fc1 with ``stride=2``; layers.py _initialize_affine_weight_cpu
                takes ``split(master, ffn/T)[t::T]``; apply_swiglu_sharded_factory maps the
                local halves to global chunks t and T + t). NOT one contiguous chunk.

Pipeline parallelism: megatron numbers layers LOCALLY per stage (``self.layers`` is a
ModuleList built from 0 on every stage, transformer_block.py), so stage p holding global
layers ``[o, o + n)`` names them ``decoder.layers.0 .. n-1``. The embedding lives on the first
stage; the final layernorm and the head on the last stage. With tied embeddings and P > 1
the last stage holds a copy of the word embeddings as ``output_layer.weight``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from puzzle.parallel.plan import PlanError

KINDS = ("replicated", "column", "row", "vocab", "qkv", "swiglu_fc1")

Box = Tuple[Tuple[int, int], ...]  # one half-open (start, stop) range per dim

_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class ParamSpec:
    """One parameter of the model, independent of the parallel layout.

    ``stage_hint``: 'first' / 'last' for non-layer parameters (embedding / final norm, head);
    None for per-layer parameters (their stage follows ``layer``).
    ``split_units`` / ``split_label``: the count that T must divide for this parameter and
    its name for error messages (e.g. 8, 'num_query_groups'); None: the split dim size.
    ``tied_local_name``: for the word embeddings tied to the LM head, the local name of the
    copy the last stage holds when P > 1 (``output_layer.weight``).
    ``expert`` / ``num_experts``: for an expert's parameter, its global expert index and the
    experts of its layer; it is split over the expert-parallel ranks (E) and, inside an expert,
    over the expert-tensor-parallel ranks (ETP) instead of T (:func:`expert_local_name`).
    """

    name: str
    global_shape: Tuple[int, ...]
    kind: str
    layer: Optional[int] = None
    stage_hint: Optional[str] = None
    split_units: Optional[int] = None
    split_label: Optional[str] = None
    tied_local_name: Optional[str] = None
    expert: Optional[int] = None
    num_experts: Optional[int] = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"ParamSpec {self.name}: unknown kind {self.kind!r} (one of {KINDS})")
        if (self.layer is None) == (self.stage_hint is None):
            raise ValueError(f"ParamSpec {self.name}: give exactly one of layer / stage_hint")
        if self.stage_hint not in (None, "first", "last"):
            raise ValueError(f"ParamSpec {self.name}: stage_hint must be 'first' or 'last'")
        object.__setattr__(self, "global_shape", tuple(int(s) for s in self.global_shape))
        if self.split_dim is not None and self.split_dim >= len(self.global_shape):
            raise ValueError(f"ParamSpec {self.name}: kind {self.kind} needs dim {self.split_dim}")

    @property
    def split_dim(self) -> Optional[int]:
        """Dim that TP splits (None for replicated)."""
        return split_dim(self.kind)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.global_shape:
            n *= s
        return n


def split_dim(kind: str) -> Optional[int]:
    return {"replicated": None, "row": 1}.get(kind, 0)


def check_tp_split(spec: ParamSpec, T: int, what: str = "plan") -> Optional[str]:
    """Return an error message when ``spec`` cannot be split T ways, else None."""
    if spec.kind == "replicated" or T == 1:
        return None
    size = spec.global_shape[spec.split_dim]
    units = spec.split_units if spec.split_units is not None else size
    label = spec.split_label or f"{spec.name} dim {spec.split_dim}"
    if spec.kind == "swiglu_fc1":
        size //= 2
    if units % T or size % T:
        return f"{label}={units} is not divisible by T={T} of {what} (parameter {spec.name})"
    return None


def shard_slices(spec: ParamSpec, T: int, t: int) -> List[Box]:
    """Global boxes TP rank ``t`` of ``T`` holds, in the order they are concatenated (along
    ``spec.split_dim``) to form its local shard. One box, except two for swiglu_fc1."""
    if not 0 <= t < T:
        raise ValueError(f"tp rank {t} outside T={T}")
    full = [(0, s) for s in spec.global_shape]
    k = spec.split_dim
    if k is None or T == 1:
        return [tuple(full)]
    err = check_tp_split(spec, T)
    if err:
        raise PlanError(err)
    n = spec.global_shape[k]
    if spec.kind == "swiglu_fc1":
        c = n // 2 // T
        starts = [t * c, n // 2 + t * c]
    else:
        c = n // T
        starts = [t * c]
    boxes = []
    for s in starts:
        b = list(full)
        b[k] = (s, s + c)
        boxes.append(tuple(b))
    return boxes


# ---- the model ------------------------------------------------------------------------------
def gpt_param_specs(num_layers: int, hidden_size: int, ffn_hidden_size: int, num_attention_heads: int,
                    num_query_groups: Optional[int], padded_vocab_size: int, *, swiglu: bool = True,
                    add_bias_linear: bool = False, add_qkv_bias: bool = False, untie_embeddings: bool = True,
                    normalization: str = "RMSNorm", head: str = "lm", kv_channels: Optional[int] = None,
                    position_embedding_type: str = "rope",
                    max_sequence_length: Optional[int] = None, qk_layernorm: bool = False,
                    num_experts: Optional[int] = None, moe_ffn_hidden_size: Optional[int] = None,
                    moe_layers: Optional[Sequence[bool]] = None) -> List[ParamSpec]:
    """Parameters of a GPTModel built with ``get_gpt_layer_local_spec``, in
    ``named_parameters()`` order, with global (canonical) names. The transformer_engine spec's
    names and order follow from these (puzzle.models.param_names).

    qk_layernorm: per-head q and k norms ``self_attention.{q,k}_layernorm.weight`` [head dim]
    (+ ``.bias`` for LayerNorm), replicated on every TP rank.

    num_experts: the MLP of the layers ``moe_layers`` marks (default: every layer) is megatron's
    MoELayer: ``mlp.router.weight`` [num_experts, hidden] (replicated), then per expert e
    ``mlp.experts.local_experts.<e>.linear_fc1.weight`` / ``linear_fc2.weight`` (SequentialMLP,
    split like a dense MLP of ``moe_ffn_hidden_size`` over the expert-tensor-parallel ranks).

    head: 'lm' (output_layer.weight, or tied to the embedding), 'value' / 'score' (a
    ``value_head.weight`` [1, hidden], replicated, instead of the output layer).
    """
    ng = num_query_groups or num_attention_heads
    kv_channels = _checked_head_dim(head, normalization, hidden_size, num_attention_heads, ng, kv_channels)
    h, hd, nq, ffn = hidden_size, kv_channels, num_attention_heads, ffn_hidden_size
    ln_bias = normalization == "LayerNorm"
    specs: List[ParamSpec] = []
    tied = head == "lm" and not untie_embeddings

    specs.append(ParamSpec("embedding.word_embeddings.weight", (padded_vocab_size, h), "vocab",
                           stage_hint="first", split_units=padded_vocab_size, split_label="padded_vocab_size",
                           tied_local_name="output_layer.weight" if tied else None))
    if position_embedding_type == "learned_absolute":
        if not max_sequence_length:
            raise ValueError("learned_absolute position embeddings need max_sequence_length")
        specs.append(ParamSpec("embedding.position_embeddings.weight", (max_sequence_length, h), "replicated",
                               stage_hint="first"))

    def norm(prefix, size=h, **kw):
        specs.append(ParamSpec(f"{prefix}.weight", (size,), "replicated", **kw))
        if ln_bias:
            specs.append(ParamSpec(f"{prefix}.bias", (size,), "replicated", **kw))

    qkv_rows = (nq + 2 * ng) * hd
    heads = dict(split_units=nq, split_label="num_attention_heads")
    groups = dict(split_units=ng, split_label="num_query_groups")
    for i in range(num_layers):
        pre = f"decoder.layers.{i}"
        norm(f"{pre}.input_layernorm", layer=i)
        # Attention.__init__ builds linear_proj before SelfAttention builds linear_qkv.
        specs.append(ParamSpec(f"{pre}.self_attention.linear_proj.weight", (h, nq * hd), "row", layer=i, **heads))
        if add_bias_linear:
            specs.append(ParamSpec(f"{pre}.self_attention.linear_proj.bias", (h,), "replicated", layer=i))
        specs.append(ParamSpec(f"{pre}.self_attention.linear_qkv.weight", (qkv_rows, h), "qkv", layer=i, **groups))
        if add_bias_linear or add_qkv_bias:
            specs.append(ParamSpec(f"{pre}.self_attention.linear_qkv.bias", (qkv_rows,), "qkv", layer=i, **groups))
        if qk_layernorm:
            norm(f"{pre}.self_attention.q_layernorm", hd, layer=i)
            norm(f"{pre}.self_attention.k_layernorm", hd, layer=i)
        norm(f"{pre}.pre_mlp_layernorm", layer=i)
        if num_experts and (moe_layers is None or moe_layers[i]):
            specs.extend(_moe_specs(pre, i, h, num_experts, moe_ffn_hidden_size or ffn, swiglu, add_bias_linear))
        else:
            specs.extend(_mlp_specs(f"{pre}.mlp", h, ffn, swiglu, add_bias_linear, "ffn_hidden_size", layer=i))
    norm("decoder.final_layernorm", stage_hint="last")
    if head == "lm":
        if untie_embeddings:
            specs.append(ParamSpec("output_layer.weight", (padded_vocab_size, h), "vocab", stage_hint="last",
                                   split_units=padded_vocab_size, split_label="padded_vocab_size"))
    else:
        specs.append(ParamSpec("value_head.weight", (1, h), "replicated", stage_hint="last"))
    return specs


def _checked_head_dim(head: str, normalization: str, hidden_size: int, num_attention_heads: int,
                      num_query_groups: int, kv_channels: Optional[int]) -> int:
    """gpt_param_specs' arguments checked (ValueError naming the one that is wrong); returns the
    head dimension (``kv_channels``, default hidden / heads)."""
    if head not in ("lm", "value", "score"):
        raise ValueError(f"head must be 'lm', 'value' or 'score', got {head!r}")
    if normalization not in ("RMSNorm", "LayerNorm"):
        raise ValueError(f"normalization must be 'RMSNorm' or 'LayerNorm', got {normalization!r}")
    if num_attention_heads % num_query_groups:
        raise ValueError(f"num_attention_heads={num_attention_heads} is not divisible by "
                         f"num_query_groups={num_query_groups}")
    if kv_channels is None:
        if hidden_size % num_attention_heads:
            raise ValueError(f"hidden_size={hidden_size} is not divisible by num_attention_heads={num_attention_heads}")
        kv_channels = hidden_size // num_attention_heads
    return kv_channels


def _mlp_specs(prefix: str, h: int, ffn: int, swiglu: bool, bias: bool, split_label: str,
               **where) -> List[ParamSpec]:
    """megatron's MLP at ``prefix`` (a dense layer's, or one expert's): linear_fc1 (the gate and
    up halves with SwiGLU) and linear_fc2 with their biases, split over ``ffn``; ``where`` places
    them (layer, expert)."""
    ffns = dict(split_units=ffn, split_label=split_label)
    fc1_rows, fc1_kind = (2 * ffn, "swiglu_fc1") if swiglu else (ffn, "column")
    out = [ParamSpec(f"{prefix}.linear_fc1.weight", (fc1_rows, h), fc1_kind, **where, **ffns)]
    if bias:
        out.append(ParamSpec(f"{prefix}.linear_fc1.bias", (fc1_rows,), fc1_kind, **where, **ffns))
    out.append(ParamSpec(f"{prefix}.linear_fc2.weight", (h, ffn), "row", **where, **ffns))
    if bias:
        out.append(ParamSpec(f"{prefix}.linear_fc2.bias", (h,), "replicated", **where))
    return out


def _moe_specs(pre: str, i: int, h: int, num_experts: int, ffn: int, swiglu: bool, bias: bool) -> List[ParamSpec]:
    """The MoELayer of layer ``i``: the router, then each expert's MLP (SequentialMLP)."""
    if bias:
        raise ValueError("MoE layers with linear biases are not supported")
    out = [ParamSpec(f"{pre}.mlp.router.weight", (num_experts, h), "replicated", layer=i)]
    for e in range(num_experts):
        out.extend(_mlp_specs(f"{pre}.mlp.experts.local_experts.{e}", h, ffn, swiglu, False, "moe_ffn_hidden_size",
                              layer=i, expert=e, num_experts=num_experts))
    return out


_EXPERT_RE = re.compile(r"(\.mlp\.experts\.local_experts\.)(\d+)\.")


def expert_local_name(name: str, local_index: int) -> str:
    """``name`` (an expert's parameter) with its expert index replaced by ``local_index``: with
    E expert-parallel ranks, rank ep holds experts ``[ep * n, (ep + 1) * n)`` (n = num_experts / E)
    and megatron numbers them ``local_experts.0 .. n-1`` (SequentialMLP)."""
    new, count = _EXPERT_RE.subn(lambda m: f"{m.group(1)}{local_index}.", name)
    if count != 1:
        raise ValueError(f"{name} is not an expert's parameter")
    return new


def expert_holding(spec: ParamSpec, E: int) -> Tuple[int, int]:
    """(expert-parallel rank, local expert index) of the rank holding expert ``spec.expert``
    when the layer's experts are split in E contiguous blocks."""
    if spec.num_experts % E:
        raise PlanError(f"num_experts={spec.num_experts} is not divisible by E={E} (parameter {spec.name})")
    n = spec.num_experts // E
    return spec.expert // n, spec.expert % n


# ---- pipeline stages --------------------------------------------------------------------------
def num_layers_of(specs: Sequence[ParamSpec]) -> int:
    layers = [s.layer for s in specs if s.layer is not None]
    return max(layers) + 1 if layers else 0


def resolve_layers_per_stage(num_layers: int, P: int, layers_per_stage: Optional[Sequence[int]] = None,
                             what: str = "plan") -> List[int]:
    """Layers on each of the P stages: even split by default (PlanError if num_layers % P),
    or an explicit list of P non-negative counts summing to num_layers."""
    if layers_per_stage is None:
        if num_layers % P:
            raise PlanError(f"num_layers={num_layers} is not divisible by P={P} of {what}; "
                            f"pass an explicit layers_per_stage for an uneven split")
        return [num_layers // P] * P
    lps = [int(x) for x in layers_per_stage]
    if len(lps) != P or any(x < 0 for x in lps) or sum(lps) != num_layers:
        raise PlanError(f"layers_per_stage={list(layers_per_stage)} of {what} must be P={P} non-negative "
                        f"counts summing to num_layers={num_layers}")
    return lps


def stage_of_layer(layer: int, layers_per_stage: Sequence[int]) -> int:
    """Pipeline stage holding global layer ``layer``."""
    end = 0
    for p, n in enumerate(layers_per_stage):
        end += n
        if layer < end:
            return p
    raise ValueError(f"layer {layer} outside the {end} layers of layers_per_stage={list(layers_per_stage)}")


def _stage_offset(p: int, layers_per_stage: Sequence[int]) -> int:
    if not 0 <= p < len(layers_per_stage):
        raise ValueError(f"stage {p} outside P={len(layers_per_stage)}")
    return sum(layers_per_stage[:p])


def local_name(global_name: str, p: int, layers_per_stage: Sequence[int]) -> str:
    """Global parameter name -> the name megatron uses on stage p (local layer index)."""
    m = _LAYER_RE.match(global_name)
    if not m:
        return global_name
    layer, rest = int(m.group(1)), m.group(2)
    if stage_of_layer(layer, layers_per_stage) != p:
        raise ValueError(f"{global_name} is not on stage {p} (layers_per_stage={list(layers_per_stage)})")
    return f"decoder.layers.{layer - _stage_offset(p, layers_per_stage)}.{rest}"


def global_name(local: str, p: int, layers_per_stage: Sequence[int]) -> str:
    """Name on stage p (local layer index) -> global parameter name."""
    m = _LAYER_RE.match(local)
    if not m:
        return local
    i, rest = int(m.group(1)), m.group(2)
    if not 0 <= i < layers_per_stage[p]:
        raise ValueError(f"{local}: stage {p} has only {layers_per_stage[p]} layers")
    return f"decoder.layers.{i + _stage_offset(p, layers_per_stage)}.{rest}"


def params_on_stage(specs: Sequence[ParamSpec], p: int, P: int,
                    layers_per_stage: Optional[Sequence[int]] = None) -> List[Tuple[str, ParamSpec]]:
    """(local name, spec) of every parameter stage p of P holds, in spec order. With tied
    embeddings and P > 1 the last stage holds the word embeddings as ``tied_local_name``."""
    lps = resolve_layers_per_stage(num_layers_of(specs), P, layers_per_stage)
    out, tied = [], []
    for s in specs:
        if s.layer is not None:
            if stage_of_layer(s.layer, lps) == p:
                out.append((local_name(s.name, p, lps), s))
        elif s.stage_hint == "first" and p == 0:
            out.append((s.name, s))
        elif s.stage_hint == "last" and p == P - 1:
            out.append((s.name, s))
        if s.tied_local_name and P > 1 and p == P - 1:
            tied.append((s.tied_local_name, s))
    return out + tied
