"""Patch: megatron-core's MoE layers train at tensor parallelism T > 1 without sequence parallelism.

Target: ``megatron.core.transformer.moe.moe_layer.MoELayer.forward`` and
``megatron.core.distributed.finalize_model_grads.finalize_model_grads``, checked on megatron-core
0.16.0 and 0.16.1.

Reason: ``MoELayer.forward`` raises "performance may degrade if MoE and tensor parallelism are
enabled without also enabling sequence parallelism" whenever a MoE layer trains at T > 1 without
``--sequence-parallel``, and puzzle's local layer spec cannot run sequence parallelism (its norms
refuse it). The guard is not only about speed: megatron's routers and token dispatchers assume
sequence-parallel input when T > 1. Fed the whole sequence on every tensor-parallel rank (the
guard skipped, nothing else changed), the dispatchers gather the T identical copies of each token
(ETP > 1) or the expert data-parallel gradient sum adds them (ETP = 1): the tiny MoE PPO run's
gradient norms at T = 2 then differ from T = 1's by 0.5%.

The patch runs each MoE layer that trains at T > 1 without sequence parallelism exactly as it
runs under sequence parallelism: the layer's input is split along the sequence over the
attention tensor-parallel group (the backward gathers the gradients), the unmodified forward
routes, dispatches, computes and combines this rank's share of the tokens, and the output is
gathered along the sequence (the backward keeps this rank's share of the gradient, which every
tensor-parallel rank holds whole). A sequence length that T does not divide is padded with zero
tokens, masked out of the load-balancing loss, whose outputs are dropped. Routers then see a
share of the tokens, so their weight gradients are partial sums; as megatron does for
sequence-parallel routers, ``finalize_model_grads`` sums them over the tensor-parallel group.
Experts at E = ETP = 1 are whole on every tensor-parallel rank: their gradients are summed over
those ranks because puzzle.engine.model_engine puts them in megatron's expert gradient buffers
(reduced over the expert data-parallel group, which spans them) at every E. Layers that do not
train, T = 1, and models built with sequence parallelism run megatron's code unchanged.

Remove when: puzzle's layer spec runs sequence parallelism (then train MoE at T > 1 with
``--sequence-parallel`` instead), or megatron-core splits the tokens itself without it.
"""

from __future__ import annotations

_applied = False
#: set on router parameters whose gradients are partial sums over the tensor-parallel group
_TP_PARTIAL_GRAD = "_moe_router_grad_partial_over_tp"


def _splits_tokens(layer) -> bool:
    return layer.training and layer.attn_tp_group.size() > 1 and not layer.config.sequence_parallel


def _sequence_share(layer, hidden_states, padding_mask):
    """This rank's share of the sequence (dim 0 of [s, b, h]; dim 1 of the [b, s] padding mask,
    True at padding). A length that T does not divide is padded with zero tokens that the
    padding mask keeps out of the load-balancing loss; their outputs are dropped."""
    import torch
    from megatron.core.tensor_parallel.mappings import scatter_to_sequence_parallel_region

    group = layer.attn_tp_group
    size, rank = group.size(), group.rank()
    pad = -hidden_states.shape[0] % size
    if pad:
        s, b = hidden_states.shape[:2]
        zeros = hidden_states.new_zeros((pad,) + tuple(hidden_states.shape[1:]))
        hidden_states = torch.cat([hidden_states, zeros])
        if padding_mask is None:
            padding_mask = torch.zeros(b, s, dtype=torch.bool, device=hidden_states.device)
        padding_mask = torch.cat([padding_mask.bool(), padding_mask.new_ones(b, pad, dtype=torch.bool)], dim=1)
    share = scatter_to_sequence_parallel_region(hidden_states, group=group)
    if padding_mask is not None:
        padding_mask = padding_mask.chunk(size, dim=1)[rank].contiguous()
    return share, padding_mask


def _mark_router_partial(layer) -> None:
    for param in layer.router.parameters():
        setattr(param, _TP_PARTIAL_GRAD, True)


def _make_forward(original):
    def forward(self, hidden_states, intermediate_tensors=None, padding_mask=None):
        if not _splits_tokens(self) or intermediate_tensors is not None:
            return original(self, hidden_states, intermediate_tensors, padding_mask)
        from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

        _mark_router_partial(self)
        length = hidden_states.shape[0]
        share, padding_mask = _sequence_share(self, hidden_states, padding_mask)
        # the layer's own training flag only guards sequence parallelism (its router and experts
        # keep theirs): the share below is what the guard asks for
        self.training = False
        try:
            output, mlp_bias = original(self, share, None, padding_mask)
        finally:
            self.training = True
        output = gather_from_sequence_parallel_region(output, tensor_parallel_output_grad=False,
                                                      group=self.attn_tp_group)
        return output[:length], mlp_bias

    forward._moe_tensor_parallel_without_sp = True
    return forward


def _sum_partial_router_grads(model, config, pg_collection=None) -> None:
    """Sum the routers' partial weight gradients over the tensor-parallel group (megatron does this
    for sequence-parallel parameters only when the model runs sequence parallelism)."""
    import torch
    from megatron.core import parallel_state
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    if config.sequence_parallel:
        return
    group = pg_collection.tp if pg_collection is not None else parallel_state.get_tensor_model_parallel_group()
    if group.size() <= 1:
        return
    grads = []
    for chunk in model:
        for param in chunk.parameters():
            if param.requires_grad and getattr(param, _TP_PARTIAL_GRAD, False):
                grad = getattr(param, "main_grad", None)
                grads.append(param.grad if grad is None else grad)
    grads = [g.data for g in grads if g is not None]
    if not grads:
        return
    flat = _flatten_dense_tensors(grads)
    torch.distributed.all_reduce(flat, group=group)
    for grad, summed in zip(grads, _unflatten_dense_tensors(flat, grads)):
        grad.copy_(summed)


def _make_finalize(original):
    def finalize_model_grads(model, num_tokens=None, pg_collection=None, **kwargs):
        # before the gradient clipping and the optimizer step, after the data-parallel reduction
        # (a sum over both groups commutes)
        result = original(model, num_tokens=num_tokens, pg_collection=pg_collection, **kwargs)
        from megatron.core.utils import get_model_config

        _sum_partial_router_grads(model, get_model_config(model[0]), pg_collection)
        return result

    finalize_model_grads._moe_tensor_parallel_without_sp = True
    return finalize_model_grads


def apply() -> None:
    global _applied
    if _applied:
        return
    import importlib

    from megatron.core.transformer.moe.moe_layer import MoELayer

    # the package re-exports the function under the submodule's name: patch the submodule, where
    # callers import it from, and the re-export
    finalize_module = importlib.import_module("megatron.core.distributed.finalize_model_grads")
    package = importlib.import_module("megatron.core.distributed")

    if not getattr(MoELayer.forward, "_moe_tensor_parallel_without_sp", False):
        MoELayer.forward = _make_forward(MoELayer.forward)
    if not getattr(finalize_module.finalize_model_grads, "_moe_tensor_parallel_without_sp", False):
        finalize_module.finalize_model_grads = _make_finalize(finalize_module.finalize_model_grads)
    package.finalize_model_grads = finalize_module.finalize_model_grads
    _applied = True
