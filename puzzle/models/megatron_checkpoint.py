"""Megatron-LM checkpoints in and out: megatron-core ``torch_dist`` checkpoints as Megatron-LM's
``pretrain_gpt.py`` writes and ``--load``\\ s them.

On disk (Megatron-LM's layout)::

    ROOT/latest_checkpointed_iteration.txt   "1000" (or "release")
    ROOT/iter_0001000/ (or ROOT/release/)    a dist_checkpointing directory:
        metadata.json                        {"sharded_backend": "torch_dist", ...} (megatron-core's)
        .metadata, __*_*.distcp              the tensors, keyed by their global names
        common.pt                            {"args": argparse.Namespace, "iteration",
                                              "checkpoint_version": 3.0, ...}

The model's tensors are ``GPTModel.sharded_state_dict()`` under the ``model`` key: global keys
(``decoder.layers.self_attention.linear_qkv.weight`` with the layers stacked on a leading axis),
so dist_checkpointing reshards them to any (P, D, T, E) on load. puzzle's models are megatron-core
GPTModels with the same keys under either layer spec (param_names), so a role model loads them
directly; the architecture comes from the checkpoint's args (``arch_from_megatron_args``).

Scalar heads (critic, reward) sit in GPTModel's ``output_layer`` slot as a [1, hidden] tensor
(builders.ScalarHead). An LM checkpoint has a [vocab, hidden] ``output_layer.weight`` (or none,
tied): a critic started from it keeps its fresh head; a reward model needs a scalar head
(puzzle.tools.make_value_model writes one).

``save_megatron_checkpoint`` writes a role model the same way as a ``release`` checkpoint: the
tracker says ``release``, which Megatron-LM loads as its ``--finetune`` does (iteration 0, no
optimizer or RNG state), for evaluation or further SFT. It keeps the layer spec's ``_extra_state``
objects, which Megatron-LM's load asks for: a Megatron-LM run with the same
``--transformer-impl`` loads it as is; one with the other spec needs ``--dist-ckpt-strictness
log_all`` (its missing ``_extra_state`` entries are then skipped, as they hold no weights).
"""

from __future__ import annotations

import json
import os
import pickle
import types
from dataclasses import dataclass
from typing import Optional

from puzzle.config import ROLES, ModelArch
from puzzle.models.lora import ADAPTER_MARK
from puzzle.models.param_names import HEAD_LOCAL_NAME, drop_extra_state

TRACKER = "latest_checkpointed_iteration.txt"
COMMON = "common.pt"
RELEASE = "release"
#: Megatron-LM's checkpoint_version of torch_dist checkpoints (megatron/training/checkpointing.py)
CHECKPOINT_VERSION = 3.0


class MegatronCheckpointError(ValueError):
    """A directory that is not a Megatron-LM checkpoint puzzle can read; the message names it."""


@dataclass(frozen=True)
class MegatronCheckpoint:
    """One checkpoint of a Megatron-LM checkpoint root: its directory and iteration."""

    root: str
    dir: str                # ROOT/iter_XXXXXXX or ROOT/release
    iteration: int          # 0 for a release checkpoint
    release: bool

    def describe(self) -> str:
        return f"{self.root} ({'release' if self.release else f'iteration {self.iteration}'})"


def _is_dist_checkpoint_dir(d: str) -> bool:
    """megatron-core's dist_checkpointing config (metadata.json with a sharded backend) is there."""
    path = os.path.join(d, "metadata.json")
    if not os.path.isfile(path):
        return False
    try:
        with open(path) as f:
            return "sharded_backend" in json.load(f)
    except (ValueError, OSError, TypeError):
        return False


def find_megatron_checkpoint(root: Optional[str], step: Optional[int] = None) -> Optional[MegatronCheckpoint]:
    """The Megatron-LM checkpoint under ``root`` (its tracker's, or iteration ``step``), None when
    ``root`` is not one (no tracker, or the iteration's directory is not a megatron-core dist
    checkpoint, e.g. a puzzle run's checkpoint)."""
    if not root or not os.path.isfile(os.path.join(root, TRACKER)):
        return None
    with open(os.path.join(root, TRACKER)) as f:
        text = f.read().strip()
    release = text == RELEASE and step is None
    if not release:
        try:
            iteration = step if step is not None else int(text)
        except ValueError:
            return None
    d = os.path.join(root, RELEASE if release else f"iter_{iteration:07d}")
    if not _is_dist_checkpoint_dir(d) or not os.path.isfile(os.path.join(d, COMMON)):
        return None
    return MegatronCheckpoint(root, d, 0 if release else iteration, release)


def require_megatron_checkpoint(root: str, flag: str, step: Optional[int] = None) -> MegatronCheckpoint:
    ckpt = find_megatron_checkpoint(root, step)
    if ckpt is None:
        raise MegatronCheckpointError(
            f"{flag}: {root!r} is not a Megatron-LM checkpoint (expected {TRACKER} naming an iter_XXXXXXX/ or "
            f"release/ directory written by megatron-core dist_checkpointing in the torch_dist format)")
    return ckpt


class _Placeholder:
    """Stands for an object of a class this process cannot import (Megatron-LM's own classes in
    its args): unpickled, never used."""

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        pass


class _TolerantUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        try:
            return super().find_class(module, name)
        except (ImportError, AttributeError):
            return _Placeholder


class _TolerantPickle:
    """The ``pickle_module`` of torch.load for common.pt: Megatron-LM's args may hold objects of
    megatron.training classes, which this process does not have (and does not need)."""

    Unpickler = _TolerantUnpickler
    load = staticmethod(pickle.load)


def _load_common(path: str) -> dict:
    import torch

    return torch.load(path, map_location="cpu", weights_only=False, pickle_module=_TolerantPickle)


def _common_strategy():
    """megatron-core's common-state reader with _load_common (its own uses torch.load's
    weights-only mode, which refuses the args Namespace unless Megatron-LM allow-listed it)."""
    from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy

    class TolerantCommonLoad(TorchCommonLoadStrategy):
        def load_common(self, checkpoint_dir):
            return _load_common(os.path.join(checkpoint_dir, COMMON))

    return TolerantCommonLoad()


def read_common_state(ckpt: MegatronCheckpoint) -> dict:
    """The checkpoint's common (non-tensor) state: args, iteration, checkpoint_version, ..."""
    path = os.path.join(ckpt.dir, COMMON)
    try:
        state = _load_common(path)
    except Exception as e:  # a truncated or foreign file
        raise MegatronCheckpointError(f"{path}: unreadable ({type(e).__name__}: {e})") from None
    if not isinstance(state, dict) or state.get("args") is None:
        raise MegatronCheckpointError(f"{path}: no 'args' in the common state (not written by Megatron-LM?)")
    return state


# ---- args <-> ModelArch ----------------------------------------------------------------------------
#: Megatron-LM args puzzle's models do not implement: (name, the value puzzle runs, what it is)
_REFUSED = (("multi_latent_attention", False, "multi-latent attention"),
            ("rotary_interleaved", False, "interleaved rotary embeddings"),
            ("apply_layernorm_1p", False, "layernorm 1p"),
            ("moe_shared_expert_intermediate_size", None, "shared experts"),
            ("mtp_num_layers", None, "multi-token prediction layers"),
            ("num_experts", None, None))  # checked below: MoE is fine


def _moe_pattern(a, num_layers: int):
    """Megatron-LM's --moe-layer-freq (an int: every k-th layer; a list: per layer) as puzzle's
    per-layer pattern (None: every layer)."""
    freq = getattr(a, "moe_layer_freq", 1)
    if isinstance(freq, int):
        pattern = tuple(1 if i % freq == 0 else 0 for i in range(num_layers))
    else:
        pattern = tuple(int(x) for x in freq)
    return None if all(pattern) else pattern


def arch_from_megatron_args(a, source: str, **overrides) -> ModelArch:
    """The ModelArch of a Megatron-LM model from its args (``common.pt['args']``); a feature
    puzzle does not implement is a MegatronCheckpointError naming ``source`` and the arg."""
    problems = [f"{name}={getattr(a, name)!r} ({what})" for name, ok, what in _REFUSED
                if what and getattr(a, name, ok) not in (ok, 0)]
    pos = getattr(a, "position_embedding_type", "learned_absolute")
    if pos not in ("rope", "learned_absolute"):
        problems.append(f"position_embedding_type={pos!r} (rope or learned_absolute)")
    if float(getattr(a, "rotary_percent", 1.0)) != 1.0:
        problems.append(f"rotary_percent={a.rotary_percent} (only full rotary)")
    norm = getattr(a, "normalization", "LayerNorm")
    if norm not in ("LayerNorm", "RMSNorm"):
        problems.append(f"normalization={norm!r}")
    missing = [k for k in ("num_layers", "hidden_size", "num_attention_heads", "padded_vocab_size")
               if getattr(a, k, None) is None]
    if missing:
        problems.append(f"missing {', '.join(missing)}")
    if problems:
        raise MegatronCheckpointError(f"{source}: unsupported Megatron-LM model: " + "; ".join(problems))
    experts = getattr(a, "num_experts", None)
    kw = dict(
        num_layers=a.num_layers, hidden_size=a.hidden_size, ffn_hidden_size=getattr(a, "ffn_hidden_size", None),
        num_attention_heads=a.num_attention_heads,
        num_query_groups=a.num_query_groups if getattr(a, "group_query_attention", False) else None,
        kv_channels=getattr(a, "kv_channels", None),
        # the checkpoint's rows: Megatron-LM padded the tokenizer's vocabulary (to divisible_by * T)
        vocab_size=a.padded_vocab_size, make_vocab_size_divisible_by=getattr(a, "make_vocab_size_divisible_by", 128),
        seq_length=getattr(a, "seq_length", None) or getattr(a, "max_position_embeddings", 2048),
        max_position_embeddings=getattr(a, "max_position_embeddings", None),
        normalization=norm, norm_epsilon=float(getattr(a, "norm_epsilon", 1e-5)),
        swiglu=bool(getattr(a, "swiglu", False)), position_embedding_type=pos,
        rotary_base=getattr(a, "rotary_base", 10000),
        untie_embeddings_and_output_weights=bool(getattr(a, "untie_embeddings_and_output_weights", False)),
        add_bias_linear=bool(getattr(a, "add_bias_linear", True)), add_qkv_bias=bool(getattr(a, "add_qkv_bias", False)),
        qk_layernorm=bool(getattr(a, "qk_layernorm", False)),
        init_method_std=float(getattr(a, "init_method_std", 0.02)),
        hf_model_type=_hf_family(a, experts),
    )
    if getattr(a, "use_rope_scaling", False):  # megatron-core's llama3 factors besides the scaling factor
        kw.update(use_rope_scaling=True, rope_scaling_factor=float(getattr(a, "rope_scaling_factor", 8.0)))
    if experts:
        kw.update(num_experts=experts, moe_ffn_hidden_size=getattr(a, "moe_ffn_hidden_size", None),
                  moe_router_topk=getattr(a, "moe_router_topk", 2),
                  moe_router_pre_softmax=bool(getattr(a, "moe_router_pre_softmax", False)),
                  moe_layer_pattern=_moe_pattern(a, a.num_layers))
    kw.update(overrides)
    try:
        return ModelArch(**kw)
    except ValueError as e:
        raise MegatronCheckpointError(f"{source}: {e}") from None


def _hf_family(a, experts) -> str:
    """The HF family an HF export of this model writes (puzzle.models.hf_mapping)."""
    if experts:
        return "qwen3_moe" if getattr(a, "qk_layernorm", False) else "mixtral"
    if getattr(a, "qk_layernorm", False):
        return "qwen3"
    return "qwen2" if getattr(a, "add_qkv_bias", False) else "llama"


def megatron_args_from_arch(arch: ModelArch, **run) -> types.SimpleNamespace:
    """The args Megatron-LM needs to --load a model of ``arch`` (its model flags' names and
    meanings; ``run``: more, e.g. the tokenizer). A ``release`` checkpoint is loaded for
    finetuning: Megatron-LM compares only the model shape with its own flags. A SimpleNamespace,
    which Megatron-LM reads as its own args (an argparse.Namespace) and loads as a safe global."""
    moe = {}
    if arch.is_moe:
        moe = dict(moe_ffn_hidden_size=arch.moe_ffn_hidden_size,
                   moe_router_topk=arch.moe_router_topk, moe_router_pre_softmax=arch.moe_router_pre_softmax,
                   moe_layer_freq=list(arch.moe_layer_pattern) if arch.moe_layer_pattern else 1)
    fields = dict(
        num_layers=arch.num_layers, hidden_size=arch.hidden_size, ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_attention_heads, kv_channels=arch.kv_channels,
        group_query_attention=arch.num_query_groups != arch.num_attention_heads,
        num_query_groups=arch.num_query_groups, padded_vocab_size=arch.padded_vocab_size,
        make_vocab_size_divisible_by=arch.make_vocab_size_divisible_by, seq_length=arch.seq_length,
        max_position_embeddings=arch.max_position_embeddings, normalization=arch.normalization,
        norm_epsilon=arch.norm_epsilon, swiglu=arch.swiglu, position_embedding_type=arch.position_embedding_type,
        add_position_embedding=arch.position_embedding_type == "learned_absolute",
        use_rotary_position_embeddings=arch.position_embedding_type == "rope",
        rotary_base=arch.rotary_base, rotary_percent=1.0, rotary_interleaved=False,
        use_rope_scaling=arch.use_rope_scaling, rope_scaling_factor=arch.rope_scaling_factor,
        untie_embeddings_and_output_weights=arch.untie_embeddings_and_output_weights,
        add_bias_linear=arch.add_bias_linear, add_qkv_bias=arch.add_qkv_bias, qk_layernorm=arch.qk_layernorm,
        init_method_std=arch.init_method_std, num_experts=arch.num_experts if arch.is_moe else None, **moe,
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1, ckpt_format="torch_dist",
        iteration=0, consumed_train_samples=0, consumed_valid_samples=0, no_save_optim=True, no_save_rng=True)
    fields.update(run)
    return types.SimpleNamespace(**fields)


# ---- load and save (collective over the default process group) ------------------------------------
def _model_sharded_state_dict(module, keep_extra_state: bool = False) -> dict:
    """The model's sharded state dict as a checkpoint keys it; {} on a rank outside the model.
    Loading drops the ``_extra_state`` objects (TE's FP8 metadata, empty in the local spec), so
    either layer spec reads the other's files; saving keeps them, as Megatron-LM's load asks for
    every one of its model's (megatron-core's default strictness)."""
    if module is None:
        return {}
    metadata = {"dp_cp_group": module.puzzle_layout.pg_collection.dp_cp, "singleton_local_shards": False}
    sd = module.sharded_state_dict(prefix="", metadata=metadata)
    sd = {k: v for k, v in sd.items() if ADAPTER_MARK not in k}  # LoRA adapters: the base alone
    return sd if keep_extra_state else drop_extra_state(sd)


def _check_shapes(sd: dict, ckpt: MegatronCheckpoint, role: str) -> None:
    """Every tensor the model asks for is in the checkpoint with the same global shape (one
    error naming the first ones that are not), read from the checkpoint's metadata only."""
    from megatron.core import dist_checkpointing

    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    saved = dist_checkpointing.load_tensors_metadata(ckpt.dir)
    problems = []
    for st in nested_values(sd):
        if not isinstance(st, (ShardedTensor, ShardedTensorFactory)):
            continue
        have = saved.get(st.key)
        if have is None:
            problems.append(f"{st.key}: not in the checkpoint")
        elif isinstance(st, ShardedTensor) and tuple(have.global_shape) != tuple(st.global_shape):
            problems.append(f"{st.key}: shape {tuple(have.global_shape)} in the checkpoint, the {role} "
                            f"model has {tuple(st.global_shape)}")
    if problems:
        raise MegatronCheckpointError(f"{ckpt.describe()}: does not fit the {role} model: " + "; ".join(problems[:3])
                                      + (f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""))


def checkpoint_head(ckpt: MegatronCheckpoint) -> Optional[tuple]:
    """The global shape of the checkpoint's ``output_layer.weight`` (None: tied embeddings)."""
    from megatron.core import dist_checkpointing

    st = dist_checkpointing.load_tensors_metadata(ckpt.dir).get(HEAD_LOCAL_NAME)
    return None if st is None else tuple(st.global_shape)


def load_megatron_into_model(module, role: str, root: str, *, allow_missing_head: bool = False,
                             step: Optional[int] = None) -> MegatronCheckpoint:
    """Collective: fill a role model (``module``; None on ranks outside it) from the Megatron-LM
    checkpoint under ``root``, resharded to the module's layout. A critic/reward takes a [1, hidden]
    head from the checkpoint; with ``allow_missing_head`` (a critic from an LM) the head of an LM
    checkpoint is skipped and the module's own kept."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    ckpt = require_megatron_checkpoint(root, ROLES[role].pretrained_flag, step)
    sd = _model_sharded_state_dict(module)
    keep_head = False
    if not ROLES[role].lm_head:
        head = checkpoint_head(ckpt)
        if head is None or head[0] != 1:
            if not allow_missing_head:
                raise MegatronCheckpointError(
                    f"{ckpt.describe()}: an LM checkpoint (output_layer {head or 'tied to the embedding'}), not a "
                    f"{role} model with a scalar head: make one with python -m puzzle.tools.make_value_model")
            keep_head = True
            sd.pop(HEAD_LOCAL_NAME, None)
    problem = None
    try:
        _check_shapes(sd, ckpt, role)
    except MegatronCheckpointError as e:
        problem = str(e)
    problems = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    if any(problems):
        raise MegatronCheckpointError(next(p for p in problems if p))
    try:
        state = dist_checkpointing.load({"model": sd}, ckpt.dir, common_strategy=_common_strategy())
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # torch's CheckpointException is a BaseException
        raise MegatronCheckpointError(f"{ckpt.describe()}: loading the {role} model failed: "
                                      f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    if module is not None:
        res = module.load_state_dict(state["model"], strict=False)
        missing = [k for k in res.missing_keys if not k.endswith("_extra_state") and ADAPTER_MARK not in k
                   and not (keep_head and k == HEAD_LOCAL_NAME)]
        if missing or res.unexpected_keys:
            raise MegatronCheckpointError(f"{ckpt.describe()}: does not fit the {role} model: missing {missing[:5]}, "
                                          f"unexpected {list(res.unexpected_keys)[:5]}")
    return ckpt


def save_megatron_checkpoint(module, arch: ModelArch, root: str, *, release: bool = True, iteration: int = 0,
                             **run_args) -> str:
    """Collective: write a role model (``module``; None on ranks outside it) under ``root`` as a
    Megatron-LM checkpoint (``release`` by default: what Megatron-LM loads for finetuning without
    further flags). Returns the checkpoint directory."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    d = os.path.join(root, RELEASE if release else f"iter_{iteration:07d}")
    if dist.get_rank() == 0:
        os.makedirs(d, exist_ok=True)
    dist.barrier()
    args = megatron_args_from_arch(arch, iteration=iteration, **run_args)
    state = {"model": _model_sharded_state_dict(module, keep_extra_state=True), "args": args, "checkpoint_version": CHECKPOINT_VERSION,
             "iteration": iteration}
    dist_checkpointing.save(state, d)
    dist.barrier()
    if dist.get_rank() == 0:
        tracker = os.path.join(root, TRACKER)
        with open(tracker + ".tmp", "w") as f:
            f.write(RELEASE if release else str(iteration))
        os.replace(tracker + ".tmp", tracker)
    dist.barrier()
    return d
