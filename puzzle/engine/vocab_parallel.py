"""Log-probabilities and entropy from vocab-parallel logits, without gathering the vocabulary.

Each TP rank holds logits for its vocabulary slice [b, s, V/T]. Reductions over the vocabulary
use megatron's differentiable ``reduce_from_tensor_model_parallel_region`` (all-reduce forward,
identity backward) on the MODEL's TP group — never megatron's global group. Ids >= ``true_vocab``
(``ModelArch.valid_vocab_size``: the tokenizer's ids; beyond it a checkpoint's unused rows and the
padding) are masked out, as sampling masks them (puzzle/rollout/sampling.py).

In ``--batch-invariant-mode`` (puzzle/models/batch_invariant.py) the sums over the vocabulary are
row-invariant products and the partial sums of the TP ranks are added in rank order (megatron's
all-reduce goes to the mode's, megatron_patches/batch_invariant_reduce.py), so a
position's log-prob has the same bits in a decode step (one row per sequence) and in scoring
(every position of a packed micro-batch).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from puzzle.models import batch_invariant


def _vocab_range(local_vocab: int, tp_group) -> tuple:
    rank = dist.get_rank(tp_group) if tp_group is not None else 0
    return rank * local_vocab, (rank + 1) * local_vocab


def mask_padding(logits: torch.Tensor, start: int, true_vocab: int) -> torch.Tensor:
    """-inf on the ids >= true_vocab (ModelArch.valid_vocab_size) of a rank's vocab slice starting
    at ``start``: the one mask of the ids a response may not contain, in generation, scoring and
    training alike."""
    if start + logits.shape[-1] <= true_vocab:  # decided on the host (a CUDA graph may hold this)
        return logits
    ids = torch.arange(start, start + logits.shape[-1], device=logits.device)
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
    logits = mask_padding(logits, start, true_vocab)
    m = _allreduce_max(logits.max(dim=-1).values, tp_group)  # [b, s]
    shifted = logits - m.unsqueeze(-1)
    exp = shifted.exp()
    sum_exp = _reduce(batch_invariant.row_sum(exp) if batch_invariant.active() else exp.sum(dim=-1), tp_group)
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
    """:func:`vocab_parallel_logprobs` over ``chunk`` positions of the sequence at a time. The
    forward keeps no chunk's fp32 intermediates; the backward recomputes one chunk at a time and
    writes its gradient into one gradient of the logits (no per-chunk copies). The same numbers,
    per position, as the whole computation; every TP rank takes the same chunks, so the
    collectives stay matched."""
    lp, ent = _ChunkedLogprobs.apply(logits, targets, tp_group, true_vocab, temperature, with_entropy, chunk)
    return (lp, ent) if with_entropy else lp


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, tp_group, true_vocab, temperature, with_entropy, chunk):
        ctx.save_for_backward(logits, targets)
        ctx.args = (tp_group, true_vocab, temperature, with_entropy, chunk)
        lps, ents = [], []
        for x, t in zip(logits.split(chunk, dim=1), targets.split(chunk, dim=1)):
            out = vocab_parallel_logprobs(x, t, tp_group, true_vocab, temperature, with_entropy)
            lp, ent = out if with_entropy else (out, None)
            lps.append(lp)
            if ent is not None:
                ents.append(ent)
        lp = torch.cat(lps, dim=1)
        return lp, torch.cat(ents, dim=1) if ents else torch.zeros_like(lp)

    @staticmethod
    def backward(ctx, grad_lp, grad_ent):
        logits, targets = ctx.saved_tensors
        tp_group, true_vocab, temperature, with_entropy, chunk = ctx.args
        grad = torch.empty_like(logits)
        for i in range(0, logits.shape[1], chunk):
            x = logits[:, i:i + chunk].detach().requires_grad_(True)
            with torch.enable_grad():
                out = vocab_parallel_logprobs(x, targets[:, i:i + chunk], tp_group, true_vocab, temperature,
                                              with_entropy)
            outs, grads = ((out[0], out[1]), (grad_lp[:, i:i + chunk], grad_ent[:, i:i + chunk])) \
                if with_entropy else ((out,), (grad_lp[:, i:i + chunk],))
            grad[:, i:i + chunk] = torch.autograd.grad(outs, x, grads)[0]
        return grad, None, None, None, None, None, None
