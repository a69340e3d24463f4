"""The ONLY place puzzle patches megatron-core.

``apply()`` is explicit and idempotent: entry points and the test harness call it before they
import anything else from megatron-core; importing this package changes nothing. Each patch is
one module with a docstring stating its target, the reason, the megatron-core versions it was
checked on and when it can be removed.

Patches:
- ``cpu_backend``: runs the unmodified megatron-core models, tensor-parallel layers, schedules,
  DDP, optimizer and dist-checkpointing on CPU tensors over gloo when CUDA is unavailable.
- ``distrib_optimizer_step``: keeps Adam's per-parameter "step" intact when a DistributedOptimizer
  loads a checkpoint (two megatron-core 0.16 bugs on the fully_reshardable path); CPU and GPU.
- ``tied_embedding_checkpoint``: the last stage's tied embedding copy takes its DP rank from the
  model's own DP group in sharded state dicts (P > 1 with tied embeddings); CPU and GPU.
- ``moe_router_without_te``: megatron's MoE router gating runs without transformer-engine (it
  named an undefined ``te_general_gemm``); CPU and GPU.
- ``moe_allgather_token_counts``: the all-gather MoE token dispatcher runs ranks holding different
  numbers of tokens (packed micro-batches at E > 1 or T > 1); CPU and GPU.
- ``moe_gloo_split_gather``: megatron's all-gathers with split sizes (the all-to-all MoE token
  dispatcher at ETP > 1) run on gloo groups; CPU and GPU.
- ``moe_alltoall_cpu``: the all-to-all MoE token dispatcher's split sizes reach gloo as host
  arrays (CPU only).
- ``cpu_backward_devices``: megatron's tensor-parallel gathers, reduce-scatters and all-to-all
  allocate on the CPU in backward passes (MoE dispatchers; CPU only).
- ``moe_tensor_parallel_without_sp``: MoE layers train at T > 1 without sequence parallelism, each
  tensor-parallel rank routing its share of the sequence as under sequence parallelism (the
  routers' partial gradients summed over the tensor-parallel group); CPU and GPU.
- ``gloo_cuda_tensors``: sends and receives of CUDA tensors over gloo groups go through host memory,
  and DDP's coalesced bucket collectives run one by one on gloo groups, so several ranks can share
  one GPU (``--distributed-backend gloo``; GPU only).
- ``checkpoint_writes_in_process``: dist-checkpoint saves write their files from threads of the
  saving process instead of forked writer processes (a fork after threads can deadlock); CPU and GPU.
- ``rope_thd_cached``: megatron's unfused RoPE on packed (THD) sequences builds its cos/sin once per
  micro-batch, not in every attention call; CPU and GPU.
- ``frozen_linear_folds_tokens``: a frozen-weight linear (reference, reward model) computes its
  forward product as the trainable linear does, so the same weights give the same bits; CPU and GPU.
- ``batch_invariant_reduce``: megatron's tensor-parallel all-reduce goes to a hook while
  ``--batch-invariant-mode`` installs one (sums added in rank order); CPU and GPU.
"""

from __future__ import annotations

import importlib.metadata

#: megatron-core releases these patches were checked on. Anything else fails loudly.
TESTED_MEGATRON_CORE = ("0.16.0", "0.16.1")

_applied = False


class UnsupportedMegatronVersion(RuntimeError):
    pass


def megatron_core_version() -> str:
    try:
        return importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        raise UnsupportedMegatronVersion(
            "megatron-core is not installed; install puzzle with `pip install -e .` "
            f"(tested megatron-core versions: {', '.join(TESTED_MEGATRON_CORE)})"
        ) from None


def check_version() -> str:
    version = megatron_core_version()
    if version not in TESTED_MEGATRON_CORE:
        raise UnsupportedMegatronVersion(
            f"megatron-core {version} is untested with puzzle's patches "
            f"(tested: {', '.join(TESTED_MEGATRON_CORE)}). Install a tested version, or check each "
            "module in megatron_patches/ against the new release and extend TESTED_MEGATRON_CORE."
        )
    return version


def apply(force_cpu: bool | None = None) -> dict:
    """Apply every patch that this machine needs. Returns {patch name: applied?}.

    ``force_cpu``: None = use the CPU backend exactly when CUDA is unavailable.
    """
    global _applied
    check_version()
    from megatron_patches import (batch_invariant_reduce, checkpoint_writes_in_process, cpu_backend,
                                  cpu_backward_devices, distrib_optimizer_step, frozen_linear_folds_tokens,
                                  gloo_cuda_tensors, moe_allgather_token_counts, moe_alltoall_cpu,
                                  moe_gloo_split_gather, moe_router_without_te, moe_tensor_parallel_without_sp,
                                  rope_thd_cached, tied_embedding_checkpoint)

    use_cpu = cpu_backend.cuda_missing() if force_cpu is None else force_cpu
    result = {"cpu_backend": False, "moe_alltoall_cpu": False, "cpu_backward_devices": False,
              "gloo_cuda_tensors": False}
    if use_cpu:
        cpu_backend.apply()  # first: it must precede other megatron imports (JIT fuser)
        result["cpu_backend"] = True
        moe_alltoall_cpu.apply()
        result["moe_alltoall_cpu"] = True
        cpu_backward_devices.apply()
        result["cpu_backward_devices"] = True
    else:
        gloo_cuda_tensors.apply()
        result["gloo_cuda_tensors"] = True
    distrib_optimizer_step.apply()
    result["distrib_optimizer_step"] = True
    tied_embedding_checkpoint.apply()
    result["tied_embedding_checkpoint"] = True
    moe_router_without_te.apply()
    result["moe_router_without_te"] = True
    moe_tensor_parallel_without_sp.apply()
    result["moe_tensor_parallel_without_sp"] = True
    rope_thd_cached.apply()
    result["rope_thd_cached"] = True
    frozen_linear_folds_tokens.apply()
    result["frozen_linear_folds_tokens"] = True
    moe_allgather_token_counts.apply()
    result["moe_allgather_token_counts"] = True
    moe_gloo_split_gather.apply()
    result["moe_gloo_split_gather"] = True
    checkpoint_writes_in_process.apply()
    result["checkpoint_writes_in_process"] = True
    batch_invariant_reduce.apply()
    result["batch_invariant_reduce"] = True
    _applied = True
    return result


def applied() -> bool:
    return _applied


def on_cpu() -> bool:
    """True when the CPU backend is active (tensors live on CPU, collectives use gloo)."""
    from megatron_patches import cpu_backend

    return cpu_backend.active()
