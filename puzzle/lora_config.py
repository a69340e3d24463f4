"""LoRA of the actor: its flags and the checks that need the model's shape.

The names and meanings are Megatron-Bridge's (``megatron.bridge.peft.lora.LoRA``): ``target_modules``
(linear_qkv, linear_proj, linear_fc1, linear_fc2), ``dim`` (the rank r), ``alpha`` (the output of
the adapter is scaled by alpha / dim), ``dropout`` (on the adapter's input, Bridge's default
'pre' position); A starts Xavier-normal and B at zero (Bridge's defaults), so a fresh adapter
leaves the model unchanged. Its parameters are named as Bridge names them:
``<linear>.adapter.linear_in.weight`` (A, [dim, in]) and ``<linear>.adapter.linear_out.weight``
(B, [out, dim]). puzzle/models/lora.py builds them.

In a mixture-of-experts layer linear_fc1 and linear_fc2 name every expert's linears, as in Bridge
(its ``is_expert_linear``: the expert linears of megatron's SequentialMLP match the same target
names): each expert gets adapters of its own, held by the ranks that hold the expert (split over
E) and split over the expert-tensor-parallel ranks (ETP) like the expert's weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from puzzle.config_flags import check, fail, flag

_LORA = "LoRA of the actor (Megatron-Bridge's names: target_modules, dim, alpha, dropout)"
#: the critic's own flags (--critic-lora-dim, ...): unset, the critic has no LoRA (nothing of the actor's)
_CRITIC = dict(roles=("critic",), role_group="LoRA of the critic (--critic-lora-*; default: none, nothing shared "
                                             "with the actor's)")
#: the linears LoRA may adapt: megatron-core's names in its GPT layer (Bridge's target_modules)
LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
#: the column-parallel targets (output split over T); the others are row-parallel (input split)
COLUMN_TARGETS = ("linear_qkv", "linear_fc1")


def _module_list(text) -> Tuple[str, ...]:
    """--lora-target-modules: names separated by commas or spaces."""
    if isinstance(text, (tuple, list)):
        return tuple(text)
    return tuple(name for name in text.replace(",", " ").split() if name)


@dataclass(frozen=True)
class LoRAConfig:
    """The actor's LoRA adapters; ``dim`` None: no LoRA (full-parameter training)."""

    dim: Optional[int] = flag(
        None, _LORA, "LoRA rank (Bridge's dim): train rank-DIM adapters on the actor's --lora-target-modules "
        "while its base weights stay frozen (no gradients, no optimizer state). Default: no LoRA.", type=int,
        name="--lora-dim", role_help="The critic's LoRA rank: its base frozen, its adapters and its value head "
                                     "(trained fully) train. Default: no LoRA.", **_CRITIC)
    alpha: float = flag(32.0, _LORA, "LoRA alpha (Bridge's): the adapter's output is scaled by alpha / dim.",
                        type=float, name="--lora-alpha", role_help="The critic's LoRA alpha (default 32).", **_CRITIC)
    dropout: float = flag(0.0, _LORA, "Dropout on the adapter's input (Bridge's dropout, position 'pre').",
                          type=float, name="--lora-dropout", role_help="The critic's LoRA dropout (default 0).",
                          **_CRITIC)
    target_modules: Tuple[str, ...] = flag(
        LORA_TARGETS, _LORA, f"Linears that get adapters, comma-separated (Bridge's target_modules; default all: "
        f"{','.join(LORA_TARGETS)}). Column-parallel ones (linear_qkv, linear_fc1) split B over T, row-parallel ones "
        "(linear_proj, linear_fc2) split A.", type=_module_list, name="--lora-target-modules",
        role_help="The critic's target linears (default all four).", **_CRITIC)

    def __post_init__(self):
        cls = LoRAConfig
        object.__setattr__(self, "target_modules", _module_list(self.target_modules))
        check(cls, self, "dim", self.dim is None or self.dim > 0, f"must be > 0 (got {self.dim})")
        check(cls, self, "alpha", self.alpha > 0, f"must be > 0 (got {self.alpha})")
        check(cls, self, "dropout", 0.0 <= self.dropout < 1.0, f"must be in [0, 1) (got {self.dropout})")
        unknown = [m for m in self.target_modules if m not in LORA_TARGETS]
        check(cls, self, "target_modules", not unknown and bool(self.target_modules),
              f"{', '.join(unknown) or 'nothing'}: not a linear of the model (choose from {', '.join(LORA_TARGETS)})")

    @property
    def enabled(self) -> bool:
        return self.dim is not None

    @property
    def scale(self) -> float:
        return self.alpha / self.dim


def target_shapes(arch, ffn=None) -> dict:
    """(out, in) of each target linear of one transformer layer of ``arch`` (a ModelArch); ``ffn``:
    the MLP's hidden size (default the dense MLP's; an expert's: its moe_ffn_hidden_size)."""
    h, heads = arch.hidden_size, arch.num_attention_heads
    kv = arch.kv_channels or h // heads
    groups = arch.num_query_groups or heads
    ffn = ffn or arch.ffn_hidden_size or 4 * h
    return {"linear_qkv": ((heads + 2 * groups) * kv, h), "linear_proj": (h, heads * kv),
            "linear_fc1": ((2 if arch.swiglu else 1) * ffn, h), "linear_fc2": (h, ffn)}


def _present_shapes(arch) -> list:
    """(target, what to call it, (out, in)) of the target linears ``arch`` has: attention's, the
    dense MLPs' (when a layer is dense) and the experts' (when a layer is a MoE layer)."""
    dense = target_shapes(arch)
    layers = range(arch.num_layers)
    has_dense_mlp = not arch.is_moe or any(not arch.is_moe_layer(i) for i in layers)
    out = [(m, m, dense[m]) for m in ("linear_qkv", "linear_proj")]
    if has_dense_mlp:
        out += [(m, m, dense[m]) for m in ("linear_fc1", "linear_fc2")]
    if arch.is_moe:
        expert = target_shapes(arch, arch.moe_ffn_hidden_size)
        out += [(m, f"an expert's {m}", expert[m]) for m in ("linear_fc1", "linear_fc2")]
    return out


def check_lora(lora: LoRAConfig, arch, transformer_impl: str = "local", actor_plans=(), prefix: str = "") -> None:
    """Refuse LoRA the actor cannot have, naming the flag: a rank larger than a target linear's smaller
    side (the experts' linears too); not yet: transformer_engine layers (TE fuses the layernorm into linear_qkv and
    linear_fc1, whose input is then not the adapter's; sequence parallelism, which needs TE, is not
    handled by the adapters either). Checkpoints hold the adapters (puzzle.checkpointing). A generation
    layout other than training's on the same ranks is fine: the switch moves the adapters and generation
    merges them (puzzle/switch/lora_merge.py); on other ranks (``actor_plans``: training, generation),
    a generation pool, not yet: the cross-pool switch moves the base only. ``prefix``: the role's
    ("critic-": its flags are --critic-lora-*)."""
    dim_flag = f"--{prefix}lora-dim"
    if not lora.enabled:
        for name, value, default in (("alpha", lora.alpha, 32.0), ("dropout", lora.dropout, 0.0)):
            if value != default:
                fail(f"--{prefix}lora-{name}", f"needs {dim_flag}")
        return
    for target, module, (out, inp) in _present_shapes(arch):
        if target in lora.target_modules and lora.dim > min(out, inp):
            fail(dim_flag, f"{lora.dim} is larger than {module}'s smaller side {min(out, inp)} "
                               f"(its weight is {out} x {inp})")
    experts_adapted = arch.is_moe and {"linear_fc1", "linear_fc2"} & set(lora.target_modules)
    if experts_adapted and getattr(arch, "moe_grouped_gemm", False) and lora.dim % 8:
        fail(dim_flag, f"{lora.dim} with --moe-grouped-gemm: the experts' adapters are grouped products too, whose "
                           "operands' strides must be 16-byte multiples: a multiple of 8")
    if transformer_impl != "local":
        fail(dim_flag, f"needs --transformer-impl local for now (got {transformer_impl}): LoRA on transformer_engine "
                           "layers is not supported yet")
    if len(actor_plans) == 2 and actor_plans[1] is not None and set(actor_plans[0].ranks) != set(actor_plans[1].ranks):
        fail("--actor-gen-rank-offset", f"a LoRA actor's generation pool (generation layout {actor_plans[1]} on other "
                                        f"ranks than training's {actor_plans[0]}) is not supported yet: the cross-pool "
                                        "switch moves the base weights only")
