"""Role models on megatron-core GPTModel: actor/ref (LM head), critic (per-token value head),
reward (scalar score read at the last non-padding token).

Each builder takes a ModelArch and a Layout, never globals. The transformer-engine layer spec is
used when TE and CUDA are present, megatron-core's local spec otherwise.
"""

from __future__ import annotations

from typing import Optional

import torch

from puzzle.config import ROLES, ModelArch, Recompute
from puzzle.models.attention_backend import attention_layer_spec, te_attention_config
from puzzle.parallel.device import accelerator_available, runtime
from puzzle.parallel.groups import Layout



class ScalarHead(torch.nn.Module):
    """A [hidden] -> [1] projection in place of GPTModel's output layer.

    GPTModel calls ``output_layer(hidden, weight=..., runtime_gather_output=...)`` and, without
    labels, returns its output transposed to [batch, seq, 1]. The weight is replicated on every
    tensor-parallel rank (its input, the final-norm output, is replicated too), so its gradient is
    identical on every TP rank, like a layernorm weight's.
    """

    def __init__(self, hidden_size: int, dtype: torch.dtype, tp_group=None,
                 sequence_parallel: bool = False):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype))
        self.tp_group = tp_group
        # with sequence parallelism the final norm's output is split along the sequence: gather
        # it; every TP rank then computes the same scores, so the backward only takes this
        # rank's slice of the (identical) input gradient instead of reduce-scattering it
        self.gather_sequence = sequence_parallel
        self.sequence_parallel = False  # read by GPTModel; the gather happens here

    def forward(self, hidden_states, weight=None, runtime_gather_output=None):
        if self.gather_sequence:
            from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

            hidden_states = gather_from_sequence_parallel_region(
                hidden_states, tensor_parallel_output_grad=False, group=self.tp_group)
        return torch.nn.functional.linear(hidden_states, self.weight), None


def transformer_config(arch: ModelArch, layout: Layout, *, bf16: bool = False, fp16: bool = False,
                       recompute: Optional[Recompute] = None, sequence_parallel: bool = False,
                       transformer_impl: str = "local"):
    """megatron TransformerConfig of a model of shape ``arch`` in ``layout`` (``recompute``:
    Megatron's activation recompute in training; None: none)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    plan = layout.plan
    check_experts_split(arch, plan)
    plan.check_model(num_layers=arch.num_layers, num_attention_heads=arch.num_attention_heads,
                     num_query_groups=arch.num_query_groups, ffn_hidden_size=arch.ffn_hidden_size,
                     hidden_size=arch.hidden_size, padded_vocab_size=arch.padded_vocab_size)
    recompute = recompute or Recompute()
    params_dtype = torch.bfloat16 if bf16 else torch.float16 if fp16 else torch.float32
    on_gpu = accelerator_available()
    return TransformerConfig(**te_attention_config(arch.attention_backend, transformer_impl),
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_query_groups,
        kv_channels=arch.kv_channels,
        normalization=arch.normalization,
        layernorm_epsilon=arch.norm_epsilon,
        gated_linear_unit=arch.swiglu,
        activation_func=torch.nn.functional.silu if arch.swiglu else torch.nn.functional.gelu,
        add_bias_linear=arch.add_bias_linear,
        add_qkv_bias=arch.add_qkv_bias,
        qk_layernorm=arch.qk_layernorm,
        attention_dropout=arch.attention_dropout,
        hidden_dropout=arch.hidden_dropout,
        init_method_std=arch.init_method_std,
        tensor_model_parallel_size=plan.T,
        pipeline_model_parallel_size=plan.P,
        sequence_parallel=sequence_parallel and plan.T > 1,  # meaningless at T=1 (Megatron-LM too)
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=bf16,
        fp16=fp16,
        use_cpu_initialization=not on_gpu,
        # always: on megatron's CPU-init path the tensor-parallel attributes of a weight
        # (partition_dim, stride, read by grad clipping, checkpoints and resharding) are set only
        # while initialising it
        perform_initialization=True,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        recompute_granularity=recompute.granularity,
        recompute_method=recompute.method,
        recompute_num_layers=recompute.num_layers,
        variable_seq_lengths=False,
        deallocate_pipeline_outputs=False,
        **moe_config(arch, layout),
    )


def seed_model_rng(seed: int, layout: Layout) -> None:
    """Seed megatron's (process-wide) RNG tracker for a model in ``layout``.

    The tracker is one object per process, shared by all models, so it is reseeded with this
    model's TP rank right before the model is built or run with dropout.
    """
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(seed, tp_rank=max(layout.t, 0), ep_rank=max(layout.ep, 0),
                                    etp_rank=max(layout.etp, 0),
                                    force_reset_rng=True)


TRANSFORMER_IMPLS = ("transformer_engine", "local")


def resolve_transformer_impl(requested: str) -> tuple:
    """(impl to use, note or None): transformer_engine only where TE imports on a CUDA machine."""
    if requested not in TRANSFORMER_IMPLS:
        raise ValueError(f"--transformer-impl must be one of {', '.join(TRANSFORMER_IMPLS)} "
                         f"(got {requested!r})")
    if requested == "transformer_engine" and not te_available():
        why = "no CUDA device" if not accelerator_available() else "transformer_engine does not import"
        return "local", f"--transformer-impl transformer_engine: {why}; using the local implementation"
    return requested, None


def layer_spec(arch: ModelArch, transformer_impl: str = "local", layout: Optional[Layout] = None):
    """megatron-core's transformer-engine or local GPT layer spec, its core attention the one
    ``arch.attention_backend`` names (puzzle/models/attention_backend.py). A MoE model gets the
    block spec of ``layout``'s pipeline stage: each layer dense or MoE as ``arch`` says."""
    if transformer_impl == "transformer_engine" and not te_available():
        raise RuntimeError("transformer_impl='transformer_engine' needs CUDA and transformer_engine; "
                           "resolve it with resolve_transformer_impl first")
    if not arch.is_moe:
        return attention_layer_spec(arch.normalization, arch.attention_backend, transformer_impl,
                                    qk_layernorm=arch.qk_layernorm)
    from megatron.core.transformer.transformer_block import LayerNormImpl, TransformerBlockSubmodules

    from puzzle.models.param_layout import resolve_layers_per_stage

    p, P = (layout.p, layout.plan.P) if layout is not None else (0, 1)
    lps = resolve_layers_per_stage(arch.num_layers, P)
    first = sum(lps[:p])
    specs = {moe: attention_layer_spec(arch.normalization, arch.attention_backend, transformer_impl,
                                       qk_layernorm=arch.qk_layernorm, num_experts=arch.num_experts if moe else None,
                                       moe_grouped_gemm=arch.moe_grouped_gemm)
             for moe in (False, True)}
    return TransformerBlockSubmodules(
        layer_specs=[specs[arch.is_moe_layer(i)] for i in range(first, first + lps[p])], layer_norm=LayerNormImpl)


def moe_config(arch: ModelArch, layout: Layout) -> dict:
    """The TransformerConfig fields of a MoE model (megatron-core's MoELayer and TopKRouter)."""
    if not arch.is_moe:
        return {}
    return dict(
        num_moe_experts=arch.num_experts, moe_ffn_hidden_size=arch.moe_ffn_hidden_size,
        moe_router_topk=arch.moe_router_topk, moe_router_pre_softmax=arch.moe_router_pre_softmax,
        moe_router_score_function="softmax",
        moe_layer_freq=list(arch.moe_layer_pattern) if arch.moe_layer_pattern else 1,
        moe_aux_loss_coeff=arch.moe_aux_loss_coeff,
        moe_router_load_balancing_type=arch.moe_router_load_balancing_type,
        moe_token_dispatcher_type=arch.moe_token_dispatcher_type,
        moe_grouped_gemm=False, moe_permute_fusion=False,
        expert_model_parallel_size=layout.plan.E, expert_tensor_parallel_size=layout.plan.ETP,
    )


def build_role_model(role: str, arch: ModelArch, layout: Layout, *, bf16: bool = False,
                     fp16: bool = False, recompute: Optional[Recompute] = None,
                     head_seed: int = 0, layout_independent_init: bool = True,
                     transformer_impl: str = "local", sequence_parallel: bool = False
                     ) -> Optional[torch.nn.Module]:
    """GPTModel for ``role`` (actor, ref, critic, reward) in ``layout``; None off-layout.

    With ``layout_independent_init`` the weights depend only on (seed, role arch), not on the
    layout (see puzzle/models/init.py); otherwise megatron's own per-shard initialisation.
    """
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; expected one of {', '.join(ROLES)}")
    if not layout.member:
        return None
    from megatron.core.models.gpt import GPTModel

    from puzzle.models.rope import apply_rope_scaling

    config = transformer_config(arch, layout, bf16=bf16, fp16=fp16, recompute=recompute,
                                sequence_parallel=sequence_parallel, transformer_impl=transformer_impl)
    seed_model_rng(head_seed, layout)
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(arch, transformer_impl, layout),
        vocab_size=arch.padded_vocab_size,
        max_sequence_length=arch.max_position_embeddings,
        pre_process=layout.is_first_stage,
        post_process=layout.is_last_stage,
        parallel_output=True,
        # critic/reward replace the LM head with a scalar head: nothing to tie
        share_embeddings_and_output_weights=ROLES[role].lm_head and not arch.untie_embeddings_and_output_weights,
        position_embedding_type=arch.position_embedding_type,
        rotary_base=arch.rotary_base,
        pg_collection=layout.pg_collection,
    )
    apply_rope_scaling(model, arch)
    if not ROLES[role].lm_head and layout.is_last_stage:
        model.output_layer = ScalarHead(arch.hidden_size, config.params_dtype, layout.tp_group,
                                        config.sequence_parallel)
    model.puzzle_layout = layout
    if layout_independent_init:
        from puzzle.models.init import init_layout_independent

        init_layout_independent(model, arch, role, head_seed)
    model.puzzle_device = runtime().device  # every input of a model call must live here
    if config.params_dtype != torch.float32:
        # --bf16/--fp16 as in Megatron-LM (its Float16Module): every parameter in that precision,
        # the torch norms too (they are built in float32); fp32 main copies live in the optimizer
        return model.to(device=model.puzzle_device, dtype=config.params_dtype)
    return model.to(model.puzzle_device)


def te_available() -> bool:
    if not accelerator_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except (ImportError, RuntimeError):
        return False
    return True


def check_experts_split(arch: ModelArch, plan, what: str = "model") -> None:
    """PlanError when ``plan``'s E / ETP cannot split the experts of ``arch`` (or a dense model
    is given expert parallelism)."""
    from puzzle.parallel.plan import PlanError

    if not arch.is_moe:
        if plan.has_experts_split:
            raise PlanError(f"{what} has no experts: plan {plan} needs E=1 and ETP=T "
                            "(--expert-model-parallel-size / --expert-tensor-parallel-size)")
        return
    if arch.num_experts % plan.E:
        raise PlanError(f"{what} cannot use plan {plan}: num_experts={arch.num_experts} is not divisible by E={plan.E}")
    if arch.moe_ffn_hidden_size % plan.ETP:
        raise PlanError(f"{what} cannot use plan {plan}: moe_ffn_hidden_size={arch.moe_ffn_hidden_size} is not "
                        f"divisible by ETP={plan.ETP}")


def check_layout(arch: ModelArch, plan, role: str) -> None:
    """Raise PlanError naming the role when ``arch`` cannot be split by ``plan``."""
    check_experts_split(arch, plan, role)
    plan.check_model(num_layers=arch.num_layers, num_attention_heads=arch.num_attention_heads,
                     num_query_groups=arch.num_query_groups, ffn_hidden_size=arch.ffn_hidden_size,
                     hidden_size=arch.hidden_size, padded_vocab_size=arch.padded_vocab_size, what=role)
