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
from dataclasses import field, replace
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

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
def check_resume(rows: int, params, vocab: int, tokens, logprobs, observation=None
                 ) -> Optional[Tuple[List[List[int]], List[torch.Tensor]]]:
    """``generate``'s partial_tokens / partial_logprobs checked (one ValueError naming the
    problem); returns (tokens, float32 log-prob tensors) per row, or None without them.
    ``observation`` (multi-turn): per row None or its partial response's observation mask; an
    observation token may be a stop id (Qwen's ``<|im_end|>`` closes the model's turn before a
    tool response), a sampled one may not."""
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
        mask = observation[r] if observation is not None and observation[r] is not None else None
        if mask is not None and len(mask) != len(tok):
            raise ValueError(f"row {r}: {len(tok)} partial tokens but an observation mask of {len(mask)}")
        if stops.intersection(t for i, t in enumerate(tok) if mask is None or not mask[i]):
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
class EpisodeState:
    """A multi-turn sample's episode so far (``--env`` with ``--max-turns`` > 1), carried with it.

    An episode is carried only between turns of the decode loop's bookkeeping: every environment
    step its rows asked for has answered before the quota stop is acted on, and an observation
    not yet inserted whole is written into the response at the stop (``TurnTracker.flush``), so a
    carried sample never has an observation pending: it resumes by a prefill of prompt + response
    (observations included) and samples its next model token, as the uninterrupted run does
    after the observation's last token.

    The environment's instance (``env``) is carried in memory (it lives in the rank's process
    between steps anyway: each step takes it to a worker and back): exact also for environments
    whose steps are not reproducible, and no step is repeated. A checkpoint keeps everything but
    the instance; after a load (``restored``) the instance is rebuilt by replaying the recorded
    turns (``spans``) on a fresh ``reset(record)`` instance, which needs no pickle (the checkpoint
    loader refuses them) and gives the same instance for an environment whose steps depend only on
    its record and the turns."""

    observation: torch.Tensor                 # [n] bool: True at the observation tokens of the response
    spans: List[Tuple[int, int]] = field(default_factory=list)  # response columns [start, end) of each turn stepped
    turn_start: int = 0                       # response column of the current turn's first token
    reward: Optional[float] = None            # the sum of the rewards the steps gave (None: none)
    turn_rewards: List[Tuple[int, float]] = field(default_factory=list)  # (column of its turn's last token, reward)
    last_error: Optional[str] = None          # why the last step failed (None: it did not)
    env: Any = None                           # the environment instance (None: a fresh one at the next step)
    restored: bool = False                    # loaded from a checkpoint: ``env`` is rebuilt by replay

    @classmethod
    def fresh(cls) -> "EpisodeState":
        return cls(torch.zeros(0, dtype=torch.bool))

    def plain(self) -> dict:
        """The checkpointed fields (JSON values; the instance is not among them)."""
        return {"spans": [list(s) for s in self.spans], "turn_start": self.turn_start, "reward": self.reward,
                "turn_rewards": [list(t) for t in self.turn_rewards], "last_error": self.last_error}

    @classmethod
    def from_plain(cls, state: dict, observation: torch.Tensor) -> "EpisodeState":
        spans = [(int(a), int(b)) for a, b in state["spans"]]
        return cls(observation.bool(), spans, int(state["turn_start"]),
                   None if state["reward"] is None else float(state["reward"]),
                   [(int(c), float(v)) for c, v in state["turn_rewards"]], state["last_error"], None, bool(spans))


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
    episode: Optional[EpisodeState] = None  # multi-turn: its episode so far

    @property
    def key(self) -> Tuple[int, int]:
        return self.prompt_index, self.sample_index

    def extended(self, tokens: torch.Tensor, logprobs: torch.Tensor, version: int,
                 finished: bool, episode: Optional[EpisodeState] = None) -> "PartialSample":
        """This sample with ``tokens`` (the whole response now: its own as a prefix) sampled
        under ``version`` from its own length on (observation tokens inserted then too);
        ``episode``: its episode now (multi-turn)."""
        n = len(self.tokens)
        tokens, logprobs = tokens.cpu().long(), logprobs.cpu().float()
        if len(tokens) < n or not torch.equal(tokens[:n], self.tokens):
            raise ValueError(f"sample {self.key}: the new response does not continue its tokens")
        if episode is not None and (len(episode.observation) != len(tokens) or (self.episode is not None and not
                                    torch.equal(episode.observation[:n], self.episode.observation))):
            raise ValueError(f"sample {self.key}: the observation mask does not continue its own")
        versions = torch.cat([self.versions, torch.full((len(tokens) - n,), version, dtype=torch.long)])
        return replace(self, tokens=tokens, logprobs=logprobs, versions=versions, finished=finished,
                       episode=episode if episode is not None else self.episode)


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
            if s.episode is not None and len(s.episode.observation) != len(s.tokens):
                raise ValueError(f"sample {s.key}: its observation mask and tokens differ in length")
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

    def state_dict(self) -> Dict[str, Any]:
        """Plain tensors: the per-sample fields, the lengths and the concatenated sequences; with
        multi-turn samples also their concatenated observation masks (``observation``) and
        ``episodes``, each one's ``EpisodeState.plain()`` (JSON values; no environment instance)."""
        s = [self._samples[k] for k in sorted(self._samples)]
        state: Dict[str, Any] = {f: torch.tensor([getattr(x, f) for x in s], dtype=torch.long) for f in _FIELDS}
        state["finished"] = torch.tensor([x.finished for x in s], dtype=torch.bool)
        state["lengths"] = torch.tensor([len(x.tokens) for x in s], dtype=torch.long)
        for f, dtype in (("tokens", torch.long), ("logprobs", torch.float32), ("versions", torch.long)):
            state[f] = torch.cat([getattr(x, f) for x in s]) if s else torch.zeros(0, dtype=dtype)
        if any(x.episode is not None for x in s):
            if not all(x.episode is not None for x in s):
                raise ValueError("partial rollout buffer: multi-turn and single-turn samples mixed")
            state["observation"] = torch.cat([x.episode.observation for x in s])
            state["episodes"] = [x.episode.plain() for x in s]
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        lengths = state["lengths"].tolist()
        if sum(lengths) != len(state["tokens"]):
            raise ValueError("partial rollout buffer state: lengths do not add up to the tokens")
        seqs = {f: torch.split(state[f], lengths) for f in ("tokens", "logprobs", "versions")}
        fields = {f: state[f].tolist() for f in _FIELDS}
        episodes = [None] * len(lengths)
        if "episodes" in state:
            if len(state["episodes"]) != len(lengths) or len(state["observation"]) != len(state["tokens"]):
                raise ValueError("partial rollout buffer state: the episodes do not match the samples")
            masks = torch.split(state["observation"].bool(), lengths)
            episodes = [EpisodeState.from_plain(e, m.clone()) for e, m in zip(state["episodes"], masks)]
        self._samples = {}
        self.put(PartialSample(*(fields[f][i] for f in _FIELDS), tokens=seqs["tokens"][i].clone(),
                               logprobs=seqs["logprobs"][i].clone(), versions=seqs["versions"][i].clone(),
                               finished=bool(state["finished"][i]), episode=episodes[i])
                 for i in range(len(lengths)))


def staleness(versions: Sequence[torch.Tensor], version: int, max_staleness: Optional[int] = None
              ) -> Dict[str, float]:
    """Metrics of the samples a batch trains on at policy ``version`` (one tensor of per-token
    policy versions per sample): the mean and max lag (``version`` - token's version) over the
    tokens, the fraction of samples with a token from an earlier version (carried over) and the
    fraction of tokens ``stale_token_mask`` takes out of the loss (0 without ``max_staleness``)."""
    lags = torch.cat([version - v.long().reshape(-1) for v in versions]) if versions else torch.zeros(0)
    if len(lags) and int(lags.min()) < 0:
        raise ValueError(f"a token's policy version is newer than the current one ({version})")
    carried = sum(1 for v in versions if len(v) and int(v.min()) < version)
    masked = float((lags > max_staleness).double().mean()) if max_staleness is not None and len(lags) else 0.0
    return {"partial_token_lag_mean": float(lags.double().mean()) if len(lags) else 0.0,
            "partial_token_lag_max": float(lags.max()) if len(lags) else 0.0,
            "partial_carried_fraction": carried / len(versions) if versions else 0.0,
            "partial_stale_masked_frac": masked}


def stale_token_mask(versions: torch.Tensor, version: int, max_staleness: int) -> torch.Tensor:
    """[B, R] float: 0 for the response tokens sampled under a policy older than ``version`` -
    ``max_staleness`` (--rl-partial-rollouts-max-staleness), 1 elsewhere (newer tokens, and the
    positions after a response, whose version is -1). ``versions``: [B, R] long, each token's policy
    version; ``version``: the batch's (the weights that generated this iteration)."""
    if not isinstance(max_staleness, int) or max_staleness < 0:
        raise ValueError(f"max_staleness must be an int >= 0, got {max_staleness!r}")
    if versions.dim() != 2:
        raise ValueError(f"versions must be [B, R], got shape {tuple(versions.shape)}")
    if bool((versions > version).any()):
        raise ValueError(f"a token's policy version is newer than the current one ({version})")
    stale = (versions >= 0) & (versions < version - max_staleness)
    return (~stale).float()
