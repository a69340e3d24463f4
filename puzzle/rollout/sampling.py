"""Token selection from vocab-parallel logits, never gathering the vocabulary.

Every function takes this rank's logit slice ``[n, V/T]`` (vocabulary ids
``[vocab_start, vocab_start + V/T)``) and the model's TP group (``None`` for T=1). Decisions are
made on all-gathered small tensors and reduced in a fixed rank order, so every TP rank reaches
the same result bit for bit, and a result does not depend on T:

- greedy: local (max, first index) pairs, all-gathered; the highest value wins, ties go to the
  lowest global id.
- temperature, then top-k (HF semantics: keep logits >= the k-th largest, ties at the k-th value
  kept): local top-k values, all-gathered (k*T candidates), global k-th value as threshold.
- top-p (exact): a token with probability q is kept iff the mass of tokens with probability
  strictly greater than q is < top_p (the smallest nucleus reaching top_p; ties kept together).
  The threshold is found by bisection over the order-preserving integer key of the float32
  logits: at most 33 rounds, each one all-gather of ``[n]`` partial masses (float64).
- sampling: Gumbel-max, ``argmax(l_v + g(seed, sample, step, v))``. The noise is a counter-based
  hash of (seed, global sample index, step, global vocab id) turned into a uniform in (0, 1) with
  integer tensor ops; each rank hashes only its own vocabulary slice. Same seed, prompts and
  sample indices give the same tokens at any (P, D, T).

Ids >= ``true_vocab`` are never selected. Callers pass ``ModelArch.valid_vocab_size``, the
tokenizer's ids: the rows beyond it (a checkpoint's unused rows, the padding) get -inf logits
here exactly as in scoring and training (puzzle/engine/vocab_parallel.py), so every sampled
token is one the tokenizer can decode and its log-prob is the one scoring computes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple, Union

import torch
import torch.distributed as dist

from puzzle.engine.vocab_parallel import mask_padding as mask_vocab_rows
from puzzle.engine.vocab_parallel import vocab_parallel_logprobs

_M32 = 0xFFFFFFFF
_NEG_INF = float("-inf")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. ``greedy`` ignores temperature, top_k and top_p."""

    max_new_tokens: int
    temperature: float = 1.0
    top_k: int = 0          # 0 = off
    top_p: float = 1.0      # 1.0 = off
    greedy: bool = False
    eos_id: Optional[int] = None
    pad_id: int = 0
    eos_ids: Tuple[int, ...] = ()  # further stop ids (Llama-3: <|eot_id|> and <|end_of_text|>)

    @property
    def stop_ids(self) -> Tuple[int, ...]:
        """Every id that ends a response: ``eos_id`` and ``eos_ids``."""
        return tuple(dict.fromkeys(((self.eos_id,) if self.eos_id is not None else ()) + tuple(self.eos_ids)))

    def __post_init__(self):
        errors = []
        if not isinstance(self.max_new_tokens, int) or isinstance(self.max_new_tokens, bool) \
                or self.max_new_tokens < 1:
            errors.append(f"max_new_tokens must be an int >= 1 (got {self.max_new_tokens!r})")
        try:
            t = float(self.temperature)
            if not (t > 0.0 and t < float("inf")):
                errors.append(f"temperature must be a finite number > 0 (got {self.temperature!r}); "
                              "use greedy=True for argmax decoding")
        except (TypeError, ValueError):
            errors.append(f"temperature must be a number (got {self.temperature!r})")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            errors.append(f"top_k must be an int >= 0, 0 = off (got {self.top_k!r})")
        try:
            p = float(self.top_p)
            if not (0.0 < p <= 1.0):
                errors.append(f"top_p must be in (0, 1], 1 = off (got {self.top_p!r})")
        except (TypeError, ValueError):
            errors.append(f"top_p must be a number (got {self.top_p!r})")
        if not isinstance(self.greedy, bool):
            errors.append(f"greedy must be a bool (got {self.greedy!r})")
        if self.eos_id is not None and (not isinstance(self.eos_id, int) or self.eos_id < 0):
            errors.append(f"eos_id must be None or an int >= 0 (got {self.eos_id!r})")
        if not isinstance(self.eos_ids, tuple) or any(not isinstance(i, int) or i < 0 for i in self.eos_ids):
            errors.append(f"eos_ids must be a tuple of ints >= 0 (got {self.eos_ids!r})")
        if not isinstance(self.pad_id, int) or isinstance(self.pad_id, bool):
            errors.append(f"pad_id must be an int (got {self.pad_id!r})")
        if errors:
            raise ValueError("invalid SamplingParams: " + "; ".join(errors))


# ---------------------------------------------------------------------------------------------
# small collectives (fixed rank order => identical results on every TP rank)
# ---------------------------------------------------------------------------------------------
def tp_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def tp_rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


def _gather(x: torch.Tensor, group) -> torch.Tensor:
    """[T, *x.shape]: x from every TP rank, in rank order."""
    if tp_size(group) == 1:
        return x.unsqueeze(0)
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(tp_size(group))]
    dist.all_gather(parts, x, group=group)
    return torch.stack(parts)


def _sum(x: torch.Tensor, group) -> torch.Tensor:
    """Sum over TP ranks, added in rank order (not an all-reduce: bitwise equal on all ranks)."""
    return _gather(x, group).sum(dim=0)


def vocab_start(local_vocab: int, group) -> int:
    return tp_rank(group) * local_vocab


def vocab_ids_of(local_vocab: int, group, device) -> torch.Tensor:
    """The global vocabulary ids of this rank's logit slice."""
    start = vocab_start(local_vocab, group)
    return torch.arange(start, start + local_vocab, dtype=torch.long, device=device)


def mask_padding(logits: torch.Tensor, start: int, true_vocab: int) -> torch.Tensor:
    """A float32 copy of this rank's logit slice with scoring's mask (-inf on ids >= true_vocab)."""
    return mask_vocab_rows(logits.float(), start, true_vocab)


# ---------------------------------------------------------------------------------------------
# greedy
# ---------------------------------------------------------------------------------------------
def vocab_parallel_argmax(values: torch.Tensor, start: int, group) -> torch.Tensor:
    """Global argmax ids [n] of vocab-parallel values [n, V/T]; ties -> lowest global id."""
    idx = values.argmax(dim=-1)  # first maximal index locally
    if tp_size(group) == 1:
        return idx + start
    best = values.gather(-1, idx.unsqueeze(-1)).squeeze(-1)
    pairs = torch.stack([best.double(), (idx + start).double()], dim=-1)  # [n, 2]
    g = _gather(pairs, group)  # [T, n, 2]
    vals, ids = g[..., 0], g[..., 1]
    top = vals.max(dim=0).values
    ids = torch.where(vals == top.unsqueeze(0), ids, torch.full_like(ids, float("inf")))
    return ids.min(dim=0).values.long()


# ---------------------------------------------------------------------------------------------
# filters
# ---------------------------------------------------------------------------------------------
def top_k_filter(logits: torch.Tensor, k: int, group) -> torch.Tensor:
    """Keep logits >= the global k-th largest (k*T candidates all-gathered); others -> -inf."""
    if k <= 0:
        return logits
    n, v = logits.shape
    local = logits.topk(min(k, v), dim=-1).values  # [n, k']
    cands = _gather(local, group).permute(1, 0, 2).reshape(n, -1)
    thresh = cands.topk(min(k, cands.shape[1]), dim=-1).values[:, -1:]
    return logits.masked_fill(logits < thresh, _NEG_INF)


def _order_key(x: torch.Tensor) -> torch.Tensor:
    """int64 key with the same order as float32 ``x`` (-0.0 folded into +0.0)."""
    bits = (x.float() + 0.0).view(torch.int32).long()
    return torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


#: rounds after which the bisection of top_p_filter has closed for any float32 logits
TOP_P_ROUNDS = 33


def top_p_filter(logits: torch.Tensor, p: float, group, fixed_rounds: bool = False) -> torch.Tensor:
    """Exact nucleus filter on vocab-parallel logits [n, V/T] (already temperature-scaled).

    Keeps token v iff ``sum_{u: l_u > l_v} softmax(l)_u < p``. Bisection over the integer key of
    the logits for the smallest key t with ``mass(l > t) < p``; every round all-gathers [n]
    partial masses, so it ends after at most 33 rounds. ``fixed_rounds``: always run the 33
    rounds (a closed row no longer moves), without a host sync: the form a CUDA graph can hold.
    """
    if p >= 1.0:
        return logits
    valid = torch.isfinite(logits)
    m = _gather(logits.max(dim=-1).values, group).max(dim=0).values  # [n]
    e = torch.exp(logits.double() - m.double().unsqueeze(-1))
    e = torch.where(valid, e, torch.zeros_like(e))
    target = p * _sum(e.sum(dim=-1), group)  # [n]
    keys = _order_key(logits)
    big = torch.iinfo(torch.int64).max
    kmin = _gather(torch.where(valid, keys, torch.full_like(keys, big)).min(dim=-1).values,
                   group).min(dim=0).values
    hi = _gather(torch.where(valid, keys, torch.full_like(keys, -big)).max(dim=-1).values,
                 group).max(dim=0).values
    lo = kmin - 1  # mass(l > lo) = Z >= target; mass(l > hi) = 0 < target
    for _ in range(TOP_P_ROUNDS):  # closed after 33 rounds: hi - lo <= 2^32 + 1 at the start
        open_ = (hi - lo) > 1
        if not fixed_rounds and not bool(open_.any()):  # same decision on every TP rank
            break
        mid = lo + (hi - lo) // 2
        above = keys > mid.unsqueeze(-1)
        mass = _sum(torch.where(above, e, torch.zeros_like(e)).sum(dim=-1), group)
        ok = mass < target
        hi = torch.where(open_ & ok, mid, hi)
        lo = torch.where(open_ & ~ok, mid, lo)
    return logits.masked_fill(keys < hi.unsqueeze(-1), _NEG_INF)


# ---------------------------------------------------------------------------------------------
# counter-based noise
# ---------------------------------------------------------------------------------------------
def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for int64 x in [0, 2^32) without int64 overflow."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (lowbias32): a bijection of [0, 2^32) with good avalanche."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _absorb(h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    # (x + 0x9E3779B9) mod 2^32, written with a constant that fits in int32 (a compiled kernel
    # may add it to a 32-bit index)
    return _fmix32(h ^ _fmix32((x - 0x61C88647) & _M32))


def uniform_noise(seed: Union[int, torch.Tensor], sample_ids: torch.Tensor,
                  step: Union[int, torch.Tensor], start: int, end: int,
                  vocab_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Uniforms in (0, 1), float64 [n, end-start], a function of (seed, sample, step, vocab id) only.

    ``seed``: an int, or a one-element int64 tensor holding it (a CUDA graph reads it from there,
    so one capture serves every seed). ``vocab_ids``: ``arange(start, end)`` kept by the caller
    (a captured, compiled step reads it from memory)."""
    sample_ids = torch.as_tensor(sample_ids, dtype=torch.long).reshape(-1, 1)
    step = torch.as_tensor(step, dtype=torch.long, device=sample_ids.device).reshape(-1, 1)
    h = torch.full_like(sample_ids, 0x5EED5EED)
    if isinstance(seed, torch.Tensor):
        seed = seed.reshape(1, 1)
        words = [(seed & _M32).expand_as(sample_ids), ((seed >> 32) & _M32).expand_as(sample_ids)]
    else:
        seed = int(seed)
        words = [torch.full_like(sample_ids, w) for w in (seed & _M32, (seed >> 32) & _M32)]
    for word in words:
        h = _absorb(h, word)
    h = _absorb(h, sample_ids & _M32)
    h = _absorb(h, (sample_ids >> 32) & _M32)
    h = _absorb(h, step.expand_as(sample_ids) & _M32)
    if vocab_ids is None:
        vocab_ids = torch.arange(start, end, dtype=torch.long, device=sample_ids.device)
    h = _absorb(h, vocab_ids.unsqueeze(0))  # [n, V/T]
    return (h.double() + 0.5) / 4294967296.0


def gumbel_noise(seed, sample_ids: torch.Tensor, step, start: int, end: int,
                 vocab_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Standard Gumbel noise (float64) for global vocab ids [start, end)."""
    return -torch.log(-torch.log(uniform_noise(seed, sample_ids, step, start, end, vocab_ids)))


# ---------------------------------------------------------------------------------------------
# the entry point
# ---------------------------------------------------------------------------------------------
def sample_tokens(logits: torch.Tensor, params: SamplingParams, *, true_vocab: int,
                  seed: Union[int, torch.Tensor] = 0, sample_ids: Optional[torch.Tensor] = None,
                  step=0, tp_group=None, graph_safe: bool = False,
                  vocab_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Next tokens [n] (global ids, identical on every TP rank) from vocab-parallel logits [n, V/T].

    ``sample_ids``: global index of each row's sample in the whole batch (all DP ranks);
    ``step``: index of the token being generated (0 = first response token).
    ``graph_safe``: no host synchronisation (top-p runs its fixed number of rounds); same tokens.
    ``vocab_ids``: this rank's global vocabulary ids (``vocab_ids_of``), when the caller keeps them.
    """
    n, v = logits.shape
    start = vocab_start(v, tp_group)
    x = mask_padding(logits, start, true_vocab)
    if params.greedy:
        return vocab_parallel_argmax(x, start, tp_group)
    if float(params.temperature) != 1.0:
        x = x / float(params.temperature)
    x = top_k_filter(x, params.top_k, tp_group)
    x = top_p_filter(x, float(params.top_p), tp_group, fixed_rounds=graph_safe)
    if sample_ids is None:
        sample_ids = torch.arange(n, device=logits.device)
    y = x.double() + gumbel_noise(seed, sample_ids, step, start, start + v, vocab_ids)
    return vocab_parallel_argmax(y, start, tp_group)


def sampled_logprobs(logits: torch.Tensor, tokens: torch.Tensor, params: SamplingParams, *,
                     true_vocab: int, tp_group=None) -> torch.Tensor:
    """log p(tokens) [n] (float32, identical on every TP rank) from vocab-parallel logits [n, V/T].

    p is softmax(logits / temperature) over the tokenizer's ids (temperature 1 when greedy),
    WITHOUT the top-k/top-p filter: the distribution scoring and training compute the old and new
    log-probs under. It is computed by the same function as theirs
    (puzzle/engine/vocab_parallel.py ``vocab_parallel_logprobs``), so where the logits of a
    token are the same in generation and in scoring, the two log-probs are the same bit for bit,
    and their difference (the ``gen_score_logprob_*`` metrics) measures only what the kernels and
    layouts change. The filtered distribution tokens are drawn from would add log(1 / kept mass)
    to every token's log-prob: a difference of the sampling settings, not of the kernels, that
    is there at any precision. No host synchronisation (a whole-step CUDA graph holds it).
    """
    temperature = 1.0 if params.greedy else float(params.temperature)
    lp = vocab_parallel_logprobs(logits.unsqueeze(1), tokens.unsqueeze(1), tp_group, true_vocab,
                                 temperature=temperature)
    return lp.squeeze(1)
