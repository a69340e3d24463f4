"""The RNG states a checkpoint saves per rank (rng/rank_*.pt): Python's, numpy's, torch's CPU
generator, megatron-core's tensor-parallel RNG tracker and, on a GPU, CUDA's.

rng/rank_*.pt holds tensors, numbers and strings only (numpy's and Python's generator states as
int64 tensors) and is read with torch.load(weights_only=True), which refuses any other Python
object before creating it. Files of earlier versions hold numpy's state as an ndarray: numpy's
array reconstruction is allowed for them (torch's documented way of reading plain arrays safely).
"""

from __future__ import annotations

import random
import re

import torch

from puzzle.checkpoint_errors import CheckpointError
from puzzle.save_failures import first_line as _first_line


def capture_rng_state() -> dict:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    version, internal, gauss_next = random.getstate()
    state = {"torch_cpu": torch.get_rng_state(),
             "python": {"version": version, "internal": torch.tensor(internal, dtype=torch.int64),
                        "gauss_next": gauss_next},
             "tracker": {k: v.clone() for k, v in get_cuda_rng_tracker().get_states().items()}}
    try:
        import numpy as np

        name, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                          "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
    except ImportError:
        pass
    if torch.cuda.is_available() and not _on_cpu():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _numpy_array_globals() -> list:
    import numpy as np

    core = getattr(np, "_core", None) or np.core
    return [core.multiarray._reconstruct, np.ndarray, np.dtype, np.dtypes.UInt32DType]


def read_rng_file(path: str) -> dict:
    """The RNG states of ``path`` (rng/rank_*.pt), loaded without running anything the file names:
    a file holding any other Python object is a CheckpointError naming it (nothing is created)."""
    import pickle

    try:
        import numpy  # noqa: F401  (only earlier files need it)

        allowed = _numpy_array_globals()
    except ImportError:
        allowed = []
    try:
        with torch.serialization.safe_globals(allowed):
            state = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError) as e:
        named = re.search(r"GLOBAL (\S+)", str(e))
        why = (f"it names the Python object {named.group(1)}, which loading would create or call"
               if named else _first_line(e))
        raise CheckpointError(f"{path}: refused, not an RNG state file of tensors and numbers ({why}); "
                              f"nothing in it was run. Resume without it with --no-load-rng") from None
    if not isinstance(state, dict) or not isinstance(state.get("torch_cpu"), torch.Tensor):
        raise CheckpointError(f"{path}: not an RNG state file (expected a dict with 'torch_cpu'); "
                              f"resume without it with --no-load-rng")
    return state


def set_rng_state(state: dict) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    torch.set_rng_state(state["torch_cpu"])
    py = state["python"]
    if isinstance(py, dict):
        py = (py["version"], tuple(int(x) for x in py["internal"].tolist()), py["gauss_next"])
    random.setstate(py)
    if state.get("tracker"):
        get_cuda_rng_tracker().set_states(state["tracker"])
    if "numpy" in state:
        import numpy as np

        npst = state["numpy"]
        if isinstance(npst, dict):
            npst = (npst["name"], npst["keys"].numpy().astype(np.uint32), npst["pos"], npst["has_gauss"],
                    npst["cached_gaussian"])
        np.random.set_state(npst)
    if "cuda" in state and torch.cuda.is_available() and not _on_cpu():
        torch.cuda.set_rng_state(state["cuda"])


def _on_cpu() -> bool:
    import megatron_patches

    return megatron_patches.on_cpu()
