"""Patch: megatron-core's tensor-parallel all-reduce defers to a hook while one is installed.

Target: ``megatron.core.tensor_parallel.mappings._reduce`` (the forward of
``reduce_from_tensor_model_parallel_region``: every RowParallelLinear output, the vocab-parallel
embedding), checked on megatron-core 0.16.0 and 0.16.1.

Reason: ``--batch-invariant-mode`` (puzzle/models/batch_invariant.py) needs a row's sum over the
tensor-parallel ranks to be added in one order whatever the message size: a ring all-reduce over
T >= 3 ranks adds an element's partial sums in an order that depends on the chunk the element
falls in, so a decode step (a few rows) and a full forward (many) round differently. While the
mode runs it installs ``hook`` (its rank-ordered all-reduce) and megatron's forward all-reduce
goes there; outside it, and with no hook, megatron's function runs unchanged. The backward of
the copy-to-region mapping (also ``_reduce``) is never reached in the mode, which runs without
gradients.

Remove when: megatron-core offers a deterministic (rank-ordered) tensor-parallel all-reduce.
"""

from __future__ import annotations

_applied = False
_original = None
#: fn(tensor, group) -> tensor, or None: megatron's own all-reduce
hook = None


def _reduce(input_, group):
    if hook is not None and group is not None and group.size() > 1:
        return hook(input_, group)
    return _original(input_, group)


def apply() -> None:
    """Idempotent."""
    global _applied, _original
    if _applied:
        return
    from megatron.core.tensor_parallel import mappings

    _original = mappings._reduce
    mappings._reduce = _reduce
    _applied = True
