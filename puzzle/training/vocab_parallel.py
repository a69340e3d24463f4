"""Log-probabilities and entropy from vocab-parallel logits, without gathering the vocabulary.

Each TP rank holds logits for its vocabulary slice [b, s, V/T]. Reductions over the vocabulary
use megatron's differentiable ``reduce_from_tensor_model_parallel_region`` (all-reduce forward,
identity backward) on the MODEL's TP group — never megatron's global group. Ids >= ``true_vocab``
(``ModelArch.valid_vocab_size``: the tokenizer's ids; beyond it a checkpoint's unused rows and the
padding) are masked out, as sampling masks them (puzzle/rollout/sampling.py).
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
    rank, differentiable with respect to ``logits``.
    """
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
    p_times_logit = torch.where(probs > 0, probs * shifted, torch.zeros_like(probs)).sum(dim=-1)
    entropy = log_z - _reduce(p_times_logit, tp_group)
    return logprobs, entropy
