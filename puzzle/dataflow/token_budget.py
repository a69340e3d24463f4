"""Token-budget micro-batches and data-parallel balancing by token count (pure, no torch).

verl's ``use_dynamic_bsz`` with ``ppo_max_token_len_per_gpu`` (--use-dynamic-bsz,
--ppo-max-token-len-per-gpu, --log-prob-max-token-len-per-gpu): a micro-batch is no longer a fixed
number of rows but as many packed sequences as fit a token budget, so a micro-batch of short
responses holds many rows and one of long responses few, and every micro-batch costs about the same.

- ``balance_rows``: the rows of a (mini-)batch split over the D data-parallel ranks, the same count
  on every rank and the token sums as even as a greedy longest-first assignment makes them (verl
  balances sequence lengths across DP ranks before sharding for the same reason: the slowest rank
  sets the pace of the step).
- ``budget_micro_batches``: one rank's rows grouped into micro-batches within the budget: the fewest k
  from ceil(total / budget) up for which a longest-first assignment to the lightest of k micro-batches
  fits (balanced token sums), else first-fit decreasing (never more micro-batches than it needs). A sequence longer than the budget cannot be split (attention spans the whole
  sequence); it is refused here, and validate_args refuses a budget below the longest possible
  sequence (max prompt + max new tokens) before anything runs.

Every rank computes the same groups from the same lengths (the rollout is assembled on every rank),
so the ranks of one pipeline agree on the number of micro-batches. Data-parallel ranks may differ in
that number: megatron's per-token loss (``calculate_per_token_loss``) sums each micro-batch's loss
numerator and weight, and finalize_model_grads divides the gradients by the weights all-reduced
over the DP group, so a token's loss does not depend on the micro-batch (or rank) it lands in.
"""

from __future__ import annotations

import heapq
from typing import List, Sequence


def _longest_first(lengths: Sequence[int], indices: Sequence[int]) -> List[int]:
    return sorted(indices, key=lambda i: (-lengths[i], i))


def balance_rows(lengths: Sequence[int], parts: int) -> List[List[int]]:
    """``len(lengths) / parts`` row indices per part (ascending in each), the token sums balanced:
    rows longest first, each to the lightest part that still has room (ties: the lower part)."""
    n = len(lengths)
    if parts < 1 or n % parts:
        raise ValueError(f"cannot split {n} rows into {parts} equal data-parallel shares")
    room = n // parts
    groups: List[List[int]] = [[] for _ in range(parts)]
    heap = [(0, p) for p in range(parts)]  # (tokens, part) of the parts with room
    for i in _longest_first(lengths, range(n)):
        tokens, p = heapq.heappop(heap)
        groups[p].append(i)
        if len(groups[p]) < room:
            heapq.heappush(heap, (tokens + lengths[i], p))
    return [sorted(g) for g in groups]


def _assign(lengths: Sequence[int], order: List[int], k: int, budget: int):
    """Longest-first assignment of ``order`` to the lightest of ``k`` bins; None if one overflows."""
    bins: List[List[int]] = [[] for _ in range(k)]
    heap = [(0, b) for b in range(k)]
    for i in order:
        tokens, b = heapq.heappop(heap)
        if tokens + lengths[i] > budget:
            return None
        bins[b].append(i)
        heapq.heappush(heap, (tokens + lengths[i], b))
    return bins


def budget_micro_batches(lengths: Sequence[int], budget: int) -> List[List[int]]:
    """Row indices grouped into micro-batches of at most ``budget`` tokens each (ascending in each
    micro-batch; micro-batches ordered by their first row): no more than first-fit decreasing needs,
    with balanced token sums where a longest-first assignment to fewer fits."""
    if budget < 1:
        raise ValueError(f"the token budget must be >= 1 (got {budget})")
    if not lengths:
        return []
    longest = max(lengths)
    if longest > budget:
        raise ValueError(f"a {longest}-token sequence does not fit the micro-batch token budget {budget} "
                         "(--ppo-max-token-len-per-gpu / --log-prob-max-token-len-per-gpu must be at "
                         "least the longest sequence)")
    order = _longest_first(lengths, range(len(lengths)))
    bins = _first_fit(lengths, order, budget)
    for k in range(max(1, -(-sum(lengths) // budget)), len(bins)):
        balanced = _assign(lengths, order, k, budget)
        if balanced is not None:
            bins = balanced
            break
    return sorted((sorted(b) for b in bins if b), key=lambda b: b[0])


def _first_fit(lengths: Sequence[int], order: List[int], budget: int) -> List[List[int]]:
    """First-fit decreasing: each row into the first bin with room (the upper bound on the count)."""
    bins: List[List[int]] = []
    room: List[int] = []
    for i in order:
        b = next((j for j, r in enumerate(room) if r >= lengths[i]), None)
        if b is None:
            bins.append([])
            room.append(budget)
            b = len(bins) - 1
        bins[b].append(i)
        room[b] -= lengths[i]
    return bins


def split_to_count(lengths: Sequence[int], bins: List[List[int]], count: int) -> List[List[int]]:
    """``bins`` (row indices, e.g. ``budget_micro_batches``'s) split until there are ``count``: each time
    the bin of the most tokens among those of two rows or more, into two of balanced token sums
    (longest-first), so no bin grows. Ordered like ``budget_micro_batches``'s. MoE models with their
    experts split over E > 1 ranks run their token dispatchers' collectives once per micro-batch in
    every rank of an expert group: their data-parallel ranks must run the same number of them."""
    if not len(bins) <= count <= len(lengths):
        raise ValueError(f"cannot split {len(bins)} micro-batches of {len(lengths)} rows into {count}")
    bins = [list(b) for b in bins]
    while len(bins) < count:
        splittable = [b for b in bins if len(b) > 1]
        heaviest = max(splittable, key=lambda b: (sum(lengths[i] for i in b), -b[0]))
        bins.remove(heaviest)
        halves = _assign(lengths, _longest_first(lengths, heaviest), 2, sum(lengths[i] for i in heaviest))
        bins.extend(halves)
    return sorted((sorted(b) for b in bins), key=lambda b: b[0])
