"""Patch: keep Adam's per-parameter "step" intact when a DistributedOptimizer loads a checkpoint.

Target: megatron.core.optimizer.distrib_optimizer.DistributedOptimizer
(``_set_main_param_and_optimizer_states`` and ``load_state_dict``), checked on megatron-core
0.16.0 and 0.16.1, with torch's Adam (no apex / transformer-engine fused Adam).

Reason: two bugs on the ``fully_reshardable`` load path, both found by resuming a PPO run and
comparing iterations bit for bit with an uninterrupted run (tests/e2e/test_checkpoint.py):
1. ``load_parameter_state_from_fully_reshardable`` drops each parameter's "step" from the
   loaded tensors, then ``_set_main_param_and_optimizer_states`` copies every key of the live
   Adam state into them, "step" included -> ``KeyError: 'step'``. Fix: pass the live "step"
   through unchanged (``load_state_dict`` restores the step from the param groups).
2. ``load_state_dict`` gives every parameter the SAME "step" tensor; torch Adam increments each
   parameter's step in place, so after one optimizer step the shared step is N too large (wrong
   bias correction, silently different training). Fix: give each parameter its own copy.
Both fixes are no-ops where the bugs cannot occur (no "step" in the live state, or unshared steps).

Remove when: megatron-core skips "step" in _set_main_param_and_optimizer_states and stops sharing
one step tensor across parameters in DistributedOptimizer.load_state_dict.
"""

from __future__ import annotations

import torch

_applied = False


def apply() -> None:
    global _applied
    if _applied:
        return
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original_set = DistributedOptimizer._set_main_param_and_optimizer_states
    original_load = DistributedOptimizer.load_state_dict

    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        if "step" not in tensors and not getattr(
                self.config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8", False):
            group, order = self.model_param_group_index_map[model_param]
            live = self.optimizer.state.get(self.optimizer.param_groups[group]["params"][order], {})
            if "step" in live:
                tensors = {**tensors, "step": live["step"].clone()}
        return original_set(self, model_param, tensors)

    def load_state_dict(self, state_dict):
        result = original_load(self, state_dict)
        inner = getattr(self, "optimizer", None)
        for st in (inner.state.values() if inner is not None else ()):
            if torch.is_tensor(st.get("step")):
                st["step"] = st["step"].clone()
        return result

    DistributedOptimizer._set_main_param_and_optimizer_states = _set_main_param_and_optimizer_states
    DistributedOptimizer.load_state_dict = load_state_dict
    _applied = True
