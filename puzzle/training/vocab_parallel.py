"""Log-probabilities and entropy from vocab-parallel logits, without gathering the vocabulary.

Each TP rank holds logits for its vocabulary slice [b, s, V/T]. Reductions over the vocabulary
use megatron's differentiable ``reduce_from_tensor_model_parallel_region`` (all-reduce forward,
identity backward) on the MODEL's TP group — never megatron's global group. Padding ids
(>= the true vocabulary size) are masked out.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _vocab_range(local_vocab: int, tp_group) -> tuple:
    rank = dist.get_rank(tp_group) if tp_group is not None else 0
    return rank * local_vocab, (rank + 1) * local_vocab


def _mask_padding(logits: torch.Tensor, start: int, true_vocab: int) -> torch.Tensor:
    ids = torch.arange(start, start + logits.shape[-1], device=logits.device)
    if int(ids[-1]) < true_vocab:
        return logits
    return logits.masked_fill(ids >= true_vocab, float("-inf"))


def _allreduce_max(x: torch.Tensor, tp_group) -> torch.Tensor:
    x = x.detach().clone()
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=tp_group)
    return x


def _reduce(x: torch.Tensor, tp_group) -> torch.Tensor:
    if tp_group is None or dist.get_world_size(tp_group) == 1:
        return x
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    return reduce_from_tensor_model_parallel_region(x, group=tp_group)


def vocab_parallel_logprobs(logits: torch.Tensor, targets: torch.Tensor, tp_group,
                            true_vocab: int, temperature: float = 1.0,
                            with_entropy: bool = False):
    """log p(targets) from vocab-parallel logits.

    logits: [b, s, V/T] (this rank's slice, float); targets: [b, s] global token ids.
    Returns logprobs [b, s] (and entropy [b, s] when ``with_entropy``), identical on every TP
    rank, differentiable with respect to ``logits``. Logits larger than ``LOGITS_CHUNK_BYTES`` of
    fp32 go through :func:`logprobs_in_chunks` (no fp32 copy of the whole tensor).
    """
    if sequence_chunk(logits.shape) < logits.shape[1]:
        return logprobs_in_chunks(logits, targets, tp_group, true_vocab, temperature, with_entropy,
                                  sequence_chunk(logits.shape))
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    start, end = _vocab_range(logits.shape[-1], tp_group)
    logits = _mask_padding(logits, start, true_vocab)
    m = _allreduce_max(logits.max(dim=-1).values, tp_group)  # [b, s]
    shifted = logits - m.unsqueeze(-1)
    exp = shifted.exp()
    sum_exp = _reduce(exp.sum(dim=-1), tp_group)
    log_z = sum_exp.log()
    in_range = (targets >= start) & (targets < end)
    local_ids = (targets - start).clamp(0, logits.shape[-1] - 1)
    picked = shifted.gather(-1, local_ids.unsqueeze(-1)).squeeze(-1)
    picked = torch.where(in_range, picked, torch.zeros_like(picked))
    target_logit = _reduce(picked, tp_group)
    logprobs = target_logit - log_z
    if not with_entropy:
        return logprobs
    probs = exp / sum_exp.unsqueeze(-1)
    # masked ids (shifted = -inf, p = 0) are zeroed before the product: 0 * -inf would give NaN
    # gradients even where the forward discards it
    p_times_logit = (probs * torch.where(probs > 0, shifted, torch.zeros_like(shifted))).sum(dim=-1)
    entropy = log_z - _reduce(p_times_logit, tp_group)
    return logprobs, entropy


# ---- chunks of the sequence (long sequences: no [b, s, V/T] fp32 tensor lives whole) -----------
#: fp32 bytes of one [b, chunk, V/T] slice of the logits: the computation above holds a handful of
#: such tensors at once (the fp32 copy, shifted, exp, probabilities), for one chunk at a time
LOGITS_CHUNK_BYTES = 256 << 20


def sequence_chunk(shape, chunk_bytes: int = LOGITS_CHUNK_BYTES) -> int:
    """Positions per chunk of [b, s, V/T] logits so that one chunk's fp32 slice stays within
    ``chunk_bytes`` (s: the logits fit whole)."""
    b, s, v = shape
    return max(1, min(s, chunk_bytes // (4 * b * v)))


def logprobs_in_chunks(logits: torch.Tensor, targets: torch.Tensor, tp_group, true_vocab: int,
                       temperature: float, with_entropy: bool, chunk: int):
    """:func:`vocab_parallel_logprobs` over ``chunk`` positions of the sequence at a time, each
    chunk's fp32 intermediates dropped after its forward and recomputed in its backward
    (activation checkpointing of the chunk). The same numbers, per position, as the whole
    computation; every TP rank takes the same chunks, so the collectives stay matched."""
    from torch.utils.checkpoint import checkpoint

    def one(x, t):
        out = vocab_parallel_logprobs(x, t, tp_group, true_vocab, temperature, with_entropy)
        return out if with_entropy else (out,)

    parts = []
    for x, t in zip(logits.split(chunk, dim=1), targets.split(chunk, dim=1)):
        if torch.is_grad_enabled() and x.requires_grad:
            parts.append(checkpoint(one, x, t, use_reentrant=False, preserve_rng_state=False))
        else:
            parts.append(one(x, t))
    outs = tuple(torch.cat(p, dim=1) for p in zip(*parts))
    return outs if with_entropy else outs[0]
