"""Patch: megatron-core's MoE router gating runs without transformer-engine.

Target: ``megatron.core.transformer.moe.moe_utils`` (``RouterGatingLinearFunction``), checked on
megatron-core 0.16.0 and 0.16.1.

Reason: ``moe_utils`` imports ``te_general_gemm`` only inside its ``try: import
transformer_engine`` block, but ``RouterGatingLinearFunction.forward``/``backward`` test
``te_general_gemm is not None`` unconditionally: without transformer-engine (every CPU machine,
GPU machines without the ``[gpu]`` extra) every MoE router call raised ``NameError: name
'te_general_gemm' is not defined``. The patch defines the module attribute as None when it is
missing, so the router takes megatron's own ``torch.mm`` path; with transformer-engine installed
the name exists and nothing changes.

Remove when: megatron-core defines ``te_general_gemm = None`` in its ImportError branch.
"""

from __future__ import annotations

_applied = False


def apply() -> None:
    global _applied
    if _applied:
        return
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    _applied = True
