"""What a run trades for memory at long sequences: activation recompute, offloading during
generation, the generation KV budget (Megatron-LM's flags and meanings). Part of the configuration
(puzzle/config.py re-exports these): the memory model, --dry-run and the plan search read them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from puzzle.config_flags import check, check_at_least, flag

_MEMORY = "memory levers (long sequences; docs/ppo.md)"
RECOMPUTE_GRANULARITIES = ("full", "selective")
RECOMPUTE_METHODS = ("uniform", "block")


@dataclass(frozen=True)
class Recompute:
    """Megatron's activation recompute of a model's transformer layers (TransformerConfig's
    recompute_granularity / recompute_method / recompute_num_layers); all None: none."""

    granularity: Optional[str] = None
    method: Optional[str] = None
    num_layers: Optional[int] = None


@dataclass(frozen=True)
class MemoryLevers:
    """What a run trades for memory at long sequences (Megatron-LM's flags and meanings). Every
    lever is off by default; the memory model, --dry-run and the plan search read them here."""

    recompute_granularity: Optional[str] = flag(
        None, _MEMORY, "Activation recompute in training (Megatron-LM): full recomputes whole transformer "
        "layers (--recompute-method, --recompute-num-layers), selective the core attention only.",
        type=str, choices=RECOMPUTE_GRANULARITIES,
        switches=(("--recompute-activations", "selective",
                   "Megatron-LM's alias of --recompute-granularity selective."),))
    recompute_method: Optional[str] = flag(
        None, _MEMORY, "With --recompute-granularity full: uniform recomputes every group of "
        "--recompute-num-layers layers, block the first --recompute-num-layers layers of each pipeline stage.",
        type=str, choices=RECOMPUTE_METHODS)
    recompute_num_layers: Optional[int] = flag(
        None, _MEMORY, "Layers per recompute group (uniform) or recomputed per pipeline stage (block).", type=int)
    rl_offload_optimizer_during_inference: bool = flag(
        False, _MEMORY, "Megatron-LM RL: the trainable models' gradients and optimizer states go to (pinned) "
        "host memory after the optimizer step and come back before training; the frozen models' weights are "
        "on the host during generation.")
    inference_dynamic_batching_buffer_size_gb: Optional[float] = flag(
        None, _MEMORY, "KV-cache GiB per rank for generation (Megatron-LM's inference flag): as many sequences "
        "are live at once as fit (the --generation-micro-batch-size it sets); waiting prompts take the slots of "
        "finished ones. Default: every sequence of the rank at once.", type=float)

    def __post_init__(self):
        cls = MemoryLevers
        full = self.recompute_granularity == "full"
        check(cls, self, "recompute_method", full == (self.recompute_method is not None),
              "needs --recompute-granularity full" if not full else
              "--recompute-granularity full needs --recompute-method uniform or block")
        check(cls, self, "recompute_num_layers", full == (self.recompute_num_layers is not None),
              "needs --recompute-granularity full" if not full else
              "--recompute-granularity full needs --recompute-num-layers N")
        check_at_least(cls, self, 1, "recompute_num_layers", optional=True)
        check_at_least(cls, self, 0, "inference_dynamic_batching_buffer_size_gb", strict=True, optional=True)

    @property
    def recompute(self) -> Recompute:
        return Recompute(self.recompute_granularity, self.recompute_method, self.recompute_num_layers)
