"""Patch: megatron-core's all-gather MoE token dispatcher with different token counts per rank.

Target: ``megatron.core.transformer.moe.token_dispatcher.MoEAllGatherTokenDispatcher``
(``token_dispatch`` and ``token_combine``), checked on megatron-core 0.16.0 and 0.16.1. CPU and GPU.

Reason: the dispatcher all-gathers the routing map, the probabilities and the hidden states over
its tensor x expert-parallel group, and reduce-scatters the experts' outputs back, with equal
sizes on every rank: it assumes every rank of the group holds the same number of tokens. Packed
micro-batches (--use-remove-padding, --use-dynamic-bsz) hold each rank's own number of tokens,
and the ranks of an expert group are different data-parallel ranks: on gloo the all-gather
aborted the process (SIGABRT), on NCCL it would read past the smaller ranks' tensors. megatron's
``gather_from_sequence_parallel_region`` takes ``output_split_sizes``, but gloo's all-gather
refuses tensors of different sizes.

The patch exchanges the group's token counts (one all-reduce of one integer per MoE layer and
forward pass) and, where they differ, appends rows to this rank's tokens up to the group's
largest count: zero hidden states, zero probabilities and an all-False routing map, so no expert
is given them (megatron permutes only the routed tokens) and they add nothing to the combined
outputs. The collectives then see equal sizes, and the combined output drops the appended rows
(their gradients are zero). The experts compute exactly the real tokens; only the all-gather and
reduce-scatter carry up to the group's largest count per rank (the routers, the load-balancing
loss and everything before and after the dispatcher see this rank's tokens only). Equal counts
(fixed-size padded micro-batches) run megatron's code unchanged.

Remove when: megatron-core's all-gather dispatcher exchanges the token counts of its ranks itself.
"""

from __future__ import annotations

_applied = False


def _group_max_tokens(count: int, group, device) -> int:
    import torch

    t = torch.tensor([count], dtype=torch.long, device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=group)
    return int(t.item())


def _pad_rows(tensor, rows: int):
    import torch

    return torch.cat([tensor, tensor.new_zeros((rows,) + tuple(tensor.shape[1:]))])


def _make_dispatch(original):
    def token_dispatch(self, hidden_states, probs):
        self._local_tokens = None
        if self.tp_size > 1 or self.ep_size > 1:
            count = hidden_states.shape[0]
            most = _group_max_tokens(count, self.tp_ep_group, hidden_states.device)
            if most > count:  # this rank's tokens, then rows no expert is given
                self._local_tokens = count
                hidden_states = _pad_rows(hidden_states, most - count)
                probs = _pad_rows(probs, most - count)
                self.routing_map = _pad_rows(self.routing_map, most - count)
        return original(self, hidden_states, probs)

    token_dispatch._moe_allgather_token_counts = True
    return token_dispatch


def _make_combine(original):
    def token_combine(self, hidden_states):
        output = original(self, hidden_states)
        count = getattr(self, "_local_tokens", None)
        if count is not None:
            self._local_tokens = None
            output = output[:count]
        return output

    token_combine._moe_allgather_token_counts = True
    return token_combine


def apply() -> None:
    global _applied
    if _applied:
        return
    from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher as D

    if not getattr(D.token_dispatch, "_moe_allgather_token_counts", False):
        D.token_dispatch = _make_dispatch(D.token_dispatch)
    if not getattr(D.token_combine, "_moe_allgather_token_counts", False):
        D.token_combine = _make_combine(D.token_combine)
    _applied = True
