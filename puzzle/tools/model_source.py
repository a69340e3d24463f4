"""Where a tool's model comes from: an HF directory, a Megatron-LM checkpoint or a puzzle
checkpoint, at any layout.

``SOURCE`` is an HF model directory (``config.json`` + safetensors: Llama-2/3.x, Mistral,
Qwen2/2.5, Qwen3), a Megatron-LM checkpoint root (torch_dist, as pretrain_gpt.py writes it; its
args hold the architecture: puzzle/models/megatron_checkpoint.py) or a puzzle checkpoint root
written by ``train_ppo.py --save`` (its ``latest_checkpointed_iteration.txt``, or ``--ckpt-step``),
whose ``metadata.json`` holds every role's architecture. Each loads into a model built at the
caller's (P, D, T), whatever layout wrote it.
"""

from __future__ import annotations

import json
import os
from typing import Optional, Tuple

from puzzle.config import ROLES, Operations
from puzzle.config_flags import add_dataclass_args


def is_hf_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "config.json"))


def checkpoint_role_dir(root: str, role: str, step: Optional[int] = None) -> Tuple[str, dict]:
    """(the role's weights directory, that role's ModelArch fields) of a puzzle checkpoint."""
    from puzzle.checkpointing import METADATA, iter_dir, read_tracker

    it = step if step is not None else read_tracker(root)
    if it is None:
        raise FileNotFoundError(f"{root}: neither an HF directory (config.json) nor a puzzle checkpoint "
                                f"nor a Megatron-LM one (latest_checkpointed_iteration.txt)")
    d = iter_dir(root, it)
    with open(os.path.join(d, METADATA)) as f:
        meta = json.load(f)
    if role not in meta["roles"]:
        raise ValueError(f"{d}: no role {role!r} in the checkpoint (has {', '.join(meta['roles'])})")
    if not os.path.isdir(os.path.join(d, role)):
        raise FileNotFoundError(f"{d}/{role}: the checkpoint holds no weights of {role} (only trainable "
                                f"roles are saved; a frozen one comes from its source "
                                f"{meta['roles'][role].get('source')})")
    return os.path.join(d, role), meta["roles"][role]["arch"]


def source_arch(source: str, role: str, plan, *, step: Optional[int] = None, seq_length: Optional[int] = None,
                make_vocab_size_divisible_by: int = 128):
    """The ModelArch of ``role`` in ``source``, read from its files only (config.json or the
    checkpoint's metadata.json) and checked against ``plan``: an unsupported HF family or a model
    the layout cannot split is a ValueError naming the file or the layout, before any process
    group or allocation."""
    from puzzle.config import ModelArch
    from puzzle.models.builders import check_layout

    from puzzle.models.megatron_checkpoint import arch_from_megatron_args, find_megatron_checkpoint, read_common_state

    megatron = find_megatron_checkpoint(source, step)
    if is_hf_dir(source):
        from puzzle.models.hf_checkpoint import arch_from_hf_dir

        overrides = {"make_vocab_size_divisible_by": make_vocab_size_divisible_by}
        if seq_length:
            overrides["seq_length"] = seq_length
        arch = arch_from_hf_dir(source, **overrides)
    elif megatron is not None:
        arch = arch_from_megatron_args(read_common_state(megatron)["args"], megatron.dir,
                                       **({"seq_length": seq_length} if seq_length else {}))
    else:
        arch = ModelArch(**checkpoint_role_dir(source, role, step)[1])
    check_layout(arch, plan, role)
    return arch


def load_engine(source: str, role: str, plan, arch, *, step: Optional[int] = None, bf16: bool = False,
                transformer_impl: str = "transformer_engine", allow_missing_head: bool = False):
    """A frozen ModelEngine of ``role`` (``arch``: source_arch's) at ``plan`` with the weights of
    ``source`` (collective). ``transformer_impl`` falls back to the local spec where TE cannot
    run (as train_ppo.py). ``allow_missing_head``: a critic/reward from an LM keeps its own head."""
    from puzzle.models.builders import resolve_transformer_impl
    from puzzle.parallel.groups import layout_for
    from puzzle.engine.model_engine import ModelEngine

    impl, _ = resolve_transformer_impl(transformer_impl)
    from puzzle.models.megatron_checkpoint import find_megatron_checkpoint

    if not is_hf_dir(source) and find_megatron_checkpoint(source, step) is None:
        meta = checkpoint_role_meta(source, role, step)
        if "lora" in meta:  # a LoRA actor: its base from its source, then the adapters
            return _load_lora_engine(source, role, plan, arch, meta, step=step, bf16=bf16, transformer_impl=impl)
    engine = ModelEngine(role, arch, layout_for(plan), trainable=False, bf16=bf16, layout_independent_init=False,
                         transformer_impl=impl)

    if is_hf_dir(source):
        from puzzle.models.hf_checkpoint import load_hf_into_model

        load_hf_into_model(engine.module, arch, role, source, allow_missing_head=allow_missing_head)
    elif find_megatron_checkpoint(source, step) is not None:
        from puzzle.models.megatron_checkpoint import load_megatron_into_model

        load_megatron_into_model(engine.module, role, source, allow_missing_head=allow_missing_head, step=step)
    else:
        from puzzle.checkpointing import load_role_weights

        load_role_weights(engine, checkpoint_role_dir(source, role, step)[0])
    return engine


def checkpoint_role_meta(root: str, role: str, step: Optional[int] = None) -> dict:
    """``role``'s entry of a puzzle checkpoint's metadata.json (its arch, layouts, LoRA and base)."""
    from puzzle.checkpointing import METADATA

    d = os.path.dirname(checkpoint_role_dir(root, role, step)[0])
    with open(os.path.join(d, METADATA)) as f:
        return json.load(f)["roles"][role]


def _load_lora_engine(source: str, role: str, plan, arch, meta: dict, *, step, bf16: bool, transformer_impl: str):
    """A LoRA actor of a puzzle checkpoint (collective): its base rebuilt from the source the run
    recorded (an HF or Megatron-LM checkpoint, else its seed), checked against the saved base
    fingerprint (another base is refused, naming both), then its adapters."""
    from puzzle.checkpoint_errors import CheckpointError
    from puzzle.checkpoint_metadata import base_fingerprint_problem
    from puzzle.checkpointing import load_role_weights, weight_fingerprint
    from puzzle.engine.model_engine import ModelEngine
    from puzzle.lora_config import LoRAConfig
    from puzzle.parallel.groups import layout_for

    lora = LoRAConfig(**{k: meta["lora"][k] for k in ("dim", "alpha", "dropout", "target_modules")})
    base = meta["base"]["source"]
    engine = ModelEngine(role, arch, layout_for(plan), trainable=False, bf16=bf16, seed=base["seed"], lora=lora,
                         layout_independent_init=not (base.get("hf_path") or base.get("pretrained_checkpoint")),
                         transformer_impl=transformer_impl)
    if base.get("hf_path"):
        from puzzle.models.hf_checkpoint import load_hf_into_model

        load_hf_into_model(engine.module, arch, role, base["hf_path"])
    elif base.get("pretrained_checkpoint"):
        from puzzle.models.megatron_checkpoint import load_megatron_into_model

        load_megatron_into_model(engine.module, role, base["pretrained_checkpoint"])
    problem = base_fingerprint_problem({"roles": {role: meta}}, role, weight_fingerprint(engine), base)
    if problem:
        raise CheckpointError(f"{source}: {problem}")
    load_role_weights(engine, checkpoint_role_dir(source, role, step)[0])
    return engine


def add_source_args(parser) -> None:
    """--load / --role / --ckpt-step and the layout flags shared by the tools."""
    g = parser.add_argument_group("model source and layout")
    g.add_argument("--load", required=True, help="HF model directory, Megatron-LM checkpoint root or puzzle "
                                                 "checkpoint root")
    g.add_argument("--role", default="actor", choices=tuple(ROLES),
                   help="the model of a puzzle checkpoint (and of its export)")
    g.add_argument("--ckpt-step", type=int, default=None, help="checkpoint iteration (default: the latest)")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--expert-model-parallel-size", type=int, default=1, help="E: ranks the experts are split over")
    g.add_argument("--expert-tensor-parallel-size", type=int, default=None, help="ETP: each expert's split (default T)")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--transformer-impl", choices=["transformer_engine", "local"], default="transformer_engine",
                   help="layer implementation (transformer_engine falls back to local without CUDA + TE)")
    add_dataclass_args(parser, Operations, only=("distributed_backend",))


def plan_from_flags(args):
    """The (P, D, T) plan over the launcher's world from the layout flags (no process group yet)."""
    from puzzle.config_flags import ArgumentError
    from puzzle.parallel import launcher
    from puzzle.parallel.plan import ParallelPlan

    T, P, world = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, launcher.world_size()
    if T < 1 or P < 1 or world % (T * P):
        raise ArgumentError(f"--tensor-model-parallel-size/--pipeline-model-parallel-size: T*P = {T * P} "
                            f"does not divide the world size {world}")
    from puzzle.parallel.plan import PlanError

    try:
        return ParallelPlan(P, world // (T * P), T, E=args.expert_model_parallel_size,
                            ETP=args.expert_tensor_parallel_size)
    except PlanError as e:
        raise ArgumentError(f"--expert-model-parallel-size/--expert-tensor-parallel-size: {e}") from None


def tool_parser(prog: str, doc: str, title: str, save_help: str):
    """A model tool's parser: the source flags (``add_source_args``) and ``--save`` in the group
    ``title``; returns (parser, that group) for the tool's own options."""
    from puzzle.arguments import RaisingArgumentParser

    p = RaisingArgumentParser(prog=prog, description=doc.split("\n\n")[0], allow_abbrev=False)
    add_source_args(p)
    g = p.add_argument_group(title)
    g.add_argument("--save", required=True, help=save_help)
    return p, g


def load_source(args, **load_kwargs):
    """``--load``'s model at the flags' layout, every input checked before the process group
    starts: (rank, owns_world, plan, engine)."""
    plan = plan_from_flags(args)
    arch = source_arch(args.load, args.role, plan, step=args.ckpt_step,
                       make_vocab_size_divisible_by=args.make_vocab_size_divisible_by)
    rank, owns_world = start_world(args.distributed_backend)
    engine = load_engine(args.load, args.role, plan, arch, step=args.ckpt_step,
                         transformer_impl=args.transformer_impl, **load_kwargs)
    return rank, owns_world, plan, engine


def apply_patches() -> None:
    """megatron_patches.apply(), first thing, as train_ppo.py does (before megatron-core is imported)."""
    from puzzle.fail_fast import quiet_startup_warnings

    quiet_startup_warnings()
    import megatron_patches

    megatron_patches.apply()


def start_world(backend=None):
    """The process group (joined when already initialised; ``backend``: --distributed-backend).
    Returns (rank, owns_world)."""
    import torch.distributed as dist

    from puzzle.parallel.groups import init_distributed

    owns_world = not dist.is_initialized()
    rank, _ = init_distributed(backend=backend)
    return rank, owns_world


def end_world(owns_world: bool) -> None:
    import torch.distributed as dist

    dist.barrier()
    if owns_world:
        dist.destroy_process_group()
