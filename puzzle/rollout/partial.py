"""Partial rollouts: stop generation at a quota of finished groups, carry the unfinished samples
over to the next iteration and resume them there (issue #36, the long tail; Megatron-LM RL's
``--rl-partial-rollouts``).

The generation stage serves more prompts than the rollout batch needs and stops as soon as the
batch's quota of finished samples is met: for group estimators (GRPO, n samples per prompt) whole
groups, every sample of a prompt finished. The samples still running are not thrown away: their
tokens so far, each token's log-prob as sampled (the behaviour log-prob) and the policy version
each token was sampled under are kept, and in a later iteration the sample resumes under the
weights of then, by a prefill of prompt + partial response. Nothing is lost or duplicated, and the
order in which carried samples come back is deterministic.

What exists (the mechanics, tested):

- ``GroupQuota``: the stop rule ``puzzle.rollout.generation.generate(stop=...)`` checks after
  every model call (P=1, continuous batching); ``GenerationOutput.finished`` marks the rows
  left unfinished.
- ``generate(partial_tokens=, partial_logprobs=, sample_ids=)``: rows that continue a partial
  response; the output holds the whole response (old tokens and their log-probs as given, the
  new ones after them). With the same weights, seed and sample index, a resumed row samples
  the tokens the uninterrupted run samples (the noise is keyed by (seed, sample, step)); its
  logits come from a prefill instead of decode steps, so they are the uninterrupted run's bit for
  bit only where the arithmetic does not depend on the call's shape (--batch-invariant-mode).
- ``PartialRolloutBuffer``: the unfinished samples between iterations (and the finished samples
  of groups not yet complete), in a deterministic order, with a plain-tensor state dict for
  checkpoints, and ``staleness`` metrics of the samples a batch trains on.

Wired (``--rl-partial-rollouts``, puzzle/dataflow/partial_stage.py): the generation stage serves
buffered groups first, oldest first, then fresh prompts; generates under a run-wide seed with each
sample's global index (prompt index x N + sample index) as its noise key; records the policy version
of every token and hands the behaviour log-probs to the loss (``gen_logprobs``); the trainer's
state (trainer_state.json) keeps the buffer.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch


# ---------------------------------------------------------------------------------------------
# the stop rule
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GroupQuota:
    """Stop once ``groups_needed`` groups have every one of their rows finished.

    ``group_of``: the group id of each row of the ``generate`` call. A group's size is the
    number of its rows in this call: a carried group whose other samples finished earlier counts
    only its rows still generating (a group with none left counts before the call: the caller
    lowers ``groups_needed`` by it). The count is this rank's own (see ``generate``)."""

    group_of: Tuple[int, ...]
    groups_needed: int

    @classmethod
    def consecutive(cls, rows: int, group_size: int, groups_needed: int) -> "GroupQuota":
        """Rows in groups of ``group_size`` consecutive rows (prompt-major GRPO rows)."""
        if not isinstance(group_size, int) or group_size < 1 or rows % group_size:
            raise ValueError(f"group_size must be an int >= 1 dividing the {rows} rows (got {group_size!r})")
        return cls(tuple(r // group_size for r in range(rows)), groups_needed)

    def check(self, rows: int) -> None:
        if len(self.group_of) != rows:
            raise ValueError(f"GroupQuota: group_of has {len(self.group_of)} entries for {rows} rows")
        groups = len(set(self.group_of))
        if not isinstance(self.groups_needed, int) or not 1 <= self.groups_needed <= groups:
            raise ValueError(f"GroupQuota: groups_needed must be an int in [1, {groups}] "
                             f"(the groups of the rows; got {self.groups_needed!r})")

    def tracker(self) -> "QuotaTracker":
        return QuotaTracker(self)


class QuotaTracker:
    """The rows of each group still generating; ``add(finished rows)`` -> quota met."""

    def __init__(self, quota: GroupQuota):
        self.group_of = quota.group_of
        self.left: Dict[int, int] = dict(Counter(quota.group_of))
        self.needed = quota.groups_needed
        self.complete = 0
        self.seen = set()

    def add(self, rows: Iterable[int]) -> bool:
        for r in rows:
            if r in self.seen:
                raise RuntimeError(f"row {r} finished twice")
            self.seen.add(r)
            g = self.group_of[r]
            self.left[g] -= 1
            if self.left[g] == 0:
                self.complete += 1
        return self.complete >= self.needed


# ---------------------------------------------------------------------------------------------
# generate's resume arguments
# ---------------------------------------------------------------------------------------------
def check_resume(rows: int, params, vocab: int, tokens, logprobs
                 ) -> Optional[Tuple[List[List[int]], List[torch.Tensor]]]:
    """``generate``'s partial_tokens / partial_logprobs checked (one ValueError naming the
    problem); returns (tokens, float32 log-prob tensors) per row, or None without them."""
    if tokens is None and logprobs is None:
        return None
    if tokens is None or logprobs is None:
        raise ValueError("partial_tokens and partial_logprobs go together")
    if len(tokens) != rows or len(logprobs) != rows:
        raise ValueError(f"partial_tokens ({len(tokens)}) and partial_logprobs ({len(logprobs)}) "
                         f"need one entry per prompt ({rows})")
    stops = set(params.stop_ids)
    out_tok, out_lp = [], []
    for r, (tok, lp) in enumerate(zip(tokens, logprobs)):
        tok = tok.tolist() if isinstance(tok, torch.Tensor) else list(tok)
        lp = torch.as_tensor(lp, dtype=torch.float32).reshape(-1).cpu()
        if len(tok) != len(lp):
            raise ValueError(f"row {r}: {len(tok)} partial tokens but {len(lp)} log-probs")
        if len(tok) >= params.max_new_tokens:
            raise ValueError(f"row {r}: a partial response of {len(tok)} tokens leaves nothing of "
                             f"max_new_tokens={params.max_new_tokens} (it finished)")
        bad = [t for t in tok if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"row {r}: partial tokens outside [0, {vocab}): {bad[:5]}")
        if stops.intersection(tok):
            raise ValueError(f"row {r}: the partial response holds a stop id (it finished)")
        if not bool(torch.isfinite(lp).all()):
            raise ValueError(f"row {r}: partial log-probs must be finite")
        out_tok.append(tok)
        out_lp.append(lp)
    return out_tok, out_lp


def check_sample_ids(rows: int, sample_offset: int, sample_ids) -> List[int]:
    """Each row's global sample index: ``sample_ids`` checked, else sample_offset + row."""
    if sample_ids is None:
        return [sample_offset + r for r in range(rows)]
    ids = list(sample_ids)
    if len(ids) != rows or any(not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in ids):
        raise ValueError(f"sample_ids must be {rows} ints >= 0, one per prompt (got {sample_ids!r:.80})")
    if len(set(ids)) != rows:
        raise ValueError("sample_ids must be distinct (a repeated index samples the same noise)")
    return ids


# ---------------------------------------------------------------------------------------------
# the buffer between iterations
# ---------------------------------------------------------------------------------------------
@dataclass
class PartialSample:
    """One sample carried between iterations."""

    prompt_index: int        # the prompt's index in the data order (its group)
    sample_index: int        # the sample's index within its group
    sample_id: int           # its global sample index (the sampling noise's key)
    seed: int                # the generation seed it started under
    started: int             # the policy version it started under (the carry-over order)
    tokens: torch.Tensor     # [n] long: the response so far
    logprobs: torch.Tensor   # [n] float32: each token's log-prob as sampled (behaviour)
    versions: torch.Tensor   # [n] long: the policy version each token was sampled under
    finished: bool = False   # finished, waiting for the rest of its group

    @property
    def key(self) -> Tuple[int, int]:
        return self.prompt_index, self.sample_index

    def extended(self, tokens: torch.Tensor, logprobs: torch.Tensor, version: int,
                 finished: bool) -> "PartialSample":
        """This sample with ``tokens`` (the whole response now: its own as a prefix) sampled
        under ``version`` from its own length on."""
        n = len(self.tokens)
        tokens, logprobs = tokens.cpu().long(), logprobs.cpu().float()
        if len(tokens) < n or not torch.equal(tokens[:n], self.tokens):
            raise ValueError(f"sample {self.key}: the new response does not continue its tokens")
        versions = torch.cat([self.versions, torch.full((len(tokens) - n,), version, dtype=torch.long)])
        return PartialSample(self.prompt_index, self.sample_index, self.sample_id, self.seed,
                             self.started, tokens, logprobs, versions, finished)


_FIELDS = ("prompt_index", "sample_index", "sample_id", "seed", "started")


class PartialRolloutBuffer:
    """Samples carried over between iterations, keyed by (prompt index, sample index).

    Order (deterministic): groups by their oldest sample's ``started`` version, then prompt
    index; samples of a group by sample index. ``take`` hands out whole groups (every sample
    of a prompt the buffer holds), so a group is never split between iterations."""

    def __init__(self):
        self._samples: Dict[Tuple[int, int], PartialSample] = {}

    def __len__(self) -> int:
        return len(self._samples)

    def put(self, samples: Iterable[PartialSample]) -> None:
        samples = list(samples)
        keys = [s.key for s in samples]
        dup = [k for k in keys if k in self._samples] or [k for k, c in Counter(keys).items() if c > 1]
        if dup:
            raise ValueError(f"samples already in the buffer (prompt, sample): {dup[:5]}")
        for s in samples:
            if not len(s.tokens) == len(s.logprobs) == len(s.versions):
                raise ValueError(f"sample {s.key}: tokens, logprobs and versions differ in length")
            self._samples[s.key] = s

    def group_order(self) -> List[int]:
        """Prompt indices of the groups held, in the order ``take`` hands them out."""
        oldest: Dict[int, int] = {}
        for s in self._samples.values():
            oldest[s.prompt_index] = min(oldest.get(s.prompt_index, s.started), s.started)
        return sorted(oldest, key=lambda p: (oldest[p], p))

    def take(self, max_groups: Optional[int] = None) -> List[PartialSample]:
        """Removes and returns the first ``max_groups`` groups (all when None), in order."""
        groups = self.group_order()
        if max_groups is not None:
            groups = groups[:max(0, max_groups)]
        chosen = set(groups)
        rank = {p: i for i, p in enumerate(groups)}
        out = sorted((s for s in self._samples.values() if s.prompt_index in chosen),
                     key=lambda s: (rank[s.prompt_index], s.sample_index))
        for s in out:
            del self._samples[s.key]
        return out

    def state_dict(self) -> Dict[str, torch.Tensor]:
        """Plain tensors: the per-sample fields, the lengths and the concatenated sequences."""
        s = [self._samples[k] for k in sorted(self._samples)]
        state = {f: torch.tensor([getattr(x, f) for x in s], dtype=torch.long) for f in _FIELDS}
        state["finished"] = torch.tensor([x.finished for x in s], dtype=torch.bool)
        state["lengths"] = torch.tensor([len(x.tokens) for x in s], dtype=torch.long)
        for f, dtype in (("tokens", torch.long), ("logprobs", torch.float32), ("versions", torch.long)):
            state[f] = torch.cat([getattr(x, f) for x in s]) if s else torch.zeros(0, dtype=dtype)
        return state

    def load_state_dict(self, state: Dict[str, torch.Tensor]) -> None:
        lengths = state["lengths"].tolist()
        if sum(lengths) != len(state["tokens"]):
            raise ValueError("partial rollout buffer state: lengths do not add up to the tokens")
        seqs = {f: torch.split(state[f], lengths) for f in ("tokens", "logprobs", "versions")}
        fields = {f: state[f].tolist() for f in _FIELDS}
        self._samples = {}
        self.put(PartialSample(*(fields[f][i] for f in _FIELDS), tokens=seqs["tokens"][i].clone(),
                               logprobs=seqs["logprobs"][i].clone(), versions=seqs["versions"][i].clone(),
                               finished=bool(state["finished"][i]))
                 for i in range(len(lengths)))


def staleness(versions: Sequence[torch.Tensor], version: int) -> Dict[str, float]:
    """Metrics of the samples a batch trains on at policy ``version`` (one tensor of per-token
    policy versions per sample): the mean and max lag (``version`` - token's version) over the
    tokens, and the fraction of samples with a token from an earlier version (carried over)."""
    lags = torch.cat([version - v.long().reshape(-1) for v in versions]) if versions else torch.zeros(0)
    if len(lags) and int(lags.min()) < 0:
        raise ValueError(f"a token's policy version is newer than the current one ({version})")
    carried = sum(1 for v in versions if len(v) and int(v.min()) < version)
    return {"partial_token_lag_mean": float(lags.double().mean()) if len(lags) else 0.0,
            "partial_token_lag_max": float(lags.max()) if len(lags) else 0.0,
            "partial_carried_fraction": carried / len(versions) if versions else 0.0}
