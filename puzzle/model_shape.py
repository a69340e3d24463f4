"""The shape of one decoder model: the one type the planner (puzzle/plan_search/) and the runs
(``ModelArch.shape``) use for parameter counts, the KV cache and plan checks (pure Python).

A LLaMA-style decoder (RMSNorm, rotary positions, untied embedding and head), dense or with
mixture-of-experts MLPs. ``vocab_size`` is the model's vocabulary rows after padding
(``ModelArch.padded_vocab_size``). The per-shape functions below (``layer_params``,
``mlp_matrices``...) take anything with these attributes (a profile's layer table too).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from puzzle.parallel.plan import ParallelPlan, PlanError


def head_size_if_unusual(shape) -> Optional[int]:
    """``kv_channels`` when it differs from hidden / heads (Qwen3), else None."""
    kvc = getattr(shape, "kv_channels", None)
    return None if kvc is None or kvc * shape.num_attention_heads == shape.hidden_size else int(kvc)


def layer_params(shape) -> Tuple[int, int]:
    """(TP-split parameters, TP-replicated parameters) of one transformer layer."""
    h, f = shape.hidden_size, shape.ffn_hidden_size
    head = head_size_if_unusual(shape)
    if head is None:
        kv = h * shape.num_query_groups // shape.num_attention_heads
        split = h * (h + 2 * kv) + h * h + (3 if shape.swiglu else 2) * h * f
    else:  # queries of heads x head size, keys and values of groups x head size
        q, kv = head * shape.num_attention_heads, head * shape.num_query_groups
        split = h * (q + 2 * kv) + q * h + (3 if shape.swiglu else 2) * h * f
    return split, 2 * h  # two RMSNorm weights are replicated across TP


def lora_layer_params(shape, dim: int, targets) -> Tuple[float, float]:
    """(TP-split, TP-replicated) LoRA adapter parameters of one (average) layer, the experts' apart
    (:func:`lora_expert_layer_params`; puzzle/models/lora.py): rank-``dim`` A [dim, in] and B
    [out, dim] on each target linear; a column-parallel linear (linear_qkv, linear_fc1) splits B
    over T and replicates A, a row-parallel one (linear_proj, linear_fc2) splits A and replicates B.
    linear_fc1 / linear_fc2 of a MoE model count in its dense layers only."""
    h, f = shape.hidden_size, shape.ffn_hidden_size
    q = (head_size_if_unusual(shape) or h // shape.num_attention_heads) * shape.num_attention_heads
    out_in = {"linear_qkv": (q + 2 * shape.kv_dim, h), "linear_proj": (h, q),
              "linear_fc1": ((2 if shape.swiglu else 1) * f, h), "linear_fc2": (h, f)}
    dense_mlp = 1.0 - moe_fraction(shape)
    split = replicated = 0
    for target in targets:
        out, inp = out_in[target]
        column = target in ("linear_qkv", "linear_fc1")
        share = dense_mlp if target in ("linear_fc1", "linear_fc2") else 1
        split += share * dim * (out if column else inp)
        replicated += share * dim * (inp if column else out)
    return split, replicated


def lora_expert_layer_params(shape, dim: int, targets) -> Tuple[float, float]:
    """(ETP-split, ETP-replicated) adapter parameters of all experts of an average layer: each
    expert's linear_fc1 and linear_fc2 adapted like a dense MLP's (0 for a dense model)."""
    if not shape.num_experts:
        return 0.0, 0.0
    h, f = shape.hidden_size, shape.moe_ffn_hidden_size
    per_expert = {"linear_fc1": ((2 if shape.swiglu else 1) * f * dim, h * dim), "linear_fc2": (f * dim, h * dim)}
    chosen = [per_expert[t] for t in targets if t in per_expert]
    experts = moe_fraction(shape) * shape.num_experts
    return experts * sum(s for s, _ in chosen), experts * sum(r for _, r in chosen)


def mlp_matrices(shape) -> int:
    """Weight matrices of one (expert or dense) MLP: 3 with SwiGLU (gate, up, down), else 2."""
    return 3 if shape.swiglu else 2


def expert_params(shape) -> int:
    """Parameters of one expert's MLP."""
    return mlp_matrices(shape) * shape.hidden_size * shape.moe_ffn_hidden_size


def moe_fraction(shape) -> float:
    """Share of the layers whose MLP is a MoE layer."""
    return shape.n_moe_layers / shape.num_layers if shape.num_experts else 0.0


def expert_params_per_layer(shape) -> float:
    """Expert parameters of an average layer (all experts, before any split)."""
    return moe_fraction(shape) * shape.num_experts * expert_params(shape)


@dataclass(frozen=True)
class ModelShape:
    """A LLaMA-style decoder (RMSNorm, rotary positions, untied embedding and head)."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    vocab_size: int
    swiglu: bool = True
    # mixture of experts: 0 experts = a dense model; ``moe_layers`` of the layers have a MoE MLP
    # (default all), the others a dense MLP of ffn_hidden_size
    num_experts: int = 0
    moe_ffn_hidden_size: int = 0
    moe_router_topk: int = 0
    moe_layers: Optional[int] = None
    moe_dispatcher: str = "alltoall"
    kv_channels: Optional[int] = None  # projection size per head (None: hidden / heads)

    def __post_init__(self):
        if self.num_experts and not (1 <= self.moe_router_topk <= self.num_experts and self.moe_ffn_hidden_size >= 1
                                     and 0 <= self.n_moe_layers <= self.num_layers):
            raise ValueError(f"ModelShape: inconsistent MoE fields (num_experts={self.num_experts}, "
                             f"topk={self.moe_router_topk}, moe_ffn_hidden_size={self.moe_ffn_hidden_size}, "
                             f"moe_layers={self.moe_layers} of {self.num_layers})")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def n_moe_layers(self) -> int:
        """Layers with a MoE MLP (``moe_layers``, default every layer of a MoE model)."""
        if not self.is_moe:
            return 0
        return self.num_layers if self.moe_layers is None else self.moe_layers

    @property
    def kv_dim(self) -> int:
        """Width of a token's keys (and of its values) in one layer: query groups x head size."""
        if self.kv_channels is not None:
            return self.kv_channels * self.num_query_groups
        return self.hidden_size * self.num_query_groups // self.num_attention_heads

    def kv_bytes_per_token(self, T: int, bytes_per_value: int) -> float:
        """The one KV-cache formula: bytes of one token's keys and values in one layer on a rank
        of tensor-parallel degree T (the query groups split over T). Exact: T divides the groups."""
        return 2.0 * self.kv_dim / T * bytes_per_value

    def kv_bytes_per_sequence(self, seq_len: int, plan: ParallelPlan, bytes_per_value: int) -> float:
        """KV-cache bytes of one sequence of ``seq_len`` tokens on a rank of ``plan`` (its stage's
        layers): the memory model's and --inference-dynamic-batching-buffer-size-gb's."""
        return seq_len * self.kv_bytes_per_token(plan.T, bytes_per_value) * (self.num_layers // plan.P)

    @property
    def compute_shape(self) -> "ModelShape":
        """The dense shape whose layer does a MoE layer's per-rank work (active parameters: an
        MLP ``topk`` experts wide, averaged with the dense layers); a dense model itself."""
        if not self.is_moe:
            return self
        active = ((self.num_layers - self.n_moe_layers) * self.ffn_hidden_size
                  + self.n_moe_layers * self.moe_router_topk * self.moe_ffn_hidden_size)
        return ModelShape(self.num_layers, self.hidden_size, round(active / self.num_layers),
                          self.num_attention_heads, self.num_query_groups, self.vocab_size, self.swiglu,
                          kv_channels=self.kv_channels)

    @property
    def layer_split_params(self) -> float:
        """Parameters of one layer that tensor parallelism splits (QKV, proj, dense MLP; averaged
        over the layers when some MLPs are MoE layers, whose experts are counted apart)."""
        split = layer_params(self)[0]
        if not self.is_moe:
            return split
        dense_mlp = mlp_matrices(self) * self.hidden_size * self.ffn_hidden_size
        return split - moe_fraction(self) * dense_mlp

    @property
    def layer_replicated_params(self) -> float:
        """Parameters of one layer every TP rank holds whole (the two RMSNorm weights; a MoE
        layer's router)."""
        repl = layer_params(self)[1]
        if not self.is_moe:
            return repl
        return repl + moe_fraction(self) * self.num_experts * self.hidden_size

    def head_params(self, lm_head: bool = True) -> int:
        return self.vocab_size * self.hidden_size if lm_head else self.hidden_size

    def param_count(self, lm_head: bool = True) -> int:
        """Embedding + layers (experts included) + final norm + head (LM head V*h, or a scalar
        value head h)."""
        L = self.num_layers
        n = (self.vocab_size * self.hidden_size + L * (self.layer_split_params + self.layer_replicated_params)
             + self.hidden_size + self.head_params(lm_head))
        return n if not self.is_moe else round(n + L * expert_params_per_layer(self))

    def active_param_count(self, lm_head: bool = True) -> int:
        """Parameters a token goes through (topk experts of each MoE layer)."""
        return self.compute_shape.param_count(lm_head) + (
            round(self.n_moe_layers * self.num_experts * self.hidden_size) if self.is_moe else 0)

    def check_plan(self, plan: ParallelPlan, what: str = "model") -> None:
        plan.check_model(num_layers=self.num_layers, num_attention_heads=self.num_attention_heads,
                         num_query_groups=self.num_query_groups, ffn_hidden_size=self.ffn_hidden_size,
                         hidden_size=self.hidden_size, what=what)
        if not self.is_moe:
            if plan.has_experts_split:
                raise PlanError(f"{what} has no experts: plan {plan} needs E=1 and ETP=T")
            return
        if self.num_experts % plan.E or self.moe_ffn_hidden_size % plan.ETP:
            raise PlanError(f"{what} cannot use plan {plan}: num_experts={self.num_experts} / E={plan.E} or "
                            f"moe_ffn_hidden_size={self.moe_ffn_hidden_size} / ETP={plan.ETP} is not whole")
