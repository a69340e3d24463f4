"""Patch: run megatron-core on CPU tensors over gloo.

Target: megatron-core (checked on 0.16.0, 0.16.1) with a CPU-only torch (checked on 2.13.0).

Reason: megatron-core assumes CUDA everywhere. It creates tensors with literal ``device="cuda"``,
integer devices and ``torch.cuda.current_device()``, calls ``.cuda()``, asserts
``param.type() == 'torch.cuda.FloatTensor'`` in its optimizers and grad clipping, swaps CUDA RNG
states in its tensor-parallel RNG tracker, and creates CUDA streams/events. On a CPU machine
every one of those raises. This patch, applied only when CUDA is unavailable:

1. pushes a process-wide ``TorchFunctionMode`` that maps CUDA/integer devices to CPU in every
   torch call (``device=`` arguments, ``Tensor.cuda()``, ``Tensor.to("cuda")``) and makes
   ``Tensor.type()`` (no arguments) report the ``torch.cuda.*Tensor`` name megatron asserts on;
   backward passes run inside the mode too (activation recompute reruns the forward there);
2. replaces the ``torch.cuda`` functions megatron calls (current_device, synchronize,
   device_count, RNG state get/set and seeding — mapped to the CPU generator so that every TP
   rank still gets its own dropout/init stream —, streams, events, nvtx, memory statistics);
3. points megatron's ``tensor_parallel.random._get_cuda_rng_state`` / ``_set_cuda_rng_state``
   at the CPU generator;
4. disables megatron's JIT fuser (``torch.compile`` adds ~30 s of compile time on CPU), from
   megatron.core's own import on (which then no longer imports torch._dynamo and torch._inductor);
5. lets the static inference controller and inference P2P utilities run on CPU.

Nothing here changes a numeric result: models, schedules, DDP and optimizers are megatron-core's
own code, unmodified. When CUDA is available this patch does nothing.

Remove when: megatron-core runs on CPU by itself (it does not as of 0.16.1).
"""

from __future__ import annotations

import contextlib
import sys

import torch
from torch.overrides import TorchFunctionMode

_mode = None


def cuda_missing() -> bool:
    return not torch.cuda.is_available()


def active() -> bool:
    return _mode is not None


# ---------------------------------------------------------------------------------------------
# 1. device mapping
# ---------------------------------------------------------------------------------------------
def _to_cpu_device(device):
    if device is None:
        return None
    if isinstance(device, bool):
        return device
    if isinstance(device, int):
        return torch.device("cpu")
    if isinstance(device, str):
        return "cpu" if device.startswith("cuda") else device
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


_CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
    "torch.DoubleTensor": "torch.cuda.DoubleTensor",
    "torch.LongTensor": "torch.cuda.LongTensor",
    "torch.IntTensor": "torch.cuda.IntTensor",
    "torch.ByteTensor": "torch.cuda.ByteTensor",
    "torch.BoolTensor": "torch.cuda.BoolTensor",
}


class CudaToCpuMode(TorchFunctionMode):
    """Maps every CUDA device request to CPU; ``Tensor.type()`` reports CUDA type names."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs:
            kwargs["device"] = _to_cpu_device(kwargs["device"])
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to:
            args = tuple(_to_cpu_device(a) if isinstance(a, (str, torch.device)) or
                         (isinstance(a, int) and not isinstance(a, bool) and i > 0) else a
                         for i, a in enumerate(args))
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return _CUDA_TYPE_NAMES.get(name, name)
        if func in _BACKWARD_FUNCS:
            with _backward_inside(self):
                return func(*args, **kwargs)
        return func(*args, **kwargs)


_BACKWARD_FUNCS = (torch.autograd.backward, torch.autograd.grad)


@contextlib.contextmanager
def _backward_inside(mode):
    """Run a backward pass with ``mode`` on. torch >= 2.13 dispatches torch.autograd.backward/grad
    to the mode, and a mode is off while its own __torch_function__ runs: the backward would run
    without it, and activation recompute (megatron's forward code rerun inside the backward)
    would meet its literal device="cuda" tensors. The mode is pushed again and torch.autograd's
    re-dispatch check answers False for the duration (else the call would come back here)."""
    import torch.autograd as autograd

    saved = autograd.has_torch_function
    autograd.has_torch_function = lambda args: False
    try:
        with mode:
            yield
    finally:
        autograd.has_torch_function = saved


# ---------------------------------------------------------------------------------------------
# 2. torch.cuda stubs
# ---------------------------------------------------------------------------------------------
class _Stream:
    """Stand-in for torch.cuda.Stream: CPU work is synchronous, so waiting is a no-op."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        return event or _Event()

    def synchronize(self):
        pass

    def query(self):
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _Event:
    def __init__(self, *args, **kwargs):
        import time

        self._time = time.perf_counter
        self._t = None

    def record(self, stream=None):
        self._t = self._time()

    def wait(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, end):
        return 1000.0 * ((end._t or 0.0) - (self._t or 0.0))


class _Nvtx:
    @staticmethod
    def range_push(msg):
        return 0

    @staticmethod
    def range_pop():
        return 0

    @staticmethod
    def mark(msg):
        pass

    @staticmethod
    @contextlib.contextmanager
    def range(msg, *args, **kwargs):
        yield


def _cuda_stubs() -> dict:
    return {
        "current_device": lambda: 0,
        "device_count": lambda: 1,
        "set_device": lambda device: None,
        "synchronize": lambda device=None: None,
        "get_rng_state": lambda device="cuda": torch.get_rng_state(),
        "set_rng_state": lambda new_state, device="cuda": torch.set_rng_state(new_state),
        # seeds the CPU generator only (torch.manual_seed itself calls cuda.manual_seed_all)
        "manual_seed": lambda seed: torch.default_generator.manual_seed(int(seed)),
        "manual_seed_all": lambda seed: None,
        "Stream": _Stream,
        "Event": _Event,
        "current_stream": lambda device=None: _Stream(),
        "default_stream": lambda device=None: _Stream(),
        "stream": lambda s=None: contextlib.nullcontext(),
        "nvtx": _Nvtx,
        "memory_allocated": lambda device=None: 0,
        "max_memory_allocated": lambda device=None: 0,
        "memory_reserved": lambda device=None: 0,
        "reset_peak_memory_stats": lambda device=None: None,
        "empty_cache": lambda: None,
    }


def _patch_torch_cuda() -> None:
    stubs = _cuda_stubs()
    for name, value in stubs.items():
        setattr(torch.cuda, name, value)
    torch.cuda.random.get_rng_state = stubs["get_rng_state"]
    torch.cuda.random.set_rng_state = stubs["set_rng_state"]
    torch.cuda.random.manual_seed = stubs["manual_seed"]


# ---------------------------------------------------------------------------------------------
# 3.-5. megatron-core hooks
# ---------------------------------------------------------------------------------------------
def _import_megatron_without_compiling():
    """Import megatron.core with ``torch.compile`` a pass-through: its package import decorates
    fused functions with ``torch.compile`` (megatron.core.jit), which imports torch._dynamo and
    torch._inductor (about 2.4 s of every rank's start-up on 2 cores) for functions that this
    backend never compiles. The real ``torch.compile`` is back as soon as the import returns."""
    real = torch.compile

    def pass_through(model=None, **kwargs):
        return model if model is not None else (lambda fn: fn)

    torch.compile = pass_through
    try:
        import megatron.core.jit as mjit
    finally:
        torch.compile = real
    return mjit


def _patch_megatron() -> None:
    mjit = _import_megatron_without_compiling()
    mjit.disable_jit_fuser()
    # Modules that decorated functions with the compiling fuser before it was disabled.
    stale = [m for m in ("megatron.core.activations", "megatron.core.transformer.torch_norm",
                         "megatron.core.transformer.attention") if m in sys.modules]
    if stale:
        raise RuntimeError(
            f"megatron_patches.apply() must run before importing {', '.join(stale)} "
            "(their JIT-fused functions were already compiled for CUDA)"
        )

    from megatron.core.tensor_parallel import random as mrandom

    def _get_rng_state(device="cuda", clone=False, graph_safe=False):
        return torch.get_rng_state()

    def _set_rng_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    mrandom._get_cuda_rng_state = _get_rng_state
    mrandom._set_cuda_rng_state = _set_rng_state

    try:  # PP>1 inference moves tensors only when it believes they are CUDA tensors
        from megatron.core.inference import communication_utils

        communication_utils._is_cuda = lambda tensor: tensor is not None
    except ImportError:  # pragma: no cover - inference package absent in a trimmed install
        pass

    _orig_generator = torch.Generator
    if not getattr(torch.Generator, "_puzzle_cpu", False):

        class _CpuGenerator:
            """``torch.Generator(device='cuda')`` -> a CPU generator."""

            _puzzle_cpu = True

            def __new__(cls, device="cpu"):
                return _orig_generator(device=_to_cpu_device(device) or "cpu")

        torch.Generator = _CpuGenerator  # type: ignore[misc]


@contextlib.contextmanager
def device_mapping_suspended():
    """Runs a block without the device-mapping mode of step 1 (a hot loop that creates no CUDA
    tensors: the mode costs a Python call per torch call). A no-op when the patch is off."""
    if _mode is None:
        yield
        return
    with torch._C.DisableTorchFunction():
        yield


@contextlib.contextmanager
def device_mapping_popped():
    """Runs a block without the device-mapping mode of step 1 while torch-function modes pushed
    inside the block still work (``device_mapping_suspended`` turns every mode off). The
    device-mapping mode must be the innermost mode when the block starts; otherwise, and when the
    patch is off, a no-op."""
    from torch.overrides import _get_current_function_mode_stack, _pop_mode_temporarily

    stack = _get_current_function_mode_stack()
    if _mode is None or not stack or stack[-1] is not _mode:
        yield
        return
    with _pop_mode_temporarily():
        yield


def apply() -> None:
    """Idempotent. Never call on a CUDA machine (megatron_patches.apply() decides)."""
    global _mode
    if _mode is not None:
        return
    _patch_torch_cuda()
    _patch_megatron()
    _mode = CudaToCpuMode()
    _mode.__enter__()  # process-wide for the rest of the run
