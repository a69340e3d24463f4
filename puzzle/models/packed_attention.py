"""Packed sequences (THD): several sequences concatenated without padding, and causal attention
within each of them at the cost of the sum of their squared lengths.

``PackedSequences`` is megatron-core's ``PackedSeqParams`` (``qkv_format='thd'``, ``cu_seqlens``),
so megatron's Attention, its THD RoPE (positions restart per sequence) and transformer-engine's
varlen kernels read it as they are. It also carries what the CPU core attentions need, computed
once per micro-batch on the host: the sequences grouped by length. ``packed_attention`` runs one
attention call per distinct length (the sequences of that length gathered into one batch), never
a dense block-diagonal mask over the whole micro-batch: with all lengths equal it is one batched
call, as in the padded path; with long-tailed lengths each call is as long as its sequences.

On a GPU, ``varlen_flash_attention`` runs the whole micro-batch as ONE call of torch's flash-
attention varlen kernel (``aten::_flash_attention_forward`` with ``cu_seqlens``, differentiable;
its positional arguments and ``scale`` are the same from torch 2.2 on), causal within each
sequence, where that kernel applies (``varlen_flash_usable``: CUDA, fp16/bf16, head dim a multiple
of 8 up to 256, no attention dropout, compute capability 8.0 or newer); the per-length calls stay
the path everywhere else.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch

from megatron.core.packed_seq_params import PackedSeqParams


@dataclass
class PackedSequences(PackedSeqParams):
    """PackedSeqParams of sequences of ``lengths`` tokens (host ints), packed in that order."""

    lengths: Tuple[int, ...] = ()
    _plans: Dict[str, "_GroupPlan"] = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, lengths: List[int], device=None) -> "PackedSequences":
        if not lengths or min(lengths) < 1:
            raise ValueError(f"packed sequences need at least one token each (lengths {lengths})")
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        cu = torch.tensor(cu, dtype=torch.int32, device=device)
        return cls(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lengths),
                   max_seqlen_kv=max(lengths), lengths=tuple(int(n) for n in lengths))

    @property
    def total(self) -> int:
        return int(sum(self.lengths))

    def plan(self, device) -> "_GroupPlan":
        key = str(device)
        if key not in self._plans:
            self._plans[key] = _GroupPlan.build(self.lengths, device)
        return self._plans[key]


@dataclass
class _GroupPlan:
    """Sequences grouped by length. Per group (length n, count k, first token of a contiguous run
    of the k sequences or None, else the gather index [k * n] sequence-major); ``inverse`` maps the
    groups' concatenated outputs back to packed order (None when already in it)."""

    groups: List[Tuple[int, int, Optional[int], Optional[torch.Tensor]]]
    inverse: Optional[torch.Tensor]

    @classmethod
    def build(cls, lengths, device) -> "_GroupPlan":
        starts, s = [], 0
        for n in lengths:
            starts.append(s)
            s += n
        by_length: Dict[int, List[int]] = {}
        for n, st in zip(lengths, starts):
            by_length.setdefault(n, []).append(st)
        groups, order = [], []
        for n, sts in sorted(by_length.items(), key=lambda kv: kv[1][0]):
            flat = [st + p for st in sts for p in range(n)]
            if flat == list(range(sts[0], sts[0] + len(flat))):  # one contiguous run: a view
                groups.append((n, len(sts), sts[0], None))
            else:
                groups.append((n, len(sts), None, torch.tensor(flat, dtype=torch.long, device=device)))
            order.extend(flat)
        inverse = None
        if order != list(range(len(order))):
            inverse = torch.empty(len(order), dtype=torch.long)
            inverse[torch.tensor(order)] = torch.arange(len(order))
            inverse = inverse.to(device)
        return cls(groups, inverse)


def packed_attention(attend: Callable, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     packed: PackedSequences) -> torch.Tensor:
    """Causal attention within each packed sequence.

    query [T, h, d], key/value [T, g, d] (megatron squeezes THD's batch dimension);
    ``attend(q [n, k, h, d], k, v) -> [n, k, h * d]`` is a core attention's causal call on k
    sequences of n tokens. Returns [T, h * d].
    """
    if query.shape[0] != packed.total:
        raise ValueError(f"packed attention: {query.shape[0]} tokens but the sequences hold {packed.total}")
    plan = packed.plan(query.device)
    pieces = []
    for n, k, start, index in plan.groups:
        if index is None:
            def take(t):  # [k * n, heads, d] run -> [n, k, heads, d] (a view where the strides allow)
                return t[start:start + k * n].reshape(k, n, *t.shape[1:]).transpose(0, 1)
        else:
            def take(t):
                return t.index_select(0, index).reshape(k, n, *t.shape[1:]).transpose(0, 1)
        out = attend(take(query), take(key), take(value))  # [n, k, h * d]
        pieces.append(out.transpose(0, 1).reshape(k * n, -1))
    out = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=0)
    return out if plan.inverse is None else out.index_select(0, plan.inverse)


def varlen_flash_usable(query: torch.Tensor, key: torch.Tensor, dropout_p: float) -> bool:
    """Whether torch's flash-attention varlen kernel takes this packed call: CUDA tensors in
    fp16/bf16, head dim a multiple of 8 up to 256, query heads a multiple of the key/value heads,
    no attention dropout (megatron's RNG tracker forks it), a GPU of compute capability >= 8.0."""
    d = query.shape[-1]
    return (query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and key.dtype == query.dtype
            and dropout_p == 0.0 and d % 8 == 0 and d <= 256 and query.shape[-2] % key.shape[-2] == 0
            and torch.cuda.get_device_capability(query.device)[0] >= 8)


def varlen_flash_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           packed: PackedSequences, scale: float) -> torch.Tensor:
    """Causal attention within each packed sequence in one kernel call: query [T, h, d],
    key/value [T, g, d] (g dividing h: grouped-query attention as the kernel does it) -> [T, h * d]."""
    if query.shape[0] != packed.total:
        raise ValueError(f"packed attention: {query.shape[0]} tokens but the sequences hold {packed.total}")
    cu = packed.cu_seqlens_q.to(device=query.device, dtype=torch.int32)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
    out = flash_varlen_kernel(q, k, v, cu, packed.max_seqlen_q, scale)
    return out.reshape(out.shape[0], -1)


def flash_varlen_kernel(q, k, v, cu_seqlens: torch.Tensor, max_len: int, scale: float) -> torch.Tensor:
    """torch's flash-attention forward over sequences ``cu_seqlens`` (int32 [n + 1]), causal, no
    dropout: [T, h, d] -> [T, h, d]. Its autograd runs the kernel's own backward."""
    return torch.ops.aten._flash_attention_forward(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, 0.0,
                                                   True, False, scale=scale)[0]
