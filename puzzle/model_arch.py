"""The architecture of one role model (``ModelArch``): its shape, normalization, position
embeddings, MoE and attention backend, as Megatron-LM's model flags; each flag next to its field.

Split from puzzle/config.py, which composes it into a run's configuration (``RoleSpec.arch``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from puzzle.config_flags import check, check_at_least, flag
from puzzle.model_shape import ModelShape

#: --attention-backend values (Megatron-LM's names; see puzzle/models/attention_backend.py)
ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused", "local")

_MODEL = "model"
_MOE = "mixture of experts"
#: --moe-router-load-balancing-type values puzzle runs (Megatron-LM's names; sinkhorn is refused)
MOE_LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "none")
#: --moe-token-dispatcher-type values puzzle runs (flex needs DeepEP on GPUs)
MOE_DISPATCHERS = ("alltoall", "allgather")
#: roles whose model-shape and layout flags have prefixed overrides (--critic-num-layers)
ROLE_PREFIXED = ("critic", "reward", "ref")


def _shape_flag(default, text: str, **more):
    """A model-shape flag of the actor and reference, with --critic-/--reward-/--ref- overrides."""
    return flag(default, _MODEL, f"Actor/reference: {text}", type=int, flag_default=None, roles=ROLE_PREFIXED,
                role_help="{role}: " + text, role_group="{role} model (overrides; default: the actor's)", **more)


@dataclass(frozen=True)
class ModelArch:
    """Architecture of one role model. The defaults are Megatron-LM's (LayerNorm, learned absolute
    positions, GeLU MLP of 4 * hidden, tied embeddings, biases); ``ModelArch.llama(...)`` takes the
    LLaMA choices (LLAMA_CHOICES)."""

    num_layers: int = _shape_flag(2, "Number of transformer layers.")
    hidden_size: int = _shape_flag(64, "Transformer hidden size.")
    ffn_hidden_size: Optional[int] = _shape_flag(None, "MLP hidden size (default 4 * hidden size).")
    num_attention_heads: int = _shape_flag(4, "Number of attention heads.")
    num_query_groups: Optional[int] = _shape_flag(  # None = multi-head attention (groups = heads)
        None, "Query groups for grouped-query attention.")
    vocab_size: int = flag(
        256, _MODEL, "The model's vocabulary rows before padding (default: the tokenizer's; not smaller). Rows "
        "beyond the tokenizer's ids are never sampled nor scored. Stands in for the tokenizer's size when its "
        "files are not at hand (dry runs, planning).", type=int, flag_default=None)
    make_vocab_size_divisible_by: int = flag(128, _MODEL)
    seq_length: int = flag(128, _MODEL, "Maximum sequence length (prompt + response).", flag_default=None)
    max_position_embeddings: Optional[int] = flag(None, _MODEL, type=int)
    # flag_default None: an HF checkpoint decides these unless the flag is given (then they must agree)
    normalization: str = flag("LayerNorm", _MODEL, choices=("LayerNorm", "RMSNorm"), flag_default=None)
    norm_epsilon: float = flag(1e-5, _MODEL, type=float, flag_default=None)
    swiglu: bool = flag(False, _MODEL, "SwiGLU MLP (LLaMA).")
    position_embedding_type: str = flag("learned_absolute", _MODEL, choices=("learned_absolute", "rope"),
                                        flag_default=None)
    rotary_base: int = flag(10000, _MODEL, "RoPE base (--position-embedding-type rope).", type=int,
                            flag_default=None)
    untie_embeddings_and_output_weights: bool = flag(False, _MODEL)
    add_bias_linear: bool = flag(True, _MODEL, name="--disable-bias-linear", kind="negated")
    attention_dropout: float = flag(0.0, _MODEL)
    hidden_dropout: float = flag(0.0, _MODEL)
    init_method_std: float = flag(0.02, _MODEL, type=float, flag_default=None)
    kv_channels: Optional[int] = _shape_flag(None, "Projection size per head (default hidden / heads).")
    add_qkv_bias: bool = flag(False, _MODEL, "Biases on the q/k/v projections only (Qwen2); "
                              "--disable-bias-linear keeps them.")
    qk_layernorm: bool = flag(False, _MODEL, "Per-head norm of queries and keys (Qwen3).")
    # Llama-3.x RoPE frequency scaling (HF rope_type "llama3"); defaults are Megatron-LM's
    use_rope_scaling: bool = flag(False, _MODEL, "Llama-3.x RoPE frequency scaling.")
    rope_scaling_factor: float = flag(8.0, _MODEL, "Llama-3.x RoPE scaling factor (default 8).", flag_default=None)
    rope_low_freq_factor: float = flag(
        1.0, _MODEL, "Llama-3.x RoPE low_freq_factor (default 1).", flag_default=None)
    rope_high_freq_factor: float = flag(
        4.0, _MODEL, "Llama-3.x RoPE high_freq_factor (default 4).", flag_default=None)
    rope_original_max_position_embeddings: int = flag(
        8192, _MODEL, "Llama-3.x RoPE original_max_position_embeddings (default 8192).", flag_default=None)
    # mixture of experts (megatron-core's MoELayer, TopKRouter; Megatron-LM's flag names)
    num_experts: Optional[int] = flag(None, _MOE, "Experts per MoE layer (default: a dense model).", type=int)
    moe_ffn_hidden_size: Optional[int] = flag(
        None, _MOE, "Hidden size of each expert's MLP (default --ffn-hidden-size).", type=int)
    moe_router_topk: int = flag(2, _MOE, "Experts each token is routed to.", type=int, flag_default=None)
    moe_router_pre_softmax: bool = flag(
        False, _MOE, "Softmax over all experts before the top-k, the top-k probabilities not renormalised "
        "(HF norm_topk_prob=false); default: softmax over the top-k logits (norm_topk_prob=true, Mixtral).")
    #: per layer 1 = MoE, 0 = dense MLP (HF decoder_sparse_step / mlp_only_layers); None = every layer
    moe_layer_pattern: Optional[Tuple[int, ...]] = None
    moe_aux_loss_coeff: float = flag(0.0, _MOE, "Scale of the load-balancing loss (0: none).", type=float)
    moe_router_load_balancing_type: str = flag(
        "aux_loss", _MOE, "Load-balancing loss of the router.", choices=MOE_LOAD_BALANCING_TYPES)
    moe_token_dispatcher_type: str = flag(
        "allgather", _MOE, "How tokens reach their experts' ranks.", choices=MOE_DISPATCHERS)
    moe_grouped_gemm: bool = flag(
        False, _MOE, "Run each projection of a MoE layer's local experts as one grouped GEMM (torch._grouped_mm: "
        "CUTLASS on CUDA bf16 sm90) instead of one GEMM per expert, with the same parameters; needs no expert "
        "biases, and hidden size and expert width per expert-tensor-parallel rank multiples of 8.")
    sliding_window: Optional[int] = None  # attention window of the checkpoint (None = full)
    # the run's tokenizer has ids [0, tokenizer_vocab_size) (None: every row of vocab_size is a
    # token, also when the tokenizer has more ids than rows); the model's rows beyond it (Qwen2.5's
    # unused rows, --vocab-size above the tokenizer's) are never sampled nor scored: see valid_vocab_size
    tokenizer_vocab_size: Optional[int] = None
    hf_model_type: str = "llama"       # the HF family an export writes (llama, qwen2, qwen3, mistral)
    attention_backend: str = flag(
        "auto", _MODEL, "Core attention (Megatron-LM's names): flash/fused/unfused = transformer-engine "
        "kernels (unfused without TE: megatron-core's own), local = torch SDPA, auto = TE if present, else "
        "SDPA on CUDA, else unfused on CPU.", choices=ATTENTION_BACKENDS, flag_default=None,
        switches=(("--use-flash-attn", "flash", "Megatron-LM's older name of --attention-backend flash."),))

    @classmethod
    def llama(cls, **fields) -> "ModelArch":
        """A LLaMA-architecture model: LLAMA_CHOICES, then ``fields``."""
        return cls(**{**LLAMA_CHOICES, **fields})

    def __post_init__(self):
        if self.ffn_hidden_size is None:
            object.__setattr__(self, "ffn_hidden_size", 4 * self.hidden_size)
        if self.num_query_groups is None:
            object.__setattr__(self, "num_query_groups", self.num_attention_heads)
        if self.max_position_embeddings is None:
            object.__setattr__(self, "max_position_embeddings", self.seq_length)
        explicit_kv_channels = self.kv_channels is not None
        if not explicit_kv_channels:
            object.__setattr__(self, "kv_channels", self.hidden_size // max(self.num_attention_heads, 1))
        cls = ModelArch
        check_at_least(cls, self, 1, "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                       "num_query_groups", "seq_length", "max_position_embeddings", "make_vocab_size_divisible_by",
                       "rotary_base")
        if self.vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1 (got {self.vocab_size})")
        if self.tokenizer_vocab_size is not None:
            if self.tokenizer_vocab_size < 1:
                raise ValueError(f"tokenizer_vocab_size must be >= 1 (got {self.tokenizer_vocab_size})")
            # every row is a token (the usual case), also when the tokenizer has ids beyond the rows
            # (an added pad: puzzle.data.tokenizers.fit_to_rows checks that none is ever fed)
            if self.tokenizer_vocab_size >= self.vocab_size:
                object.__setattr__(self, "tokenizer_vocab_size", None)
        check(cls, self, "hidden_size", explicit_kv_channels or self.hidden_size % self.num_attention_heads == 0,
              f"hidden_size={self.hidden_size} is not divisible by num_attention_heads={self.num_attention_heads} "
              "(or give --kv-channels)")
        check(cls, self, "num_query_groups", self.num_attention_heads % self.num_query_groups == 0,
              f"num_attention_heads={self.num_attention_heads} is not divisible by num_query_groups="
              f"{self.num_query_groups}")
        check(cls, self, "normalization", self.normalization in ("RMSNorm", "LayerNorm"),
              f"must be RMSNorm or LayerNorm (got {self.normalization!r})")
        check(cls, self, "position_embedding_type", self.position_embedding_type in ("rope", "learned_absolute"),
              f"must be rope or learned_absolute (got {self.position_embedding_type!r})")
        check(cls, self, "attention_backend", self.attention_backend in ATTENTION_BACKENDS,
              f"must be one of {', '.join(ATTENTION_BACKENDS)} (got {self.attention_backend!r})")
        check_at_least(cls, self, 1, "kv_channels")
        check_at_least(cls, self, 0, "init_method_std")
        check_at_least(cls, self, 0, "norm_epsilon", strict=True)
        for name in ("attention_dropout", "hidden_dropout"):
            value = getattr(self, name)
            check(cls, self, name, 0.0 <= value < 1.0, f"must lie in [0, 1) (got {value})")
        if self.use_rope_scaling:
            check(cls, self, "position_embedding_type", self.position_embedding_type == "rope",
                  "--use-rope-scaling needs rope")
            check_at_least(cls, self, 0, "rope_scaling_factor", strict=True)
            check_at_least(cls, self, 1, "rope_original_max_position_embeddings")
            check(cls, self, "rope_high_freq_factor", self.rope_high_freq_factor > self.rope_low_freq_factor,
                  f"{self.rope_high_freq_factor} must exceed --rope-low-freq-factor {self.rope_low_freq_factor}")
        self._check_moe()
        if self.sliding_window is not None and self.sliding_window < self.seq_length:
            check(cls, self, "seq_length", False,
                  f"sliding_window={self.sliding_window} is shorter than seq_length={self.seq_length}: "
                  "sliding-window attention is not implemented (use a seq_length <= the window)")

    def _check_moe(self) -> None:
        cls = ModelArch
        if self.moe_layer_pattern is not None:
            object.__setattr__(self, "moe_layer_pattern", tuple(int(x) for x in self.moe_layer_pattern))
        if self.num_experts is None:
            for name in ("moe_ffn_hidden_size", "moe_layer_pattern"):
                check(cls, self, "num_experts", getattr(self, name) is None, f"{name} needs --num-experts")
            return
        check_at_least(cls, self, 1, "num_experts", "moe_router_topk")
        if self.moe_ffn_hidden_size is None:
            object.__setattr__(self, "moe_ffn_hidden_size", self.ffn_hidden_size)
        check_at_least(cls, self, 1, "moe_ffn_hidden_size")
        check(cls, self, "moe_router_topk", self.moe_router_topk <= self.num_experts,
              f"{self.moe_router_topk} exceeds --num-experts {self.num_experts}")
        check_at_least(cls, self, 0, "moe_aux_loss_coeff")
        for name, allowed in (("moe_router_load_balancing_type", MOE_LOAD_BALANCING_TYPES),
                              ("moe_token_dispatcher_type", MOE_DISPATCHERS)):
            check(cls, self, name, getattr(self, name) in allowed,
                  f"must be one of {', '.join(allowed)} (got {getattr(self, name)!r})")
        pattern = self.moe_layer_pattern
        check(cls, self, "num_experts", pattern is None or (len(pattern) == self.num_layers
                                                            and set(pattern) <= {0, 1} and 1 in pattern),
              f"the MoE layer pattern {pattern} must give 0 or 1 for each of the {self.num_layers} layers, "
              "one at least 1")

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    def is_moe_layer(self, layer: int) -> bool:
        """Whether global layer ``layer`` has a MoE MLP (else a dense one)."""
        return self.is_moe and (self.moe_layer_pattern is None or bool(self.moe_layer_pattern[layer]))

    @property
    def valid_vocab_size(self) -> int:
        """The ids a response token may have: [0, valid_vocab_size), the tokenizer's ids.

        The one definition used wherever a distribution over the vocabulary is formed: sampling
        (every generation path), scoring, training, entropy and the KL terms all give the logits of
        the other rows -inf, so an id the tokenizer cannot decode is never sampled, and the
        log-prob generation sampled a token with is the one scoring computes. Rows beyond it are
        the checkpoint's unused rows (Qwen2.5: 151936 rows, ~151665 tokenizer ids) and the padding
        to make_vocab_size_divisible_by.
        """
        return self.tokenizer_vocab_size or self.vocab_size

    @property
    def shape(self) -> ModelShape:
        """The model's shape (the planner's type: parameter counts, KV cache, plan checks)."""
        moe = {} if not self.is_moe else dict(
            num_experts=self.num_experts, moe_ffn_hidden_size=self.moe_ffn_hidden_size,
            moe_router_topk=self.moe_router_topk, moe_dispatcher=self.moe_token_dispatcher_type,
            moe_layers=self.num_layers if self.moe_layer_pattern is None else sum(self.moe_layer_pattern))
        return ModelShape(num_layers=self.num_layers, hidden_size=self.hidden_size,
                          ffn_hidden_size=self.ffn_hidden_size, num_attention_heads=self.num_attention_heads,
                          num_query_groups=self.num_query_groups, vocab_size=self.padded_vocab_size,
                          swiglu=self.swiglu, kv_channels=self.kv_channels, **moe)

    @property
    def padded_vocab_size(self) -> int:
        """The vocabulary padded to a multiple of make_vocab_size_divisible_by.

        Unlike Megatron-LM (which pads to a multiple of divisible_by * T), the padding does not
        depend on the layout: every model shape is the same at every (P, D, T), so weights move
        between layouts without re-padding. A plan whose T does not divide it is rejected.
        Logits of the padding ids (and of every row >= valid_vocab_size) are masked out wherever
        probabilities are formed.
        """
        multiple = self.make_vocab_size_divisible_by
        return -(-self.vocab_size // multiple) * multiple


#: the LLaMA architecture choices that differ from Megatron-LM's defaults (ModelArch.llama)
LLAMA_CHOICES = dict(normalization="RMSNorm", swiglu=True, position_embedding_type="rope",
                     untie_embeddings_and_output_weights=True, add_bias_linear=False)
