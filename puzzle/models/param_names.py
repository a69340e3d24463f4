"""Parameter names under megatron-core's two layer specs (pure Python).

puzzle names every parameter by its CANONICAL name: the name megatron-core's local spec
(``get_gpt_layer_local_spec``) gives it, with the global layer index (puzzle.models.param_layout).
``--transformer-impl transformer_engine`` builds layers from
``get_gpt_layer_with_transformer_engine_spec``, which fuses the two pre-norms into the following
linear layers (TE ``LayerNormLinear``):

==========================================  ===================================================
canonical (local spec)                      transformer_engine spec
==========================================  ===================================================
``decoder.layers.i.input_layernorm.weight``   ``decoder.layers.i.self_attention.linear_qkv.layer_norm_weight``
``decoder.layers.i.input_layernorm.bias``     ``decoder.layers.i.self_attention.linear_qkv.layer_norm_bias``
``decoder.layers.i.pre_mlp_layernorm.weight`` ``decoder.layers.i.mlp.linear_fc1.layer_norm_weight``
``decoder.layers.i.pre_mlp_layernorm.bias``   ``decoder.layers.i.mlp.linear_fc1.layer_norm_bias``
==========================================  ===================================================

Everything else keeps its name: q/k layernorms are ``self_attention.q_layernorm.weight`` /
``k_layernorm.weight`` in both specs (TENorm and the local norm both own a ``weight``, plus a
``bias`` for LayerNorm), the final norm is ``decoder.final_layernorm.*``. Inside a TE
``LayerNormLinear`` the norm's parameters are registered before ``weight`` / ``bias``, so in
``named_parameters()`` order the fused norm moves from before ``linear_proj`` (local:
input_layernorm first) to just before ``linear_qkv.weight``.

Dist checkpoints need no rename: the local spec's ``sharded_state_dict_keys_map`` already
saves ``input_layernorm.`` as ``self_attention.linear_qkv.layer_norm_`` (and the pre-MLP norm
likewise), i.e. megatron uses the TE names as the checkpoint keys of both specs. TE modules also
add ``._extra_state`` objects (FP8 scaling metadata) that the local spec lacks; they are dropped
from the sharded state dict (:func:`drop_extra_state`) so either spec loads the other's files.

Every place that reads a module's parameter names (layout-independent init, HF import/export,
the switch's parameter tables) maps them with :func:`canonical_param_name` first, so one seed
gives the same weights, one HF checkpoint the same model, under either spec.
"""

from __future__ import annotations

from typing import Dict, List, Sequence

from puzzle.config import ROLES

IMPLS = ("local", "transformer_engine")

# ScalarHead (builders.py) replaces GPTModel.output_layer; param_layout calls it value_head.
HEAD_LOCAL_NAME = "output_layer.weight"
HEAD_SPEC_NAME = "value_head.weight"


def is_scalar_head(name: str, role: str) -> bool:
    """Whether the module parameter ``name`` is the scalar (value / score) head of ``role``: it
    sits in GPTModel's ``output_layer`` slot and is the spec ``value_head.weight``."""
    return name == HEAD_LOCAL_NAME and not ROLES[role].lm_head

# (canonical suffix, transformer_engine suffix) of the per-layer parameters that differ
_TE_RENAMES = (
    ("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"),
    ("input_layernorm.bias", "self_attention.linear_qkv.layer_norm_bias"),
    ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"),
    ("pre_mlp_layernorm.bias", "mlp.linear_fc1.layer_norm_bias"),
)
_TO_TE: Dict[str, str] = dict(_TE_RENAMES)
_FROM_TE: Dict[str, str] = {te: canon for canon, te in _TE_RENAMES}
_LAYER = "decoder.layers."


def _check_impl(impl: str) -> None:
    if impl not in IMPLS:
        raise ValueError(f"--transformer-impl must be one of {', '.join(IMPLS)} (got {impl!r})")


def _split(name: str):
    """('decoder.layers.<i>.', rest) for a per-layer name, else ('', name)."""
    if not name.startswith(_LAYER):
        return "", name
    idx, _, rest = name[len(_LAYER):].partition(".")
    return f"{_LAYER}{idx}.", rest


def param_name_for_impl(canonical: str, impl: str) -> str:
    """The name under ``impl`` ('local' or 'transformer_engine') of a canonical parameter name
    (global or stage-local layer index: only the part after ``decoder.layers.<i>.`` changes)."""
    _check_impl(impl)
    if impl == "local":
        return canonical
    head, rest = _split(canonical)
    return head + _TO_TE.get(rest, rest)


def canonical_param_name(name: str) -> str:
    """The canonical (local-spec) name of a parameter name of either spec."""
    head, rest = _split(name)
    return head + _FROM_TE.get(rest, rest)


def _layer_order_key(rest: str) -> int:
    """Position of a canonical per-layer parameter in transformer_engine ``named_parameters()``."""
    order = ("self_attention.linear_proj.", "input_layernorm.", "self_attention.linear_qkv.",
             "self_attention.q_layernorm.", "self_attention.k_layernorm.", "pre_mlp_layernorm.",
             "mlp.linear_fc1.", "mlp.linear_fc2.")
    for i, prefix in enumerate(order):
        if rest.startswith(prefix):
            return i
    raise KeyError(f"no transformer_engine position for layer parameter {rest!r}")


def names_for_impl(canonical_names: Sequence[str], impl: str) -> List[str]:
    """Parameter names of a model under ``impl``, in that spec's ``named_parameters()`` order,
    from its canonical names in local-spec order (e.g. ``[s.name for s in param_specs(...)]``)."""
    _check_impl(impl)
    if impl == "local":
        return list(canonical_names)
    out: List[str] = []
    run: List[str] = []  # consecutive names of one layer

    def flush():
        # stable sort keeps weight before bias inside each module
        out.extend(param_name_for_impl(n, impl) for n in sorted(run, key=lambda n: _layer_order_key(_split(n)[1])))
        run.clear()

    for name in canonical_names:
        head, _ = _split(name)
        if run and (not head or _split(run[0])[0] != head):
            flush()
        if head:
            run.append(name)
        else:
            out.append(name)
    flush()
    return out


def drop_extra_state(sharded_state_dict):
    """The sharded state dict without TE's ``._extra_state`` entries (recursively, in place)."""
    if isinstance(sharded_state_dict, dict):
        for key in [k for k in sharded_state_dict if isinstance(k, str) and k.endswith("_extra_state")]:
            del sharded_state_dict[key]
        for v in sharded_state_dict.values():
            drop_extra_state(v)
    return sharded_state_dict


def table_params(module, role: str) -> Dict[str, object]:
    """A model's parameters under the routing table's local names (the scalar head
    ``output_layer.weight`` of critic/reward is the spec ``value_head.weight``; transformer_engine
    names are mapped to the canonical local-spec names). Tensors are the parameters' data (writes
    land in the model); ``module`` None (a rank outside the model) gives {}."""
    if module is None:
        return {}
    out = {}
    for name, p in module.named_parameters():
        if is_scalar_head(name, role):
            name = HEAD_SPEC_NAME
        out[canonical_param_name(name)] = p.data
    return out
